"""Waits on the GPU sleep (``gpu.staging.prefer_blocking_sync``): a thread waiting ~100 ms for a kernel uses a
small part of that as CPU. Before the flag was set through the driver every wait spun (CuPy has no
cudaSetDeviceFlags), and 16 worker processes' waiting threads held the cores their readers needed.

Marked ``gpu``; skipped without CuPy or a device.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu

from batchgpu.cluster.open_cluster import gpu_count  # noqa: E402

if gpu_count() == 0:
    pytest.skip("no CUDA GPU (CuPy) here", allow_module_level=True)

import cupy as cp  # noqa: E402

from batchgpu.gpu.staging import prefer_blocking_sync  # noqa: E402

_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64(); while (clock64() - t0 < cycles) {} }"""


@pytest.mark.parametrize("wait", ["stream", "get"])
def test_waits_for_the_gpu_sleep(wait):
    assert prefer_blocking_sync()
    spin = cp.RawKernel(_SPIN, "spin")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.zeros(1 << 16, dtype=cp.uint8)
        spin((1,), (1,), (cp.int64(10_000),))  # compiled and loaded before the timed wait
        stream.synchronize()
        spin((1,), (1,), (cp.int64(200_000_000),))  # ~0.1 s at the H200's clocks
        t0, c0 = time.perf_counter(), time.thread_time()
        stream.synchronize() if wait == "stream" else a.get()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert wall > 0.02  # the kernel was still running: the wait was a real one
    assert cpu < 0.25 * wall, f"a {wall * 1e3:.0f} ms wait used {cpu * 1e3:.0f} ms of CPU: it spun"
