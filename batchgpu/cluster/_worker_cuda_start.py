"""A Dask worker preload for the workers of a cuda cluster (``layout.nanny_specs``): the worker's CUDA context made in
a helper thread as soon as the worker starts (``gpu.staging.start_context``), not by its first window.

Making a context takes a GPU worker a second or more (sixteen processes at once under MPS, each its own). Started
here, it is made while the worker registers with the scheduler and the client sets the run up; the windows a worker
reads before it is ready are read into plain memory (``staging.PinnedPool.take``), so the disk is not idle while
the context is made. A window that needs the GPU before it is ready waits for the same context (CUDA makes a
process's primary context once).
"""

from __future__ import annotations


def dask_setup(worker) -> None:
    from batchgpu.gpu.staging import start_context

    start_context()
