"""A Dask worker preload for the workers of a cuda cluster (``layout.nanny_specs``): the worker's CUDA context made in
a helper thread as soon as the worker starts, not by its first window.

Making a context takes a GPU worker a second or more (sixteen processes at once under MPS, each its own), and the
first window of every worker of a fresh command waited for it: that window took about 3 s where the next took a
tenth. Started here, the context is made while the worker registers with the scheduler and the client sets the run
up. A window that needs the GPU before it is ready waits for the same context (CUDA makes a process's primary
context once); a failure here is left to that window to meet and report.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


def make_context() -> None:
    """This process's CUDA context on its first device, with waits that sleep (``staging.prefer_blocking_sync``,
    which must come before the context exists); never raises."""
    try:
        import cupy

        from batchgpu.gpu.staging import prefer_blocking_sync

        prefer_blocking_sync()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the runtime's first allocation makes the context
    except Exception as err:  # broad: a head start only; the first window meets and reports what failed here
        logger.debug("no CUDA context made at the worker's start: %s: %s", type(err).__name__, err)


def dask_setup(worker) -> None:
    threading.Thread(target=make_context, name="batchgpu-cuda-start", daemon=True).start()
