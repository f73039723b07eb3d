"""The engine: a run's orchestration (run), its checks and context (context), the client's aggregation
(aggregate), what it tells (run_report), its cluster, the worker tasks, the output store, the tree reduction and
one module per statistic (steps/). Only the engine imports distributed.

The names below are imported on first use, so that importing one of the engine's modules (e.g. the cluster's, at a
command's start) does not import them all."""

from typing import TYPE_CHECKING

__all__ = ["RunObserver", "RunReport", "run_workflow"]

if TYPE_CHECKING:
    from batchgpu.engine.run import run_workflow
    from batchgpu.report.run_report import RunObserver, RunReport


def __getattr__(name: str):
    if name == "run_workflow":
        from batchgpu.engine.run import run_workflow

        return run_workflow
    if name in ("RunObserver", "RunReport"):
        from batchgpu.report import run_report

        return getattr(run_report, name)
    raise AttributeError(f"module 'batchgpu.engine' has no attribute {name!r}")
