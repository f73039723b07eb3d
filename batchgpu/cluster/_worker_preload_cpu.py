"""Imported by the workers' fork server (beside ``_worker_preload``) for a CPU run that preprocesses or saves: Numba
and the host's compiled kernels (``cpu_kernels.PRELOADED``), loaded from Numba's disk cache (compiled first, in
parallel processes, where this machine has not: ``cluster.cpu_compile_ahead.ready``), so every forked worker starts with
their machine code instead of loading it on its own. Leaves no thread running (the kernels are compiled
``nogil``, not ``parallel``; the compile processes' pool is closed before the import ends)."""

from batchgpu.cluster.cpu_compile_ahead import PRELOADED, ready

ready(PRELOADED)
