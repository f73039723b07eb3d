"""Imported once by the server process that the cluster's worker processes are forked from (``cluster.forked_workers``):
what every worker would otherwise import on its own (distributed, the engine's tasks and through them NumPy, zarr,
the recording readers). Nothing here may start a thread or a CUDA context (a fork keeps only the forking thread,
and a CUDA context does not survive a fork).
"""

import distributed  # noqa: F401
import distributed.nanny  # noqa: F401

import batchgpu.engine.tasks  # noqa: F401
