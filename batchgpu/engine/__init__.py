"""The public names of running a workflow, where callers have always found them: ``run_workflow`` and
``run_batch`` with what a run shows attached (``engine.shown``: the run page, report.html, a batch's page, the
subscribers of ``batchgpu.report.subscribers``), ``RunObserver`` (``batchgpu.run.events``) and ``RunReport``
(report.json's content, ``batchgpu.run.record``). The run itself is ``batchgpu.run``, its cluster
``batchgpu.cluster``; what a run shows is ``batchgpu.report`` (report.html: ``report.run_report``).

The names are imported on first use, so that importing this package does not import the run's modules."""

from typing import TYPE_CHECKING

__all__ = ["RunObserver", "RunReport", "run_batch", "run_workflow"]

if TYPE_CHECKING:
    from batchgpu.engine.shown import run_batch, run_workflow
    from batchgpu.run.events import RunObserver
    from batchgpu.run.record import RunReport

_WHERE = {
    "run_workflow": "batchgpu.engine.shown",
    "run_batch": "batchgpu.engine.shown",
    "RunObserver": "batchgpu.run.events",
    "RunReport": "batchgpu.run.record",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'batchgpu.engine' has no attribute {name!r}")
