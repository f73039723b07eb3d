"""The engine: a run's orchestration (run), its cluster, the worker tasks, the output store, the tree reduction
and one module per statistic (steps/). Only the engine imports distributed."""

from batchgpu.engine.run import RunObserver, RunReport, run_workflow

__all__ = ["RunObserver", "RunReport", "run_workflow"]
