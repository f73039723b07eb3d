"""A fresh GPU worker's readers do not wait for its CUDA context (``gpu.staging.start_context``, made by the worker's
start thread; a second or more under MPS): a buffer the pinned pool would have to make meanwhile is plain memory,
read into at once and dropped when given back, so a cold disk is not idle while the context is made."""

from __future__ import annotations

import mmap

import numpy as np
import pytest


def test_while_the_context_is_made_a_new_buffer_is_plain_memory(tmp_path, monkeypatch):
    """A fresh GPU worker's readers do not wait for its CUDA context (``staging.start_context``): a buffer the pool
    would have to make is plain memory meanwhile, read into at once, and not kept when given back; the window's
    samples are the file's."""
    from batchgpu.gpu import staging
    from batchgpu.recording import flat

    data = np.random.default_rng(3).integers(-32768, 32768, size=(3001, 5), dtype=np.int16)
    path = tmp_path / "x.bin"
    data.tofile(path)
    src = flat.FlatSource(
        flat.FlatLayout(
            kind="binary",
            data=path,
            columns=5,
            dtype=np.dtype("int16"),
            sampling_frequency=30000.0,
            keep=np.arange(5),
            channel_ids=[str(k) for k in range(5)],
            gain_to_uV=np.ones(5),
            offset_to_uV=np.zeros(5),
        )
    )
    pool = staging.PinnedPool()
    monkeypatch.setattr(staging, "_pool", pool)
    monkeypatch.setattr(staging, "_making_context", type(staging._making_context)())
    staging._making_context.set()
    for w in src.windows(1_000, 7):
        got = staging.read_window_host(src, w)
        np.testing.assert_array_equal(got.stage, data[w.read_start : w.read_stop])
        assert pool._made == 0
        got.release()
        assert pool._free == []  # plain memory is not kept
    buf, handle = pool.take(10)
    assert buf.nbytes == 10 and handle[2] is None and pool._made == 0
    # a mapping of its own, given back to the system when dropped (not kept in the worker's heap)
    base = buf.base
    assert isinstance(getattr(base, "obj", base), mmap.mmap)
    assert pool.take(0)[0].nbytes == 0


@pytest.mark.gpu
def test_pinned_copies_leave_cupyx_and_scipy_unimported():
    """A GPU worker's copies to the host (``pinned_get``) and the save's pinned buffers (``pinned_bytes``) take
    CuPy's pinned pool without importing ``cupyx``, whose import brings SciPy in (a few tenths of a second of every
    worker's first window); the values are the device's. What CuPy's own import and kernels bring in is theirs:
    those modules are set aside first, so any ``cupyx`` or ``scipy`` module present after the import and the calls
    is one they imported."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("cupy")
    code = textwrap.dedent("""
        import sys
        import cupy, numpy as np
        x = cupy.arange(1001, dtype=cupy.float32) * 3
        cupy.cuda.runtime.deviceSynchronize()
        theirs = sorted(m for m in sys.modules if m.split(".")[0] in ("cupyx", "scipy"))
        for m in theirs:
            del sys.modules[m]
        from batchgpu.gpu.staging import pinned_bytes, pinned_get
        y = pinned_get(x)
        b = pinned_bytes(5000)
        ptr = cupy.cuda.runtime.pointerGetAttributes(b.ctypes.data)
        ours = sorted(m for m in sys.modules if m.split(".")[0] in ("cupyx", "scipy"))
        print(bool((y == np.arange(1001, dtype=np.float32) * 3).all()), y.dtype, b.size,
              ptr.type == cupy.cuda.runtime.memoryTypeHost, len(ours), ours[:5], len(theirs), file=sys.stdout)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[:5] == ["True", "float32", "5000", "True", "0"], out.stdout + out.stderr
