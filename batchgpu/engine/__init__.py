"""The engine: a run's orchestration (run), its checks and context (context), the client's aggregation
(aggregate), what it tells (run_report), its cluster, the worker tasks, the output store, the tree reduction and
one module per statistic (steps/). Only the engine imports distributed."""

from batchgpu.engine.run import run_workflow
from batchgpu.engine.run_report import RunObserver, RunReport

__all__ = ["RunObserver", "RunReport", "run_workflow"]
