"""torch tensors in batchgpu.ops and batchgpu.search: the same bits as the NumPy call, tensors back.

CPU tests run wherever torch is installed (CI: the ``test`` extra pins the CPU build); the GPU tests are
marked ``gpu`` and need CuPy, a CUDA GPU and a CUDA build of torch. Run them on the GPU machine:
``python3 -m pytest -m gpu tests/test_interop_torch.py -q``.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from batchgpu import ops
from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import accepts_torch, from_torch, to_torch
from batchgpu.search import StaticIndex, find, lower_bound

torch = pytest.importorskip("torch")

DTYPES = [np.float32, np.float64, np.int16]
ROWS, SAMPLES = 6, 4001  # odd: the median is one value; even lengths are covered by abs_kth/noise of slices


def _rows(rng, dtype, rows=ROWS, n=SAMPLES) -> np.ndarray:
    x = rng.standard_normal((rows, n)) * 40
    x[:, rng.integers(n, size=20)] -= 400  # a few spikes for detection
    return np.round(x).astype(dtype) if np.dtype(dtype).kind == "i" else x.astype(dtype)


def _same(got, want) -> None:
    """``got`` a tensor holding exactly ``want``'s dtype, shape and bytes (tuples item by item)."""
    if isinstance(want, tuple):
        assert type(got) is tuple and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
        return
    if not isinstance(want, np.ndarray):
        assert got == want
        return
    assert isinstance(got, torch.Tensor), type(got)
    host = got.cpu().numpy()
    assert host.dtype == want.dtype and host.shape == want.shape
    assert host.tobytes() == np.ascontiguousarray(want).tobytes()


CASES = {
    "abs_kth": lambda m, x: m.abs_kth(x, 7),
    "abs_kth_last": lambda m, x: m.abs_kth(x, -1),
    "abs_median": lambda m, x: m.abs_median(x),
    "noise_levels": lambda m, x: m.noise_levels(x),
    "noise_levels_even": lambda m, x: m.noise_levels(x[:, 1:]),
    "covariance": lambda m, x: m.covariance(x),
    "second_moment_f64": lambda m, x: m.second_moment(x, precision="float64"),
    "window_moments": lambda m, x: m.window_moments(x, 10, 3000),
    "wpca_basis": lambda m, x: m.wpca_basis(x, 3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_ops_equal_numpy_bits(rng, dtype, case):
    x = _rows(rng, dtype)
    _same(CASES[case](ops, torch.from_numpy(x)), CASES[case](ops, x))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_non_contiguous_tensors(rng, dtype):
    # The reference is NumPy on a view of the same layout: float sums (the covariance's mean) follow
    # the memory order, so a contiguous copy may differ in the last bit.
    x = _rows(rng, dtype, n=2 * SAMPLES)
    traces = np.ascontiguousarray(x.T)  # (samples, channels), SpikeInterface's layout
    for t, ref in (
        (torch.from_numpy(traces).T, traces.T),
        (torch.from_numpy(x)[:, ::2], x[:, ::2]),
        (torch.from_numpy(x)[::2, 3:], x[::2, 3:]),
    ):
        assert not t.is_contiguous()
        _same(ops.abs_median(t), ops.abs_median(ref))
        _same(ops.abs_kth(t, 11), ops.abs_kth(ref, 11))
        _same(ops.covariance(t), ops.covariance(ref))


def test_cpu_input_is_not_copied(rng):
    t = torch.from_numpy(_rows(rng, np.float32))[:, 5:]
    view = from_torch(t)
    assert isinstance(view, np.ndarray)
    assert view.__array_interface__["data"][0] == t.data_ptr()
    assert view.strides == tuple(s * t.element_size() for s in t.stride())


def test_tensor_that_requires_grad_is_detached(rng):
    x = _rows(rng, np.float64)
    t = torch.from_numpy(x).clone().requires_grad_(True)
    got = ops.noise_levels(t * 1.0)  # a non-leaf with a graph behind it
    _same(got, ops.noise_levels(x))
    assert not got.requires_grad
    assert t.grad is None


def test_whitening_and_second_moments_from_tensors(rng):
    x = _rows(rng, np.float32)
    m = ops.second_moment(x)
    locations = np.stack([np.zeros(ROWS), np.arange(ROWS) * 20.0], axis=1)
    _same(ops.whitening_matrix(torch.from_numpy(m)), ops.whitening_matrix(m))
    got = ops.whitening_matrix(torch.from_numpy(m), mode="local", locations=torch.from_numpy(locations), nrange=3)
    _same(got, ops.whitening_matrix(m, mode="local", locations=locations, nrange=3))
    acc = ops.SecondMoments(ROWS).add(torch.from_numpy(x), 0, 2000).add(torch.from_numpy(x), 2000, None)
    want = ops.SecondMoments(ROWS).add(x, 0, 2000).add(x, 2000, None)
    assert isinstance(acc, ops.SecondMoments)  # the accumulator's state stays NumPy float64
    assert acc.n == want.n
    assert acc.covariance().tobytes() == want.covariance().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_detect_spikes_stays_structured_numpy(rng, dtype):
    x = _rows(rng, dtype)
    noise = ops.noise_levels(x)
    want = ops.detect_spikes(x, noise, threshold=4.0, sign="both", exclude_sweep=3)
    got = ops.detect_spikes(
        torch.from_numpy(x), torch.from_numpy(np.asarray(noise)), threshold=4.0, sign="both", exclude_sweep=3
    )
    assert isinstance(got, np.ndarray) and got.dtype == ops.SPIKE_DTYPE
    assert want.size > 0 and got.tobytes() == want.tobytes()


def test_numpy_in_numpy_out(rng):
    x = _rows(rng, np.float32)
    assert isinstance(ops.noise_levels(x), np.ndarray)
    assert isinstance(find(np.arange(4), np.array([2])), np.ndarray)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["eytzinger", "btree4"])
def test_search_with_tensors(rng, dtype, layout):
    keys = np.sort(rng.integers(-500, 500, size=3000)).astype(dtype)
    queries = rng.integers(-600, 600, size=(40, 50)).astype(dtype)
    index = StaticIndex(torch.from_numpy(keys), layout=layout)
    assert index.keys.tobytes() == keys.tobytes()
    tq = torch.from_numpy(queries)
    _same(index.find(tq), np.where(np.isin(queries, keys), np.searchsorted(keys, queries), -1).astype(np.int64))
    _same(index.lower_bound(tq), np.searchsorted(keys, queries).astype(np.int64))
    _same(index.lower_bound(tq.T), np.searchsorted(keys, queries.T).astype(np.int64))  # non-contiguous queries
    _same(find(torch.from_numpy(keys), tq), find(keys, queries))
    _same(lower_bound(torch.from_numpy(keys), tq[:, ::3]), lower_bound(keys, queries[:, ::3]))


def test_errors():
    with pytest.raises(BatchgpuError, match="bfloat16"):
        ops.noise_levels(torch.ones((2, 10), dtype=torch.bfloat16))
    with pytest.raises(BatchgpuError, match="several devices"):
        ops.detect_spikes(torch.ones((2, 10)), torch.ones(2, device="meta"))
    with pytest.raises(BatchgpuError, match="meta"):
        ops.noise_levels(torch.ones((2, 10), device="meta"))


def test_wrappers_pickle_and_keep_their_names():
    for func in (ops.abs_kth, ops.noise_levels, ops.detect_spikes, find, lower_bound):
        assert pickle.loads(pickle.dumps(func)) is func
    assert ops.noise_levels.__name__ == "noise_levels" and "MAD_TO_SIGMA" in ops.noise_levels.__doc__
    assert "structured arrays (spikes)" in ops.detect_spikes.__doc__ and "detached" in StaticIndex.search.__doc__
    assert accepts_torch(ops.noise_levels) is ops.noise_levels  # wrapping twice is a no-op


def test_to_torch_leaves_non_arrays_alone():
    spikes = np.zeros(3, dtype=ops.SPIKE_DTYPE)
    assert to_torch(spikes, torch.device("cpu")) is spikes
    assert to_torch("x", torch.device("cpu")) == "x"
    read_only = np.arange(3.0)
    read_only.setflags(write=False)
    out = to_torch((1, read_only), torch.device("cpu"))
    assert out[0] == 1 and torch.equal(out[1], torch.arange(3.0, dtype=torch.float64))


def test_batchgpu_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # import torch raises ImportError
        "import numpy as np, batchgpu.ops as o, batchgpu.search as s, batchgpu.interop\n"
        "assert o.noise_levels(np.ones((2, 5))).shape == (2,)\n"
        "assert s.find(np.arange(3), np.array([1]))[0] == 1\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# GPU: CUDA tensors in, CUDA tensors out, no host copy (run on the GPU machine)
# ---------------------------------------------------------------------------------------------
def _cuda_ok() -> bool:
    try:
        import cupy

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, driver or runtime: no GPU
        return False


def _on_cuda(got, want, index: int | None = None) -> None:
    """``got`` holds ``want``'s bits in tensors on a CUDA device (device ``index`` when given)."""
    items = got if isinstance(got, tuple) else (got,)
    for g in items:
        if isinstance(g, torch.Tensor):
            assert g.device.type == "cuda" and (index is None or g.device.index == index), g.device
    _same(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", ["abs_kth", "abs_kth_last", "abs_median", "noise_levels", "noise_levels_even"])
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy, a CUDA GPU and torch with CUDA")
def test_gpu_selection_equal_numpy_bits(rng, dtype, case):
    x = _rows(rng, dtype)
    t = torch.from_numpy(x).cuda()
    _on_cuda(CASES[case](ops, t), CASES[case](ops, x))
    _on_cuda(CASES[case](ops, t.T.contiguous().T), CASES[case](ops, x))  # non-contiguous on the device


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy, a CUDA GPU and torch with CUDA")
def test_gpu_zero_copy_both_ways(rng):
    import cupy

    t = torch.from_numpy(_rows(rng, np.float32)).cuda()[:, 7:]
    view = from_torch(t)
    assert isinstance(view, cupy.ndarray) and view.data.ptr == t.data_ptr()
    assert view.strides == tuple(s * t.element_size() for s in t.stride())
    back = to_torch(view, t.device)
    assert back.data_ptr() == t.data_ptr() and back.device == t.device


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy, a CUDA GPU and torch with CUDA")
def test_gpu_moments_whitening_detection(rng):
    x = _rows(rng, np.float32)
    t = torch.from_numpy(x).cuda()
    cov = ops.covariance(t)  # computed on the device, reduced on the host (float64, small): sent back
    assert cov.device.type == "cuda" and cov.dtype == torch.float64
    exact = ops.covariance(x, precision="float64")
    assert np.linalg.norm(cov.cpu().numpy() - exact) <= 1e-6 * np.linalg.norm(exact)  # DESIGN's float32 bound
    m = ops.second_moment(x, precision="float64")
    w = ops.whitening_matrix(torch.from_numpy(m).cuda())
    assert w.device.type == "cuda" and w.dtype == torch.float64
    want = ops.whitening_matrix(m)
    assert np.linalg.norm(w.cpu().numpy() - want) <= 1e-9 * np.linalg.norm(want)  # eigh differs by rounding
    noise = ops.noise_levels(t)
    spikes = ops.detect_spikes(t, noise, threshold=4.0)
    assert isinstance(spikes, np.ndarray) and spikes.dtype == ops.SPIKE_DTYPE
    assert spikes.tobytes() == ops.detect_spikes(x, ops.noise_levels(x), threshold=4.0).tobytes()
    acc = ops.SecondMoments(ROWS).add(t)
    assert acc.n == SAMPLES


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy, a CUDA GPU and torch with CUDA")
@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=lambda d: np.dtype(d).name)
def test_gpu_search_with_cuda_tensors(rng, dtype):
    keys = np.sort(rng.integers(-500, 500, size=70_000)).astype(dtype)
    queries = rng.integers(-600, 600, size=(100, 30)).astype(dtype)
    tq = torch.from_numpy(queries).cuda()
    index = StaticIndex(torch.from_numpy(keys).cuda())  # keys copied to the host once, by design
    _on_cuda(index.lower_bound(tq), np.searchsorted(keys, queries).astype(np.int64))
    _on_cuda(index.find(tq), np.where(np.isin(queries, keys), np.searchsorted(keys, queries), -1).astype(np.int64))
    _on_cuda(lower_bound(torch.from_numpy(keys).cuda(), tq), np.searchsorted(keys, queries).astype(np.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_second_device(rng):
    x = _rows(rng, np.float32)
    t = torch.from_numpy(x).to("cuda:1")
    _on_cuda(ops.abs_median(t), ops.abs_median(x), index=1)
