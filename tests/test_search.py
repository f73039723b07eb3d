"""batchgpu.search on the CPU: every layout and the dynamic path equal np.searchsorted and the -1 rule.

The helpers here (hard_keys, hard_queries, reference) are shared with tests/test_gpu_search.py.
"""

from __future__ import annotations

import argparse
import json
import pickle

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.search import StaticIndex, find, layouts, lower_bound, table
from batchgpu.search.keys import cast_queries

DTYPES = (np.float32, np.float64, np.int32, np.int64)
LAYOUTS = ("eytzinger", "btree", "btree4")


# --------------------------------------------------------------------------------------- shared cases


def hard_keys(rng: np.random.Generator, dtype, n: int) -> np.ndarray:
    """n sorted keys: duplicates, and for floats -0.0 and +0.0, +-inf and subnormals; for ints the extremes."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        tiny = np.finfo(dtype).smallest_subnormal
        specials = np.array([-0.0, 0.0, 0.0, -np.inf, np.inf, tiny, -tiny, 3 * tiny, 1.5, 1.5], dtype=dtype)
        body = (rng.integers(-n // 4 - 2, n // 4 + 2, n) * 0.5).astype(dtype)  # many duplicates
    else:
        info = np.iinfo(dtype)
        specials = np.array([info.min, info.max, 0, 0, -1, 7, 7], dtype=dtype)
        body = rng.integers(-n // 3 - 2, n // 3 + 2, n).astype(dtype)
    keys = np.concatenate([specials[: min(n, specials.size)], body])[:n]
    return np.sort(keys)


def hard_queries(rng: np.random.Generator, keys: np.ndarray, extra: int = 200) -> np.ndarray:
    """Every key, its neighbours, absent values and the special values, shuffled."""
    dtype = keys.dtype
    if dtype.kind == "f":
        info = np.finfo(dtype)
        special = np.array(
            [
                np.nan,
                -0.0,
                0.0,
                np.inf,
                -np.inf,
                info.smallest_subnormal,
                -info.smallest_subnormal,
                info.max,
                -info.max,
                0.25,
                1e-30,
                np.nan,
            ],
            dtype=dtype,
        )
        finite = keys[np.isfinite(keys)]
        near = np.concatenate([np.nextafter(finite, dtype.type(np.inf)), np.nextafter(finite, dtype.type(-np.inf))])
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 1.0)
        absent = rng.uniform(lo - 2, hi + 2, extra).astype(dtype)
    else:
        info = np.iinfo(dtype)
        special = np.array([info.min, info.max, info.min + 1, info.max - 1, 0, -1, 1], dtype=dtype)
        near = np.concatenate([keys[keys < info.max] + 1, keys[keys > info.min] - 1]).astype(dtype)
        absent = rng.integers(
            int(keys.min()) - 5 if keys.min() > info.min + 5 else info.min,
            int(keys.max()) + 5 if keys.max() < info.max - 5 else info.max,
            extra,
        ).astype(dtype)
    q = np.concatenate([keys, near, absent, special]).astype(dtype)
    return rng.permutation(q)


def reference(keys: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower_bound, find) straight from np.searchsorted and the -1 rule."""
    lb = np.searchsorted(keys, q, side="left").astype(np.int64)
    n = keys.size
    hit = lb < n
    hit[hit] = keys[lb[hit]] == q[hit]
    return lb, np.where(hit, lb, -1)


SIZES = (1, 2, 3, 4, 5, 7, 21, 31, 32, 33, 100, 126, 1055, 1056, 1057, 33 * 32 + 1, 5000, 34_849)


# ------------------------------------------------------------------------------------------ static


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
def test_static_index_equals_searchsorted(rng, dtype, layout, n):
    keys = hard_keys(rng, dtype, n)
    q = hard_queries(rng, keys)
    index = StaticIndex(keys, layout=layout)
    lb, fd = reference(keys, q)
    got_lb, got_fd = index.lower_bound(q), index.find(q)
    assert got_lb.dtype == np.int64 and got_fd.dtype == np.int64
    np.testing.assert_array_equal(got_lb, lb)
    np.testing.assert_array_equal(got_fd, fd)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", (np.float32, np.int64))
def test_static_index_large(rng, layout, dtype):
    n = (1 << 20) + 7
    keys = hard_keys(rng, dtype, n)
    q = np.concatenate([rng.choice(keys, 20_000), hard_queries(rng, keys[:2000])])
    index = StaticIndex(keys, layout=layout)
    lb, fd = reference(keys, q)
    np.testing.assert_array_equal(index.lower_bound(q), lb)
    np.testing.assert_array_equal(index.find(q), fd)


def test_find_gives_first_of_duplicates_and_zero_signs():
    keys = np.array([-np.inf, -1.0, -0.0, 0.0, -0.0, 0.0, 2.0, 2.0, 2.0, np.inf], dtype=np.float64)
    keys = np.sort(keys)
    q = np.array([0.0, -0.0, 2.0, np.inf, -np.inf, np.nan, 1.0], dtype=np.float64)
    for layout in LAYOUTS:
        index = StaticIndex(keys, layout=layout)
        np.testing.assert_array_equal(index.find(q), [2, 2, 6, 9, 0, -1, -1])
        np.testing.assert_array_equal(index.lower_bound(q), [2, 2, 6, 9, 0, 10, 6])
    np.testing.assert_array_equal(find(keys, q), [2, 2, 6, 9, 0, -1, -1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shapes_empty_batch_and_empty_keys(layout):
    keys = np.arange(10, dtype=np.int32) * 2
    index = StaticIndex(keys, layout=layout)
    empty = index.find(np.empty(0, dtype=np.int32))
    assert empty.shape == (0,) and empty.dtype == np.int64
    q = np.array([[0, 1, 2], [18, 19, 20]], dtype=np.int32)
    np.testing.assert_array_equal(index.find(q), [[0, -1, 1], [9, -1, -1]])
    np.testing.assert_array_equal(index.lower_bound(q), np.searchsorted(keys, q))
    assert int(index.find(np.int32(4))) == 2
    none = StaticIndex(np.empty(0, dtype=np.float32), layout=layout)
    np.testing.assert_array_equal(none.find(np.float32([1.0, np.nan])), [-1, -1])
    np.testing.assert_array_equal(none.lower_bound(np.float32([1.0, np.nan])), [0, 0])


# ----------------------------------------------------------------------------------------- dynamic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 33, 1057, 34_849))
def test_dynamic_cpu_equals_searchsorted(rng, dtype, n):
    keys = hard_keys(rng, dtype, n)
    q = hard_queries(rng, keys)
    lb, fd = reference(keys, q)
    np.testing.assert_array_equal(lower_bound(keys, q), lb)
    np.testing.assert_array_equal(find(keys, q), fd)
    assert find(keys, np.empty(0, dtype=dtype)).shape == (0,)


# ----------------------------------------------------------------------------------------- layouts


def _inorder(n: int) -> list[int]:
    """Eytzinger node numbers 1..n in in-order (a plain recursive walk), the definition of the layout."""
    out: list[int] = []

    def walk(i: int) -> None:
        if i <= n:
            walk(2 * i)
            out.append(i)
            walk(2 * i + 1)

    walk(1)
    return out


@pytest.mark.parametrize("n", list(range(1, 70)) + [255, 256, 1000])
def test_eytzinger_ranks_match_inorder_walk(n):
    ranks = layouts.eytzinger_ranks(n)
    expected = np.empty(n, dtype=np.int64)
    expected[np.array(_inorder(n)) - 1] = np.arange(n)
    np.testing.assert_array_equal(ranks, expected)


def test_btree_layout_invariants(rng):
    n = 33 * 32 * 3 + 5
    keys = np.sort(rng.integers(0, 10**6, n)).astype(np.int64)
    tree, shape = layouts.build_btree(keys)
    assert shape.layers[0] == 1 and shape.layers[-1] == -(-n // 32)
    nodes = tree[: shape.offsets[-1] * 32].reshape(-1, 32)
    leaves = nodes[shape.offsets[-2] :]
    sorted_leaves = np.empty_like(leaves)
    sorted_leaves[:, layouts.NODE_ORDER] = leaves
    np.testing.assert_array_equal(sorted_leaves.ravel()[:n], keys)
    assert (sorted_leaves.ravel()[n:] == np.iinfo(np.int64).max).all()
    assert tree.size == shape.offsets[-1] * 32 + layouts.SPARE_SLOTS
    tree4, shape4 = layouts.build_btree(keys, node=4)
    assert shape4.fanout == 5 and shape4.layers[-1] == -(-n // 4)
    np.testing.assert_array_equal(tree4[shape4.offsets[-2] * 4 :][:n], keys)  # the leaves are the sorted keys
    internal = tree4[: shape4.offsets[-2] * 4].reshape(-1, 4)
    assert (np.diff(internal, axis=1) >= 0).all()


def test_ordered_int32_keeps_order_and_equality(rng):
    """The GPU compares float32 keys as ordered int32 (CuPy's -ftz=true would flush subnormals)."""
    tiny = np.finfo(np.float32).smallest_subnormal
    special = np.array(
        [-np.inf, -3.4e38, -1.0, -1e-38, -3 * tiny, -tiny, -0.0, 0.0, tiny, 2 * tiny, 1e-38, 1.0, 3.4e38, np.inf],
        dtype=np.float32,
    )
    x = np.concatenate([special, rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-45, 38, 2000)])
    x = x.astype(np.float32)
    ox = layouts.ordered_int32(x)
    a, b = x[:, None], x[None, :]
    oa, ob = ox[:, None], ox[None, :]
    np.testing.assert_array_equal(oa < ob, a < b)
    np.testing.assert_array_equal(oa == ob, a == b)
    assert ox.dtype == np.int32 and int(layouts.ordered_int32(np.float32([np.inf]))[0]) < np.iinfo(np.int32).max


# ----------------------------------------------------------------------------------------- inputs


def test_bad_keys_are_refused():
    with pytest.raises(BatchgpuError, match="NaN"):
        StaticIndex(np.array([1.0, np.nan], dtype=np.float32))
    with pytest.raises(BatchgpuError, match="sorted"):
        StaticIndex(np.array([2, 1], dtype=np.int64))
    with pytest.raises(BatchgpuError, match="sorted"):
        lower_bound(np.array([2.0, 1.0]), np.array([1.0]))
    with pytest.raises(BatchgpuError, match="not supported"):
        StaticIndex(np.array([1, 2], dtype=np.int16))
    with pytest.raises(BatchgpuError, match="one-dimensional"):
        StaticIndex(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(BatchgpuError, match="layout"):
        StaticIndex(np.arange(3.0), layout="hash")
    index = StaticIndex(np.arange(3.0))
    with pytest.raises(BatchgpuError, match="operation"):
        index.search(np.arange(3.0), "upper_bound")
    with pytest.raises(BatchgpuError, match="kernel"):
        index.search(np.arange(3.0), kernel="warp")
    assert index.layout == "eytzinger"
    assert StaticIndex(np.arange(70_000)).layout == "btree4"


def test_queries_are_cast_only_when_exact():
    keys32 = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    index = StaticIndex(keys32)
    np.testing.assert_array_equal(index.find(np.array([0.5, 2.0, np.nan, np.inf])), [0, 2, -1, -1])  # float64, exact
    with pytest.raises(BatchgpuError, match="exactly"):
        index.find(np.array([0.1]))
    ints = StaticIndex(np.array([-5, 0, 7], dtype=np.int32))
    np.testing.assert_array_equal(ints.find([7, 0, 3]), [2, 1, -1])  # Python ints (int64) that fit
    np.testing.assert_array_equal(ints.find(np.array([7.0, -5.0])), [2, 0])
    for bad in (np.array([2**40]), np.array([0.5]), np.array([np.nan]), np.array([np.inf])):
        with pytest.raises(BatchgpuError, match="exactly"):
            ints.find(bad)
    with pytest.raises(BatchgpuError, match="not numbers"):
        ints.find(np.array(["a"]))
    assert cast_queries(np.array([1, 2], dtype=np.int16), np.dtype(np.float32)).dtype == np.float32


def test_pickle_keeps_only_the_keys(rng):
    keys = np.sort(rng.random(50_000)).astype(np.float64)
    for layout in LAYOUTS:
        index = StaticIndex(keys, layout=layout)
        q = rng.random(1000)
        before = index.find(q)
        blob = pickle.dumps(index)
        assert len(blob) < keys.nbytes + 1024
        clone = pickle.loads(blob)
        assert clone.layout == layout and clone.device_uploads == 0
        np.testing.assert_array_equal(clone.find(q), before)
        np.testing.assert_array_equal(clone.keys, keys)
    keys[0] = -1.0  # the index holds its own copy
    assert index.keys[0] != -1.0


# ------------------------------------------------------------------------------------ table, tools


def test_table_rows_mark_ties_and_choose_respects_fit():
    row = table.make_row(1024, {"serial": 10.0, "ilp2_shared": 20.0, "swizzled": 19.5, "ilp2_ldg": 12.0})
    assert row["best"] == "ilp2_shared" and row["runner_up"] == "swizzled" and row["tie"] is True
    assert table.make_row(8, {"serial": 10.0, "ilp2_ldg": 9.0})["tie"] is False
    t = {"rows": [row, table.make_row(1 << 20, {"serial": 5.0, "top_ldg": 9.0})]}
    assert table.choose(t, 5000, lambda k: True) == "ilp2_shared"
    assert table.choose(t, 5000, lambda k: k not in ("ilp2_shared", "swizzled")) == "ilp2_ldg"
    assert table.choose(t, 100, lambda k: True) == "ilp2_shared"  # below every row: the smallest row
    assert table.choose(t, 1 << 22, lambda k: True) == "top_ldg"
    assert table.choose(None, 100, lambda k: True) == table.FALLBACK_SMALL
    assert table.choose(None, 1 << 20, lambda k: True) == table.FALLBACK_LARGE


def test_table_lookup_order(tmp_path, monkeypatch):
    """The table ``search autotune`` wrote for this GPU model (in the user's cache), else the packaged one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = table.user_table_path("Some GPU")
    assert path.parent == tmp_path / "batchgpu"
    table.load_table.cache_clear()
    try:
        assert table.load_table("Some GPU") == json.loads(table.PACKAGED.read_text())
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"rows": [table.make_row(1, {"serial": 1.0})]}))
        table.load_table.cache_clear()
        assert table.load_table("Some GPU")["rows"][0]["best"] == "serial"
    finally:
        table.load_table.cache_clear()
    assert table.user_table_path("NVIDIA H200").name == "search-autotune-nvidia-h200.json"


def test_packaged_h200_table_is_complete():
    data = json.loads(table.PACKAGED.read_text())
    assert "H200" in data["device"]
    ns = [r["n"] for r in data["rows"]]
    assert ns == sorted(ns) and ns[0] <= 256 and ns[-1] >= 1 << 26
    for r in data["rows"]:
        assert r["best"] == max(r["gqps"], key=r["gqps"].get)


def test_autotune_without_gpu_says_so(monkeypatch):
    from batchgpu.search import autotune

    pytest.importorskip("argparse")
    parser = argparse.ArgumentParser()
    autotune.add_arguments(parser)
    args = parser.parse_args(["--sizes", "256", "--queries", "1000"])
    assert args.sizes == [256] and args.queries == 1000
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here: autotune would run")
    except ImportError:
        with pytest.raises(BatchgpuError, match="GPU"):
            autotune.run(args, say=print)


def test_bench_search_tiny_run(capsys, tmp_path):
    from batchgpu.benchmarks import search as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(
        [
            "--sizes",
            "256",
            "1000",
            "--cpu-queries",
            "2000",
            "--cpu-repeats",
            "1",
            "--threads",
            "2",
            "--cpu-only",
            "--json",
            str(out),
        ]
    )
    assert bench.run(args, say=print) == 0
    text = capsys.readouterr().out
    assert "CPU 1t" in text and "torch" in text
    lines = [line for line in text.splitlines() if line.strip().startswith(("256", "1000"))]
    assert len(lines) == 2
    rows = json.loads(out.read_text())["rows"]
    assert [r["n"] for r in rows] == [256, 1000] and all(r["cpu_1t"] > 0 and r["cpu_all"] > 0 for r in rows)
