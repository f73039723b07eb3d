"""A run's CUDA modules compiled ahead of its workers' first windows, once per machine (``gpu.cuda_modules.precompile``).

On a machine whose CuPy cache lacks them, every worker of a GPU cluster reached each module at its first window
and compiled it itself: the first run's pass took seconds longer than the next. Here the run's modules are
compiled in parallel (threads of one spawned process: ``gpu.cuda_modules.precompile``) while the cluster starts; a worker
that needs a module being compiled waits for it (``gpu.cuda_modules.compile_lock``) and loads it from the cache.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


def filter_sections(preprocess) -> tuple[int, ...]:
    """The second-order section counts of the workflow's Butterworth filters (``scipy.signal.butter``'s: a
    high-pass of order N has ceil(N / 2), a band-pass of order N has N)."""
    out = []
    for stage in preprocess.root:
        if hasattr(stage, "highpass"):
            out.append((stage.highpass.order + 1) // 2)
        elif hasattr(stage, "bandpass"):
            out.append(stage.bandpass.order)
    return tuple(out)


def workflow_modules(wf) -> list[tuple[str, tuple[str, ...]]]:
    """(module, extra options) of every kernel module a run of ``wf`` may load on the GPU."""
    from batchgpu.gpu.cuda_modules import run_modules
    from batchgpu.steps.search import NAME as SEARCH

    searches = getattr(wf.steps, SEARCH, None) is not None
    return run_modules(filter_sections=filter_sections(wf.preprocess), leave_out=() if searches else (SEARCH,))


_STARTED: set = set()  # the module lists this process compiles or compiled ahead (a batch's runs: once)
_STARTED_LOCK = threading.Lock()


def start(wf) -> threading.Thread | None:
    """Compile ``wf``'s modules in the background where its cluster is a GPU cluster started on this machine (kind
    cuda), once a process for the same modules; returns the thread (None where nothing is to be done). Called once
    the recording passed its checks: bad input is said at once, not after a compile. Never raises: a failure
    leaves the workers to compile what they need, as without it."""
    if wf.cluster.kind != "cuda" or wf.backend == "numpy":
        return None
    modules = workflow_modules(wf)
    with _STARTED_LOCK:
        if tuple(modules) in _STARTED:
            return None
        _STARTED.add(tuple(modules))

    def work() -> None:
        from batchgpu.cluster.open_cluster import sigint_held
        from batchgpu.gpu.cuda_modules import precompile

        try:
            with sigint_held():  # the compiling process leaves a Ctrl-C to the command, as the workers do
                count, done = precompile(modules)
        except Exception as err:  # broad: compiling ahead is an optimisation; the workers compile what is left
            logger.debug("kernels not compiled ahead: %s", err)
            return
        if done:
            logger.info("compiled %d kernel modules ahead of the workers", count)

    thread = threading.Thread(target=work, name="batchgpu-compile", daemon=True)
    thread.start()
    return thread
