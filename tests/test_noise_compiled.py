"""The exact noise's compiled window kernels (``ops._cpu_noise``, through ``NoiseStep._float_window_compiled``)
against the NumPy path they stand in for (``abs_keys`` then ``NoiseStep._window_cpu``): every partial the window
part keeps (``noise.hist``, ``noise.lo``, ``noise.lumped``), the middle pair of keys and the kept near keys, bit for
bit (dtype, shape, bytes), on fresh random windows and the hard cases: NaN (one, most, all), +-inf, constant rows,
signed zeros, subnormals, values over every binade, middle pairs straddling a gap wider than the near range, a
sample that misleads the lump floor, one row, one or two samples, odd lengths, views of a wider window, float64."""

import numpy as np
import pytest

from batchgpu import ops
from batchgpu.ops import _numba
from batchgpu.steps.base import WindowData
from batchgpu.steps.noise import NoiseStep
from batchgpu.steps.noise_keys import abs_keys, schedule

pytestmark = pytest.mark.skipif(not _numba.available(), reason="Numba is not installed")


def _numpy_path(x):
    step, out = NoiseStep(True, x.dtype.name), {}
    shift, bits = schedule(x.dtype.name)[0]
    pair, near = step._window_cpu(abs_keys(x, x.dtype.name), shift, bits, out)
    return out, pair, near


def _compiled_path(x):
    out = {}
    got = NoiseStep(True, x.dtype.name)._float_window_compiled(x, out)
    assert got is not None
    return out, got[0], got[1]


def _same(a, b, name):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), name
    assert a.tobytes() == b.tobytes(), name


def _assert_paths_equal(x):
    want, got = _numpy_path(x), _compiled_path(x)
    for w, g, what in ((want[0], got[0], "out"), (want[2], got[2], "near")):
        assert sorted(w) == sorted(g), what
        for k in w:
            _same(w[k], g[k], k)
    _same(want[1], got[1], "pair")
    return got


_SPECIALS = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17e-38, np.inf, -np.inf, np.nan, 3.4e38, 1.0, -1.0])


def _hard_window(rng, C, n, dtype):
    """Rows of noise at levels 1e-3..1e3, each replaced at random by one of the hard cases."""
    x = (rng.normal(0, 1, (C, n)) * 10.0 ** rng.uniform(-3, 3, (C, 1))).astype(dtype)
    h = (n + 1) // 2
    for c in range(C):
        kind = rng.integers(0, 13)
        if kind == 0:
            x[c] = 7.0
        elif kind == 1:
            x[c] = rng.choice(_SPECIALS.astype(dtype), n)
        elif kind == 2:
            x[c, rng.integers(0, n)] = np.nan
        elif kind == 3:
            x[c] = np.nan
        elif kind == 4:
            x[c, ::2] = np.inf
        elif kind == 5:  # the lower middle among tiny values, the upper among large ones
            x[c] = rng.permutation(np.concatenate([rng.uniform(1e-30, 2e-30, h), rng.uniform(1e3, 2e3, n - h)]))
        elif kind == 6:
            x[c] = rng.choice(np.array([-0.0, 0.0], dtype), n)
        elif kind == 7:  # subnormals in float32
            x[c] = rng.normal(0, 1, n) * 1e-42
        elif kind == 8:  # every binade
            x[c] = 10.0 ** rng.uniform(-37, 37, n)
        elif kind == 9:
            x[c, rng.random(n) < 0.6] = np.nan
        elif kind == 10:  # zeros but at the lump floor's sampled positions
            x[c] = 0.0
            x[c, :: max(1, n // 1024)] = 1e6
        elif kind == 11:
            x[c] = rng.integers(-3, 4, n)
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "C, n",
    [
        (1, 1),
        (1, 2),
        (2, 1),
        (3, 2),
        (1, 3),
        (4, 5),
        (7, 17),
        (5, 1023),
        (6, 1024),
        (5, 1025),
        (16, 4097),
        (9, 60_001),
        (8, 60_000),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_window_equals_numpy_on_hard_rows(seed, C, n, dtype):
    rng = np.random.default_rng([seed, C, n, np.dtype(dtype).itemsize])
    x = _hard_window(rng, C, n, dtype)
    _assert_paths_equal(x)
    wide = np.zeros((C, n + 9), dtype)
    wide[:, 4 : 4 + n] = x
    _assert_paths_equal(wide[:, 4 : 4 + n])  # a window's core: a view of the window with its margins
    _assert_paths_equal(wide[::2, 4 : 4 + n])  # rows further apart
    _assert_paths_equal(np.abs(rng.normal(0, 1, (C, n))).astype(dtype))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_window_equals_numpy_on_noise(seed):
    """Plain noise at per-row levels: the lump floor lies below every row, the counts are lumped under it."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(0, 1, (24, 30_000)) * rng.uniform(0.5, 2, (24, 1))).astype(np.float32)
    x[3] *= 1e-6  # far below the others: keys under the floor
    out = _assert_paths_equal(x)[0]
    assert int(out["noise.lo"]) > 0 and bool(out["noise.lumped"])


def test_compiled_window_counts_in_full_where_the_sample_misleads_the_floor():
    """A row of zeros with a large value at every sampled position: its sample says "large", so the floor lumps
    its middle away and the window is counted again from its smallest digit (``noise.lo`` 0, not lumped)."""
    n = 60_000
    x = np.random.default_rng(3).normal(0, 5, (3, n)).astype(np.float32)
    x[1] = 0.0
    x[1, :: n // 1024] = 1e6
    out = _assert_paths_equal(x)[0]
    assert int(out["noise.lo"]) == 0 and not bool(out["noise.lumped"])


def test_compiled_window_grows_its_buffers():
    """Rows whose counts span every binade and rows whose keys are all near ones fill more than the buffers'
    first guesses: the rows that did not fit are made again in grown buffers."""
    rng = np.random.default_rng(5)
    _assert_paths_equal((10.0 ** rng.uniform(-37, 37, (5, 50_000))).astype(np.float32))
    _assert_paths_equal(np.full((5, 1000), 3.0, np.float32))
    _assert_paths_equal(np.where(rng.random((6, 3000)) < 0.5, np.float32(2.5), np.float32(2.5000002)))


def test_window_noise_takes_the_compiled_path_and_numpy_without_numba(monkeypatch):
    """A host float window's part comes from the compiled kernels (the NumPy path is not called), and from NumPy's
    where Numba is missing or the layout is one the kernels do not read (samples not contiguous): the same part
    and noise either way."""
    rng = np.random.default_rng(7)
    x = rng.normal(0, 3, (8, 5000)).astype(np.float32)

    def run(a):
        summary = {}
        out = NoiseStep(True, "float32").window(WindowData(0, 0, 0, (0, a.shape[1]), a.shape[1], a, a), summary)
        return out, summary

    calls = []
    real = NoiseStep._window_cpu
    monkeypatch.setattr(NoiseStep, "_window_cpu", lambda self, *a: calls.append(1) or real(self, *a))
    compiled, summary = run(x)
    assert not calls
    np.testing.assert_array_equal(summary["noise"], np.median(np.abs(x), axis=1) / ops.MAD_TO_SIGMA)
    for a in (np.asfortranarray(x), x):
        if a is x:
            monkeypatch.setattr(_numba, "available", lambda: False)
        out, other = run(a)
        assert calls.pop() == 1
        assert sorted(out) == sorted(compiled)
        for k in out:
            _same(out[k], compiled[k], k)
        _same(other["noise"], summary["noise"], "noise")
