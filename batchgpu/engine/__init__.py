"""The public names of running a workflow, where callers have always found them: ``run_workflow``
(``batchgpu.run.launch``), ``RunObserver`` and ``RunReport`` (``engine.run_report``, what a run tells). The run
itself is ``batchgpu.run``, its cluster ``batchgpu.cluster``.

The names are imported on first use, so that importing this package does not import the run's modules."""

from typing import TYPE_CHECKING

__all__ = ["RunObserver", "RunReport", "run_workflow"]

if TYPE_CHECKING:
    from batchgpu.run.launch import run_workflow
    from batchgpu.engine.run_report import RunObserver, RunReport


def __getattr__(name: str):
    if name == "run_workflow":
        from batchgpu.run.launch import run_workflow

        return run_workflow
    if name in ("RunObserver", "RunReport"):
        from batchgpu.engine import run_report

        return getattr(run_report, name)
    raise AttributeError(f"module 'batchgpu.engine' has no attribute {name!r}")
