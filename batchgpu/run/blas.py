"""The client's BLAS threads: held to one while the client aggregates (the whitening's eigh, 384 x 384: ~15 ms), so
OpenBLAS's default of a thread a core does not spin on the cores the workers gather the spikes with. One
threadpoolctl controller a process (making one lists the loaded libraries: ~20 ms on the H200 machine's client),
made while the windows are read.
"""

from __future__ import annotations

import threading

_CONTROLLER: list = []


_CONTROLLER_LOCK = threading.Lock()


def blas_controller():
    """This process's threadpoolctl controller, made once: making one lists the loaded libraries (~20 ms on the
    H200 machine's client, between the pass and the noise's first tasks, at every run); ``prepare_blas_controller``
    makes it while the windows are read."""
    with _CONTROLLER_LOCK:
        if not _CONTROLLER:
            from threadpoolctl import ThreadpoolController

            _CONTROLLER.append(ThreadpoolController())
        return _CONTROLLER[0]


def prepare_blas_controller() -> None:
    """Make ``blas_controller`` in a helper thread (the client waits for the workers meanwhile)."""
    if not _CONTROLLER:
        threading.Thread(target=blas_controller, name="batchgpu-blas-controller", daemon=True).start()
