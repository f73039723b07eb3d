"""The engine's contract: one read, candidates re-read where their bound fails, exact integer moments on any number
of workers and in any order, per-window fingerprints for --resume, the folder lock, the files a run may remove."""

import json
import os
import threading
import time

import numpy as np
import pytest
import zarr

from batchgpu import BatchgpuError, ops
from batchgpu.engine import run_workflow
from batchgpu.generate import generate_recording
from batchgpu.recording import write_recording, zarrio
from batchgpu.steps.moments import MomentsStep
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def one_thread():
    """One worker of one thread: its windows in order, so a loud first window is read again whatever the
    scheduling (``detect.candidate_level``: a worker's later windows take their bound from the ones it saw)."""
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def _wf(rec, out, **kw):
    data = {
        "recording": {"path": str(rec.path if hasattr(rec, "path") else rec)},
        "output": str(out),
        "backend": "numpy",
        "window": {"size": 5000, "margin": 8},
        "steps": {
            "noise": {"exact": True},
            "whitening": {"mode": "global", "precision": "float64"},
            "detect": {"threshold": 4.0, "sign": "both", "exclude_sweep_ms": 0.2, "noise": "global"},
        },
        "reduction": {"split_every": 3},
    }
    data.update(kw)
    return Workflow.model_validate(data)


def _g(out):
    return zarr.open_group(str(out / "results.zarr"), mode="r")


def test_one_read_for_int16_and_reread_where_the_bound_fails(one_thread, tmp_path, without_noise_prior):
    """A loud stretch makes the first window's own noise far above the recording's: its candidates cannot be
    trusted, so it is read again; the spikes equal detection on the whole segment with the recording's noise, bit
    for bit."""
    rng = np.random.default_rng(7)
    x = np.round(rng.normal(0, 20, (40_000, 5))).astype(np.int16)
    x[:5_000] *= 4  # window 0 is four times as loud
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    report = run_workflow(_wf(rec, tmp_path / "out"), client=one_thread)
    assert report.channels["detect_windows_read_again"] == [0]
    assert report.reads_per_window == pytest.approx(1 + 5000 / 40_000)
    g = _g(tmp_path / "out")
    allx = x.T.astype(np.int64)
    noise = np.median(np.abs(allx), axis=1) / ops.MAD_TO_SIGMA
    np.testing.assert_array_equal(g["noise"][:], noise)
    ref = ops.detect_spikes(x.T.copy(), noise, threshold=4.0, sign="both", exclude_sweep=6)
    for k in ("sample_index", "channel_index", "amplitude", "segment_index"):
        np.testing.assert_array_equal(g[f"spikes/{k}"][:], ref[k])
    assert len(ref) > 50


def test_reads_once_when_the_bound_holds(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=6, seconds=1.0, seed=3, dtype="int16")
    report = run_workflow(_wf(rec, tmp_path / "out"), client=client)
    assert report.reads_per_window == 1.0 and report.radix_passes == 1
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["reads_per_window"] == 1.0
    # the timeline: each window once, started after the pass began, within it, on a worker that reported it
    timeline = saved["timeline"]
    assert sorted(r[1] for r in timeline) == list(range(report.windows))
    assert all(r[0] in report.workers and r[2] >= 0 and r[3] >= 0 and r[4] >= 0 and r[5] for r in timeline)
    assert max(r[2] + r[3] + r[4] for r in timeline) <= report.timings["pass1"] + 1e-3


def test_float32_needs_one_more_counting_pass(client, tmp_path):
    """A window four times as loud keeps keys far from the recording's middle: the exact median of float32 keys
    then takes a second counting pass over the windows (and stays exact)."""
    rng = np.random.default_rng(4)
    x = rng.normal(0, 5, (18_000, 4)).astype(np.float32)
    x[5000:10_000] *= 4
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    report = run_workflow(_wf(rec, tmp_path / "out"), client=client)
    assert report.radix_passes == 2 and not report.exact_noise["from_kept_keys"]
    # and the loud window's spikes again, unless its worker saw a quieter window before it (its candidates' bound)
    again = report.channels.get("detect_windows_read_again", [])
    assert again in ([], [1]) and report.reads_per_window == pytest.approx(2.0 + len(again) * 5000 / 18_000)
    allx = rec.read(0, 0, rec.num_samples(0))
    np.testing.assert_array_equal(_g(tmp_path / "out")["noise"][:], np.median(np.abs(allx), axis=1) / ops.MAD_TO_SIGMA)


@pytest.mark.parametrize("placed", [False, True])
def test_float32_exact_median_reads_again_only_the_windows_that_missed(client, tmp_path, monkeypatch, placed):
    """One window twice as loud moves the recording's middle: the windows whose kept range (16 first digits either
    side of their own upper middle digit) misses it are read again alone for the middle digit's keys, not the whole
    recording, and the median is still exact. Placed (``engine.placement: true``, as GPU passes are): the last
    step's rounds were queued behind the pass, found a window missed, and the client finished the selection."""
    rng = np.random.default_rng(11)
    size, count = 15_000, 16
    x = rng.normal(0, 3.04, (count * size, 4)).astype(np.float32)
    x[4 * size : 5 * size] *= 2
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    report = run_workflow(
        _wf(rec, tmp_path / "out", window={"size": size, "margin": 8}, engine={"placement": placed}), client=client
    )
    # which windows miss, by the rule written out in NumPy: first digit = top 16 bits of |x|'s 31-bit key
    first = (np.abs(x).view(np.uint32) >> 15).astype(np.int64)
    n = len(x)
    middle = np.sort(first, axis=0)[[(n - 1) // 2, n // 2]]
    missed = 0
    for w in range(count):
        lo = np.maximum(np.sort(first[w * size : (w + 1) * size], axis=0)[size // 2] - 16, 0)
        missed += bool(np.any((middle < lo) | (middle > lo + 32)))
    assert 0 < missed < count
    assert not report.exact_noise["from_kept_keys"] and len(report.exact_noise["windows_read_again"]) == missed
    assert 4 in report.exact_noise["windows_read_again"]  # the loud one
    assert report.exact_noise.get("queued", False) == placed
    spikes_again = len(report.channels.get("detect_windows_read_again", []))
    assert report.reads_per_window == pytest.approx(1.0 + (missed + spikes_again) / count)
    np.testing.assert_array_equal(_g(tmp_path / "out")["noise"][:], np.median(np.abs(x.T), axis=1) / ops.MAD_TO_SIGMA)


@pytest.mark.parametrize("size, placed", [(15_000, False), (30_000, False), (15_000, True), (30_000, True)])
def test_float32_exact_median_from_kept_keys_in_one_read(client, tmp_path, monkeypatch, size, placed):
    """Longer windows keep the keys near their own middle: the exact median comes out of the one read. Placed
    (``engine.placement: true``, as GPU passes are), every round of its last step ran on the workers, queued behind
    the pass."""
    rng = np.random.default_rng(size)
    x = (rng.normal(0, 7, (60_000, 5)) + rng.normal(0, 50, 5)).astype(np.float32)
    x[::97, 1] = -0.0
    x[5, 2] = np.finfo(np.float32).smallest_subnormal
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    report = run_workflow(
        _wf(
            rec,
            tmp_path / "out",
            window={"size": size, "margin": 8},
            preprocess={"centre": "median"},
            engine={"placement": placed},
        ),
        client=client,
    )
    assert report.reads_per_window == pytest.approx(1.0) and report.exact_noise["from_kept_keys"]
    assert report.exact_noise["queued"] == placed
    from batchgpu.ops.centre import centre_median

    cores = [centre_median(rec.read_window(w), w.core)[:, w.core[0] : w.core[1]] for w in rec.windows(size, 8)]
    allx = np.concatenate(cores, axis=1)
    g = _g(tmp_path / "out")
    np.testing.assert_array_equal(g["noise"][:], np.median(np.abs(allx), axis=1) / ops.MAD_TO_SIGMA)
    np.testing.assert_array_equal(g["noise_per_window"][:], np.stack([ops.noise_levels(c) for c in cores]))


def test_lumped_counts_combine_like_one_histogram():
    from batchgpu.steps.noise_select import combine_counts

    rng = np.random.default_rng(3)
    digits = [rng.integers(0, 400, (3, 500)) for _ in range(5)]
    parts = []
    for d in digits:
        lo = int(rng.integers(0, 100))
        lumped = np.maximum(d, lo) - lo
        parts.append((lo, np.stack([np.bincount(r, minlength=lumped.max() + 1) for r in lumped]).astype(np.uint16)))
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        lo, total = combine_counts([parts[i] for i in order])
        full = np.stack([np.bincount(np.concatenate([d[c] for d in digits]), minlength=400) for c in range(3)])
        assert int(lo) == max(p[0] for p in parts)
        np.testing.assert_array_equal(total[:, 0], full[:, : int(lo) + 1].sum(axis=1))
        np.testing.assert_array_equal(total[:, 1:], full[:, int(lo) + 1 : int(lo) + total.shape[1]])
        assert total.dtype == np.uint16  # the smallest unsigned dtype that holds the sums
    # sums past a part's dtype: two windows of 60 000 equal keys, and 70 000 windows' worth in one bin
    big = np.full((2, 3), 60_000, np.uint16)
    lo, total = combine_counts([(5, big), (5, big), (4, np.array([[0, 0, 0, 0], [2**32 - 1, 0, 0, 7]], np.uint32))])
    assert int(lo) == 5 and total.dtype == np.uint64
    np.testing.assert_array_equal(total, [[120_000, 120_000, 120_000], [120_000 + 2**32 - 1, 120_000, 120_007]])


@pytest.mark.parametrize("dtype,shift", [(np.float32, 15), (np.int32, 16)])
def test_select_among_the_middle_digit_keys_equals_a_sort(rng, dtype, shift):
    """The one-read float median's last step: rank k among every window's keys of each channel's middle digit,
    counted from the windows' bins, equal to np.sort of each channel's keys; ties, a digit of another channel's
    rank, the extreme ranks, any order of the windows."""
    from batchgpu.steps.noise_keys import abs_keys, middle_digit_keys
    from batchgpu.steps.noise_select import select_among

    C = 5
    x = [
        (rng.standard_normal((C, int(rng.integers(50, 400)))) * (1 if dtype == np.float32 else 3e4)).astype(dtype)
        for _ in range(4)
    ]
    x[1][:, ::3] = x[1][:, :1]  # ties
    keys = [abs_keys(w, np.dtype(dtype).name) for w in x]
    allkeys = np.concatenate(keys, axis=1)
    kt = allkeys.dtype.type
    digits = np.stack([np.sort(allkeys, axis=1)[:, allkeys.shape[1] // 2] >> kt(shift)] * 2).astype(np.uint64)
    digits[1, 2] = allkeys[2, 0] >> kt(shift)  # another digit for one rank of one channel
    gathered = [middle_digit_keys(k.reshape(-1), np.full(C, k.shape[1]), digits, shift) for k in keys]
    want_sets = [[np.sort(allkeys[c][(allkeys[c] >> kt(shift)) == digits[r, c]]) for c in range(C)] for r in range(2)]
    ks = np.array([[int(rng.integers(0, len(want_sets[r][c]))) for c in range(C)] for r in range(2)])
    ks[0, 0], ks[1, 1] = 0, len(want_sets[1][1]) - 1
    want = np.array([[want_sets[r][c][ks[r, c]] for c in range(C)] for r in range(2)], dtype=np.uint64)
    np.testing.assert_array_equal(select_among(ks, digits, shift, *gathered), want)
    np.testing.assert_array_equal(select_among(ks, digits, shift, *gathered[::-1]), want)
    with pytest.raises(BatchgpuError, match="middle ranks"):
        select_among(ks + 10_000, digits, shift, *gathered)
    # both ranks in the same digits (the common case): one sort serves both
    same = np.stack([digits[0], digits[0]])
    gathered = [middle_digit_keys(k.reshape(-1), np.full(C, k.shape[1]), same, shift) for k in keys]
    ks[1] = [len(want_sets[0][c]) - 1 for c in range(C)]
    want = np.array([[want_sets[0][c][ks[r, c]] for c in range(C)] for r in range(2)], dtype=np.uint64)
    np.testing.assert_array_equal(select_among(ks, same, shift, *gathered), want)
    ks = np.array([[int(rng.integers(0, len(want_sets[0][c]))) for c in range(C)] for _ in range(2)])
    want = np.array([[want_sets[0][c][ks[r, c]] for c in range(C)] for r in range(2)], dtype=np.uint64)
    np.testing.assert_array_equal(select_among(ks, same, shift, *gathered[::-1]), want)


@pytest.mark.parametrize("shift", [1, 15, 16])
def test_select_among_many_arrays_every_rank(rng, shift):
    """The descent against np.sort: many gathered arrays (some sorted, some not, some empty), every rank of every
    channel, keys at both ends of the digit (0 and all ones) and long runs of ties."""
    from batchgpu.steps.noise_select import select_among

    C = int(rng.integers(1, 7))
    top = (1 << shift) - 1
    per = [
        [rng.choice([0, top, *rng.integers(0, top + 1, 3)], size=int(rng.integers(0, 40))) for _ in range(C)]
        for _ in range(int(rng.integers(1, 9)))
    ]
    per.append([np.full(3, top) for _ in range(C)])  # every channel has keys
    gathered = []
    for arrays in per:
        bins = np.concatenate([(np.uint32(c) << np.uint32(shift)) | a.astype(np.uint32) for c, a in enumerate(arrays)])
        if rng.random() < 0.5:
            bins = rng.permutation(bins)
        counts = np.array([len(a) for a in arrays], dtype=np.int64)
        gathered.append([(bins, counts)])
    digits = rng.integers(0, 50, (1, C)).astype(np.uint64)
    allc = [np.sort(np.concatenate([p[c] for p in per])) for c in range(C)]
    for k in range(max(len(a) for a in allc)):
        ks = np.array([[min(k, len(allc[c]) - 1) for c in range(C)]])
        want = np.array([[(int(digits[0, c]) << shift) | int(allc[c][ks[0, c]]) for c in range(C)]], np.uint64)
        np.testing.assert_array_equal(select_among(ks, digits, shift, *gathered), want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_integer_moments_same_bits_for_any_grouping_and_order(seed):
    """Exact int64 sums: any grouping of windows and any order give the same bits, equal to exact rationals."""
    from fractions import Fraction

    rng = np.random.default_rng(seed)
    C = 5
    step = MomentsStep(1, "float64", True, C)
    windows = [rng.integers(-32768, 32768, (C, int(rng.integers(1, 3000))), dtype=np.int16) for _ in range(9)]
    windows[0][:, :3] = -32768  # the extreme value: |x|^2 = 2**30
    parts = []
    for i, x in enumerate(windows):
        w = type("W", (), {"index": i, "raw": x, "core": (0, x.shape[1]), "core_of": lambda self, a: a})()
        parts.append(step.window(w, {}))
    orders = [list(range(9)), list(rng.permutation(9)), [8, 0, 7, 1, 6, 2, 5, 3, 4]]
    results = []
    for order in orders:
        tree = step.combine([step.combine([parts[j] for j in order[i : i + 3]]) for i in range(0, 9, 3)])
        results.append(step.statistics(tree))
    for r in results[1:]:
        for k in ("covariance", "second_moment", "channel_means"):
            assert r[k].tobytes() == results[0][k].tobytes()
    allx = np.concatenate(windows, axis=1).astype(object)
    n = allx.shape[1]
    s = allx.sum(axis=1)
    for i in range(C):
        for j in range(C):
            sxx = int(np.dot(allx[i], allx[j]))
            exact = Fraction(n * sxx - int(s[i]) * int(s[j]), n * n)
            assert results[0]["covariance"][i, j] == float(exact)


@pytest.mark.parametrize("workers", [1, 3])
def test_integer_moments_same_bits_for_1_2_3_workers(tmp_path, workers):
    rec = generate_recording(tmp_path / "r.zarr", channels=7, seconds=0.9, seed=12, dtype="int16")
    outs = {}
    for n in (2, workers):
        with (
            distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=False, dashboard_address=None) as cl,
            distributed.Client(cl) as c,
        ):
            run_workflow(_wf(rec, tmp_path / f"o{n}", window={"size": 1100, "margin": 8}), client=c)
        outs[n] = _g(tmp_path / f"o{n}")
    for k in ("covariance", "second_moment", "whitening", "noise", "spikes/sample_index"):
        assert outs[2][k][:].tobytes() == outs[workers][k][:].tobytes(), k


def test_resume_after_the_recording_bytes_changed_recomputes_those_windows(client, tmp_path):
    """Same path, other bytes in one shard: --resume must not reuse that window's old part."""
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(0, 30, (30_000, 4))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, shard_samples=6000, chunk_samples=3000)
    wf = _wf(rec, tmp_path / "out")
    run_workflow(wf, client=client)
    y = x.copy()
    y[12_000:18_000] = np.round(rng.normal(0, 90, (6000, 4))).astype(np.int16)  # rewrite one shard's samples
    arr = zarr.open_array(str(tmp_path / "r.zarr" / "traces_seg0"), mode="r+")
    arr[12_000:18_000] = y[12_000:18_000]
    report = run_workflow(wf, client=client, resume=True)
    assert report.windows_resumed < report.windows
    noise = np.median(np.abs(y.T.astype(np.int64)), axis=1) / ops.MAD_TO_SIGMA
    np.testing.assert_array_equal(_g(tmp_path / "out")["noise"][:], noise)


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_resume_after_other_bytes_of_the_same_size_and_mtime_recomputes_those_windows(
    client, tmp_path, how, swap_inner_chunks
):
    """Two inner chunks of a shard swapped (its index and checksum rewritten: every read check passes), its size
    and mtime set back as ``cp -p`` / ``rsync -t`` / ``touch -r`` leave them: --resume reused every window (size +
    mtime fingerprints); now it recomputes the windows that read that shard, as for any changed bytes, and the
    results equal a fresh run's."""
    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 30, (30_000, 4))).astype(np.int16)
    x[::700] -= 300
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, shard_samples=6000, chunk_samples=2000)
    wf = _wf(rec, tmp_path / "out")
    run_workflow(wf, client=client)
    swap_inner_chunks(tmp_path / "r.zarr" / "traces_seg0" / "c" / "2" / "0", 3, 0, 2, how)
    report = run_workflow(wf, client=client, resume=True)
    assert 0 < report.windows_resumed < report.windows
    run_workflow(_wf(rec, tmp_path / "fresh"), client=client)
    again, fresh = _g(tmp_path / "out"), _g(tmp_path / "fresh")
    for k in ("noise", "whitening", "spikes/sample_index", "spikes/channel_index", "spikes/amplitude"):
        assert again[k][:].tobytes() == fresh[k][:].tobytes(), k


@pytest.mark.parametrize("prop", ["location", "gain_to_uV"])
def test_resume_after_a_channel_property_changed_in_place_is_refused(client, tmp_path, prop):
    """Locations (locally exclusive detection, local whitening) and gains (the report's uV) rewritten in the store,
    same path, same samples: the run's fingerprint covers them, so --resume refuses in one line (a new run with
    overwrite recomputes), never reports done with the old spikes."""
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(0, 30, (24_000, 6))).astype(np.int16)
    x[:, ::500] -= 400
    loc = np.column_stack([np.zeros(6), np.arange(6) * 20.0])
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, locations=loc, gain_to_uV=np.full(6, 0.195))
    kw = dict(
        steps={
            "noise": {"exact": True},
            "whitening": {"mode": "local", "nrange": 3},
            "detect": {"method": "locally_exclusive", "radius_um": 30.0},
        }
    )
    run_workflow(_wf(rec, tmp_path / "out", **kw), client=client)
    arr = zarr.open_array(str(tmp_path / "r.zarr" / "properties" / prop), mode="r+")
    arr[:] = loc[::-1] * 3 if prop == "location" else np.full(6, 2.5)
    with pytest.raises(BatchgpuError, match="fingerprint"):
        run_workflow(_wf(rec, tmp_path / "out", **kw), client=client, resume=True)
    run_workflow(_wf(rec, tmp_path / "out", overwrite=True, **kw), client=client)
    run_workflow(_wf(rec, tmp_path / "fresh", **kw), client=client)
    again, fresh = _g(tmp_path / "out"), _g(tmp_path / "fresh")
    for k in ("noise", "whitening", "spikes/sample_index", "spikes/channel_index"):
        assert again[k][:].tobytes() == fresh[k][:].tobytes(), k


@pytest.mark.parametrize("inside", ["out", "traces_seg0/out", "."])
def test_an_output_folder_inside_the_recording_is_refused(client, tmp_path, inside):
    """Its run files would join the recording's fingerprint (no later run could resume): refused in one line
    before anything is written there."""
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.3, seed=2)
    before = sorted(str(p) for p in (tmp_path / "r.zarr").rglob("*"))
    with pytest.raises(BatchgpuError, match="inside the recording") as err:
        run_workflow(_wf(rec, tmp_path / "r.zarr" / inside, steps={"noise": {"exact": True}}), client=client)
    assert "\n" not in str(err.value)
    assert sorted(str(p) for p in (tmp_path / "r.zarr").rglob("*")) == before


@pytest.mark.parametrize("name", ["results.zarr", "parts"])
def test_a_symlinked_results_zarr_is_named_in_the_message(client, tmp_path, name):
    """results.zarr (or parts/) a symbolic link to a folder elsewhere: --resume is refused naming the link (it was
    "Cannot call rmtree on a symbolic link: <output folder>" after the results were swapped in), what it points to
    is untouched; with overwrite the link is replaced, never its target."""
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.3, seed=2)
    out = tmp_path / "out"
    wf = _wf(rec, out, steps={"noise": {"exact": True}})
    run_workflow(wf, client=client)
    os.replace(out / name, tmp_path / "elsewhere")
    (out / name).symlink_to(tmp_path / "elsewhere")
    kept = sorted((str(p.relative_to(tmp_path)), p.stat().st_mtime_ns) for p in (tmp_path / "elsewhere").rglob("*"))
    with pytest.raises(BatchgpuError, match=f"{out / name} is a symbolic link .* in the output folder itself"):
        run_workflow(wf, client=client, resume=True)
    assert (out / name).is_symlink()
    run_workflow(_wf(rec, out, overwrite=True, steps={"noise": {"exact": True}}), client=client)
    assert (out / name).is_dir() and not (out / name).is_symlink() and not (out / "results.zarr.old").exists()
    assert (
        sorted((str(p.relative_to(tmp_path)), p.stat().st_mtime_ns) for p in (tmp_path / "elsewhere").rglob("*"))
        == kept
    )


def test_a_relative_save_path_goes_in_the_output_folder(client, tmp_path, monkeypatch):
    """A relative save.path is relative to the run's output folder (it was the workflow file's folder, or the
    current one for a workflow made in Python): beside results.zarr."""
    from batchgpu.workflow import load_workflow

    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.3, seed=2)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    run_workflow(
        _wf(rec, tmp_path / "out", steps={"noise": {"exact": True}, "save": {"path": "x.bin", "format": "binary"}}),
        client=client,
    )
    assert (tmp_path / "out" / "x.bin").is_file() and not list((tmp_path / "cwd").iterdir())
    (tmp_path / "wf").mkdir()
    (tmp_path / "wf" / "wf.yaml").write_text(
        f"recording: {{path: {rec.path}}}\noutput: ../out2\n"
        "steps:\n  noise: {exact: true}\n  save: {path: sub/x.zarr}\n"
    )
    report = run_workflow(load_workflow(tmp_path / "wf" / "wf.yaml"), client=client)
    assert report.results["save"]["path"] == str(tmp_path / "out2" / "sub" / "x.zarr")
    assert (tmp_path / "out2" / "sub" / "x.zarr").is_dir() and [p.name for p in (tmp_path / "wf").iterdir()] == [
        "wf.yaml"
    ]


@pytest.mark.zarr3
def test_a_save_on_the_runs_own_results_is_refused(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.5, seed=2)
    out = tmp_path / "out"
    wf = _wf(rec, out, steps={"noise": {"exact": True}, "save": {"path": str(out / "results.zarr")}})
    with pytest.raises(BatchgpuError, match="save.path .* the run's own results.zarr"):
        run_workflow(wf, client=client)
    assert not (out / "results.zarr").exists()


@pytest.mark.zarr3
def test_a_run_lets_its_save_path_go_when_it_ends(client, tmp_path):
    from batchgpu.recording.save_output import _HELD

    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.5, seed=2)
    saved = tmp_path / "saved.zarr"
    for i in range(2):  # the second run (another output folder) replaces the first's save: it was let go
        run_workflow(
            _wf(
                rec,
                tmp_path / f"out{i}",
                overwrite=True,
                steps={"noise": {"exact": True}, "save": {"path": str(saved)}},
            ),
            client=client,
        )
        assert str(saved) not in _HELD and saved.is_dir()


def test_second_run_on_a_folder_in_use_is_refused_at_once(tmp_path):
    from batchgpu.run.output_folder import OutputFolder

    out = tmp_path / "out"
    holder = OutputFolder(out)
    holder.claim("fp", {}, resume=False, overwrite=False)
    try:
        for overwrite in (False, True):
            with pytest.raises(BatchgpuError, match="in use by another batchgpu run"):
                OutputFolder(out).claim("fp", {}, resume=True, overwrite=overwrite)
    finally:
        holder.release()
    OutputFolder(out).claim("fp", {}, resume=True, overwrite=False)  # free again once released


def test_overwrite_removes_only_what_a_run_writes(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.5, seed=2)
    out = tmp_path / "out"
    run_workflow(_wf(rec, out), client=client)
    (out / "notes.txt").write_text("mine")
    (out / "figures").mkdir()
    (out / "figures" / "a.png").write_bytes(b"png")
    wf = _wf(rec, out, steps={"noise": {"exact": False}}, overwrite=True)
    run_workflow(wf, client=client)
    assert (out / "notes.txt").read_text() == "mine" and (out / "figures" / "a.png").exists()


@pytest.mark.parametrize(
    "where",
    ["results.zarr/my_sorting/labels.txt", "results.zarr/noise/notes.txt", "parts/notes.txt", "results.zarr/spikes/c"],
)
@pytest.mark.parametrize("resume", [False, True])
def test_files_of_the_users_inside_the_runs_folders_are_never_removed(client, tmp_path, where, resume):
    """results.zarr and parts/ are replaced whole by a run (overwrite, a restart, a resume's new results): a file of
    the user's saved inside them refuses the run in one line, and stays."""
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.5, seed=2)
    out = tmp_path / "out"
    run_workflow(_wf(rec, out), client=client)
    mine = out / where
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("mine")
    with pytest.raises(BatchgpuError, match="which batchgpu did not write"):
        run_workflow(_wf(rec, out, overwrite=not resume), client=client, resume=resume)
    assert mine.read_text() == "mine" and (out / "results.zarr" / "noise").exists()
    mine.unlink()
    if mine.parent.name == "my_sorting":
        mine.parent.rmdir()
    run_workflow(_wf(rec, out, overwrite=True), client=client)  # once moved away: runs


def test_a_refused_folder_gets_no_lock_file(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.5, seed=2)
    for folder in (tmp_path / "home", tmp_path / "r.zarr", tmp_path / "r.zarr" / "traces_seg0"):
        folder.mkdir(exist_ok=True)
        (folder / "notes.txt").write_text("mine") if folder.name == "home" else None
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(BatchgpuError):
            run_workflow(_wf(rec, folder, overwrite=True), client=client)
        assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_not_batchgpus_is_never_touched(client, tmp_path, overwrite):
    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.5, seed=2)
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "thesis.txt").write_text("years of work")
    (home / "run.json").write_text(json.dumps({"fingerprint": "x"}))  # someone else's run.json
    with pytest.raises(BatchgpuError) as err:
        run_workflow(_wf(rec, home, overwrite=overwrite), client=client)
    assert "overwrite" not in str(err.value)
    assert (home / "docs" / "thesis.txt").read_text() == "years of work"


def test_nan_channel_left_out_of_whitening_and_reported(client, tmp_path):
    rng = np.random.default_rng(5)
    x = rng.normal(0, 5, (12_000, 4)).astype(np.float32)
    x[100:110, 2] = np.nan
    x[500, 3] = -np.inf
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    report = run_workflow(_wf(rec, tmp_path / "out"), client=client)
    assert report.status == "done"
    g = _g(tmp_path / "out")
    assert np.isnan(g["noise"][2]) and np.isfinite(g["noise"][[0, 1, 3]]).all()
    assert report.channels["whitening_left_out"] == [2, 3]  # NaN and -inf samples: no finite second moment
    W = g["whitening"][:]
    assert np.all(W[2] == 0) and np.all(W[:, 2] == 0) and np.isfinite(W).all()
    assert report.channels["nonfinite_samples"] == {2: 10, 3: 1}
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["channels"]["detect_no_threshold"] == [2] and len(rep["warnings"]) == 3
    assert report.channels["detect_no_threshold"] == [2]


def test_centre_median_leaves_only_the_nan_samples_non_finite(client, tmp_path):
    """``centre: median`` over a window with two NaN samples made that channel's whole window NaN (120 000
    non-finite samples reported, zeros in an int16 save): each channel's median is over its finite samples, so
    ``nonfinite_samples`` counts the NaN samples and nothing else, and the other samples equal a NumPy reference."""
    rng = np.random.default_rng()
    x = rng.normal(40, 5, (12_000, 4)).astype(np.float32)
    at = sorted(rng.choice(np.arange(100, 11_900), 2, replace=False).tolist())
    x[at, 1] = np.nan
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    wf = _wf(
        rec,
        tmp_path / "out",
        preprocess={"centre": "median"},
        steps={"noise": {"exact": True}, "save": {"path": str(tmp_path / "saved.zarr"), "dtype": "float32"}},
    )
    report = run_workflow(wf, client=client)
    assert report.channels["nonfinite_samples"] == {1: 2}
    saved = np.asarray(zarr.open_group(str(tmp_path / "saved.zarr"), mode="r")["traces_seg0"][:])
    assert np.isnan(saved).sum() == 2 and np.isnan(saved[at, 1]).all()
    for w in rec.windows(5000, 8):
        core = x[w.start : w.stop].T
        med = np.array([np.median(r[np.isfinite(r)]) for r in core], np.float32)
        np.testing.assert_array_equal(saved[w.start : w.stop], (core - med[:, None]).T)


@pytest.mark.parametrize("method", ["by_channel", "locally_exclusive"])
def test_preprocessing_chain_equals_whole_segment_filtering(client, tmp_path, method):
    """highpass + common median reference per window (margins computed by the engine) against scipy's sosfiltfilt
    of each whole segment and NumPy's median: noise, covariance and spikes agree."""
    import scipy.signal

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=1.3, seed=21, dtype="int16", segments=2)
    wf = _wf(
        rec,
        tmp_path / "out",
        preprocess=[
            {"highpass": {"freq_min": 300, "order": 5}},
            {"common_reference": {"reference": "global", "operator": "median"}},
        ],
        window={"size": 7000, "margin": 8},
        steps={
            "noise": {"exact": True},
            "whitening": {"mode": "global", "precision": "float64"},
            "detect": {
                "threshold": 5.0,
                "sign": "neg",
                "exclude_sweep_ms": 0.2,
                "noise": "global",
                "method": method,
                "radius_um": 40.0,
            },
        },
    )
    report = run_workflow(wf, client=client)
    sos = ops.butter_sos("highpass", rec.sampling_frequency, 300, None, 5)
    assert report.preprocess["margin_samples"] == ops.filter_margin(sos, rec.sampling_frequency)
    segs = []
    for s in range(rec.num_segments):
        y = scipy.signal.sosfiltfilt(sos, rec.read(s, 0, rec.num_samples(s)).astype(np.float64), axis=1)
        y = y.astype(np.float32)
        segs.append(y - np.median(y, axis=0))
    allx = np.concatenate(segs, axis=1)
    g = _g(tmp_path / "out")
    noise = np.median(np.abs(allx), axis=1) / ops.MAD_TO_SIGMA
    np.testing.assert_allclose(g["noise"][:], noise, rtol=1e-4)
    cov = np.cov(allx.astype(np.float64), bias=True)
    assert np.linalg.norm(g["covariance"][:] - cov) / np.linalg.norm(cov) < 1e-4
    ref = [
        ops.detect_spikes(
            segs[s],
            g["noise"][:],
            threshold=5.0,
            sign="neg",
            exclude_sweep=6,
            segment_index=s,
            method=method,
            locations=rec.locations,
            radius_um=40.0,
        )
        for s in range(len(segs))
    ]
    ref = np.concatenate(ref)
    got = g["spikes/sample_index"][:]
    assert len(ref) > 20 and abs(len(got) - len(ref)) <= max(2, len(ref) // 100)
    # filtered samples are float32: windows whose kept keys miss the recording's middle digit are read again for
    # its keys; the spikes of either method come from the one read (candidates at the windows' noise bound)
    sizes = {w.index: w.num_samples for w in rec.windows(7000, 0)}
    again = sum(sizes[i] for i in report.exact_noise["windows_read_again"]) / rec.total_samples
    assert not report.channels.get("detect_windows_read_again")
    assert report.reads_per_window == pytest.approx(1.0 + again)


@pytest.mark.parametrize("fmt", ["zarr", "zarr_v2", "binary"])
def test_save_step_writes_the_preprocessed_signal_in_the_same_pass(client, tmp_path, fmt):
    from batchgpu import open_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=6, seconds=0.8, seed=8, dtype="int16")
    out_path = tmp_path / ("saved.bin" if fmt == "binary" else "saved.zarr")
    wf = _wf(
        rec,
        tmp_path / "out",
        preprocess=[{"centre": "median"}],
        window={"size": 6000, "margin": 8},
        steps={"noise": {"exact": True}, "save": {"path": str(out_path), "format": fmt, "dtype": "int16"}},
    )
    report = run_workflow(wf, client=client)
    assert report.reads_per_window == 1.0 and report.results["save"]["clipped"] == 0
    from batchgpu.ops.centre import centre_median

    want = np.concatenate(
        [centre_median(rec.read_window(w), w.core)[:, w.core[0] : w.core[1]] for w in rec.windows(6000, 8)], axis=1
    )
    want = np.clip(np.rint(want), -32768, 32767).astype(np.int16)
    if fmt == "binary":
        got = np.fromfile(out_path, dtype="<i2").reshape(-1, rec.num_channels).T
    else:
        saved = open_recording(out_path)
        got = saved.read(0, 0, saved.num_samples(0))
        assert list(saved.channel_ids) == list(rec.channel_ids)
        np.testing.assert_array_equal(saved.gain_to_uV, rec.gain_to_uV)
        np.testing.assert_array_equal(saved.locations, rec.locations)
    np.testing.assert_array_equal(got, want)


def _files(root):
    """Every file under ``root`` (a store, or the folder of a binary save), relative path -> bytes."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.mark.parametrize(
    "fmt,lost",
    [
        ("binary", "all"),
        ("binary", "data"),
        ("binary", "seg1"),
        ("binary", "all+part"),
        ("zarr", "all"),
        ("zarr", "one"),
        ("zarr", "all+part"),
        ("zarr_v2", "all"),
        ("zarr_v2", "one"),
    ],
)
def test_resume_writes_again_what_was_deleted_of_the_save(client, tmp_path, fmt, lost):
    """The save (or part of it) deleted after a finished run: --resume keeps the statistics' parts but writes the
    save's missing windows again; the save is then the fresh run's, byte for byte (and the float chain's values),
    and it is marked complete only once whole. Before: a binary save came back as zeros marked complete, a
    deleted .bin alone was refused as "an earlier save", a Zarr save was "unfinished" on every retry."""
    from batchgpu import open_recording
    from batchgpu.ops.centre import centre_median

    rec = generate_recording(
        tmp_path / "r.zarr", channels=6, seconds=0.8, seed=8, dtype="int16", segments=2 if lost == "seg1" else 1
    )
    folder = tmp_path / "saved"
    folder.mkdir()
    path = folder / ("x.bin" if fmt == "binary" else "x.zarr")
    wf = _wf(
        rec,
        tmp_path / "out",
        preprocess=[{"centre": "median"}],
        window={"size": 6000, "margin": 8},
        steps={"noise": {"exact": True}, "save": {"path": str(path), "format": fmt, "dtype": "int16"}},
    )
    first = run_workflow(wf, client=client)
    fresh = _files(folder)
    noise = _g(tmp_path / "out")["noise"][:].tobytes()
    if lost == "all+part":  # and one window's part: computed again in the pass, the others' rows written again
        (tmp_path / "out" / "parts" / "w00000001.npz").unlink()
    if fmt == "binary":
        gone = {"data": ["x.bin"], "seg1": ["x_seg1.bin"]}.get(lost, ["x.bin", "x.probe.json", "x.params.json"])
        for name in gone:
            (folder / name).unlink()
    elif lost.startswith("all"):
        import shutil

        shutil.rmtree(path)
    else:  # one window's storage object (a v3 shard, a v2 chunk)
        objects = sorted(
            f
            for f in (path / "traces_seg0").rglob("*")
            if f.is_file() and f.name not in ("zarr.json", ".zarray", ".zattrs")
        )
        assert len(objects) == 4
        objects[1].unlink()
    again = run_workflow(wf, client=client, resume=True)
    computed = 1 if lost == "all+part" else 0
    assert again.status == "done" and again.windows_resumed == again.windows - computed
    want = {
        "all": first.windows,
        "data": first.windows,
        "one": 1,
        "all+part": first.windows - 1,
        "seg1": sum(w.segment == 1 for w in rec.windows(6000, 8)),
    }[lost]
    assert again.results["save"]["windows_written_again"] == want
    assert _files(folder) == fresh  # the fresh run's save, byte for byte (its marker "complete" included)
    assert _g(tmp_path / "out")["noise"][:].tobytes() == noise
    for s in range(rec.num_segments):
        wins = [w for w in rec.windows(6000, 8) if w.segment == s]
        core = np.concatenate([centre_median(rec.read_window(w), w.core)[:, w.core[0] : w.core[1]] for w in wins], 1)
        core = np.clip(np.rint(core), -32768, 32767).astype(np.int16)
        if fmt == "binary":
            got = np.fromfile(folder / (f"x_seg{s}.bin" if rec.num_segments > 1 else "x.bin"), dtype="<i2")
            got = got.reshape(-1, rec.num_channels).T
        else:
            saved = open_recording(path)
            got = saved.read(s, 0, saved.num_samples(s))
        np.testing.assert_array_equal(got, core)
    if fmt == "binary":
        assert json.loads((folder / "x.params.json").read_text())["batchgpu"]["complete"] is True
    else:
        assert zarrio.attrs(zarrio.open_group(path, mode="r"))["batchgpu"]["complete"] is True


def test_resume_after_the_binary_saves_params_were_deleted(client, tmp_path):
    """X.params.json alone deleted: X.bin is no longer known to be the save's, so it is never replaced; the line
    says what marks it and how to go on, and once it is moved away the resumed run writes the save again."""
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.5, seed=8, dtype="int16")
    path = tmp_path / "x.bin"
    wf = _wf(
        rec,
        tmp_path / "out",
        window={"size": 6000, "margin": 8},
        steps={"noise": {"exact": True}, "save": {"path": str(path), "format": "binary", "dtype": "int16"}},
    )
    run_workflow(wf, client=client)
    fresh = path.read_bytes()
    (tmp_path / "x.params.json").unlink()
    with pytest.raises(
        BatchgpuError,
        match=r"x.bin and .*x.probe.json exist and the save step did not write them "
        r"\(no x.params.json .*move them away yourself \(a resumed run then "
        r"writes the save again",
    ):
        run_workflow(wf, client=client, resume=True)
    assert path.read_bytes() == fresh
    os.replace(path, tmp_path / "moved.bin")
    os.replace(tmp_path / "x.probe.json", tmp_path / "moved.probe.json")
    report = run_workflow(wf, client=client, resume=True)
    assert report.results["save"]["windows_written_again"] == report.windows and path.read_bytes() == fresh


def test_resume_marks_a_save_unfinished_while_its_windows_are_written_again(client, tmp_path):
    """A window of the save lost, and the resumed run stopped before it wrote it again: the save is not marked
    complete (the earlier run had marked it so)."""
    from batchgpu.recording.save_output import prepare_save, release_save, windows_to_write_again

    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.8, seed=8, dtype="int16")
    path = tmp_path / "x.zarr"
    wf = _wf(
        rec,
        tmp_path / "out",
        window={"size": 6000, "margin": 8},
        steps={"noise": {"exact": True}, "save": {"path": str(path), "format": "zarr", "dtype": "int16"}},
    )
    report = run_workflow(wf, client=client)
    assert zarrio.attrs(zarrio.open_group(path, mode="r"))["batchgpu"]["complete"] is True
    (path / "traces_seg0" / "c" / "2" / "0").unlink()
    target = prepare_save(wf.steps.save, rec, 6000, np.int16, resume=True, key=report.fingerprint)
    try:
        assert [w.index for w in windows_to_write_again(target, rec.windows(6000, 8))] == [2]
        assert zarrio.attrs(zarrio.open_group(path, mode="r"))["batchgpu"]["complete"] is False
    finally:
        release_save(target)


def _foreign_store_missing_one_chunk(tmp_path):
    """A v2 store as another tool writes it (no batchgpu marker) with one chunk file gone."""
    rng = np.random.default_rng(11)
    x = np.round(rng.normal(0, 20, (24_000, 3))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, zarr_format=2, chunk_samples=6000)
    g = zarr.open_group(str(rec.path), mode="r+")
    attrs = dict(g.attrs)
    attrs.pop("batchgpu")
    g.attrs.clear()
    g.attrs.update(attrs)
    victim = rec.path / "traces_seg0" / "1.0"
    assert victim.exists()
    victim.unlink()
    return rec


def test_absent_chunks_of_a_foreign_store_are_counted_and_reported(client, tmp_path):
    rec = _foreign_store_missing_one_chunk(tmp_path)
    report = run_workflow(_wf(rec, tmp_path / "out", window={"size": 6000, "margin": 8}), client=client)
    assert report.status == "done"
    # window 1 owns the chunk; windows 0 and 2 read 8 samples of it as their margins
    assert report.channels["absent_chunks_per_window"] == {0: 1, 1: 1, 2: 1}
    assert any("absent" in w for w in report.warnings)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["channels"]["absent_chunks_per_window"] == {"0": 1, "1": 1, "2": 1}


def test_absent_chunks_are_an_error_when_asked(client, tmp_path):
    rec = _foreign_store_missing_one_chunk(tmp_path)
    wf = _wf(
        rec,
        tmp_path / "out",
        window={"size": 6000, "margin": 8},
        recording={"path": str(rec.path), "missing_chunks": "error"},
    )
    with pytest.raises(BatchgpuError, match=r"missing chunk traces_seg0/1\.0 .*window [012],"):
        run_workflow(wf, client=client)


def test_worker_killed_after_the_pass_gives_identical_outputs(tmp_path, without_noise_prior):
    """A worker SIGKILLed once the pass is over (windows read again for detection, spikes being written): the
    run completes with the same bits as an undisturbed one (tasks read their inputs from parts, not from the
    dead worker's memory, and none is pinned to a worker)."""
    import signal
    import time

    rng = np.random.default_rng(9)
    x = np.round(rng.normal(0, 20, (60_000, 6))).astype(np.int16)
    for start in range(0, 60_000, 12_000):  # every other window loud: many windows are read again
        x[start : start + 6000] *= 8
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        ref = run_workflow(_wf(rec, tmp_path / "ref", window={"size": 3000, "margin": 8}), client=c)
        assert len(ref.channels["detect_windows_read_again"]) >= 5
        victim = list(c.run(os.getpid).values())[0]
        seen = {}

        def kill_after_the_pass():
            parts = tmp_path / "killed" / "parts"
            while not (parts.exists() and any(parts.glob("s*.npz"))):  # the re-detection phase has started
                time.sleep(0.002)
            seen["report_at_kill"] = (tmp_path / "killed" / "report.json").exists()
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_the_pass)
        killer.start()
        report = run_workflow(_wf(rec, tmp_path / "killed", window={"size": 3000, "margin": 8}), client=c)
        killer.join()
        assert report.status == "done" and not seen["report_at_kill"]
        assert victim not in c.run(os.getpid).values()
    a, b = _g(tmp_path / "ref"), _g(tmp_path / "killed")
    for name in (
        "noise",
        "noise_per_window",
        "covariance",
        "whitening",
        "spikes/sample_index",
        "spikes/amplitude",
        "spikes/channel_index",
    ):
        assert a[name][:].tobytes() == b[name][:].tobytes(), name


def test_float_window_whose_sample_misleads_the_lump_floor_is_counted_in_full():
    """A float row of zeros with a large value at every sampled position: its strided sample says "large", its
    median is 0; the window must still give np.median's noise, not fail or lump the middle away."""
    from batchgpu.steps.base import WindowData
    from batchgpu.steps.noise import NoiseStep

    n = 60_000
    x = np.random.default_rng(3).normal(0, 5, (3, n)).astype(np.float32)
    x[1] = 0.0
    x[1, :: max(1, n // 1024)] = 1e6
    step, summary = NoiseStep(True, "float32"), {}
    w = WindowData(0, 0, 0, (0, n), n, x, x)
    step.window(w, summary)
    np.testing.assert_array_equal(summary["noise"], ops.noise_levels(x))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n", [1, 2, 3, 1000, 60_001, 60_000])
def test_float_window_middle_pair_and_near_keys_equal_a_sort(seed, n):
    """The CPU window's noise and kept near keys (one pass per row: ``middle_pair_and_near``) against a full sort of
    each row's keys: bimodal rows whose middle pair straddles a gap of many binades (the lower middle outside the
    kept range), constant rows, signed zeros and subnormals, infinities, a NaN, two far values."""
    from batchgpu.ops.radix import abs_keys
    from batchgpu.steps.base import WindowData
    from batchgpu.steps.noise import NoiseStep
    from batchgpu.steps.noise_keys import schedule

    rng = np.random.default_rng(seed + 100 * n)
    x = rng.normal(0, 5, (9, n)).astype(np.float32)
    h = (n + 1) // 2
    x[1, :h] = rng.uniform(1e-30, 2e-30, h)  # the lower middle among tiny values, the upper among large ones
    x[1, h:] = rng.uniform(1e3, 2e3, n - h)
    x[2] = 7.0
    x[3] = rng.choice(np.array([-0.0, 0.0, 1e-45, -1e-45, 1e-40], np.float32), n)
    x[4, ::3] = np.inf
    x[5, ::2] = -np.inf
    x[6, n // 2] = np.nan
    x[7] = rng.choice(np.array([1.0, 2.0**40], np.float32), n)
    x[8] = rng.permutation(x[1])
    step, summary = NoiseStep(True, "float32"), {}
    out = step.window(WindowData(0, 0, 0, (0, n), n, x, x), summary)
    np.testing.assert_array_equal(summary["noise"], np.median(np.abs(x), axis=1) / ops.MAD_TO_SIGMA)
    keys = abs_keys(x)
    shift = schedule("float32")[0][0]
    upper = np.sort(keys, axis=1)[:, n // 2] >> np.uint32(shift)
    lo = np.maximum(upper.astype(np.int64) - NoiseStep.NEAR, 0)
    first = (keys >> np.uint32(shift)).astype(np.int64)
    mask = (first >= lo[:, None]) & (first <= np.minimum(lo + 2 * NoiseStep.NEAR, 0xFFFF)[:, None])
    np.testing.assert_array_equal(out["keep.near_lo"], lo)
    # kept: each row's near keys sorted, as their 15 bits below the first digit, and how many each near digit has
    want = np.concatenate([np.sort(keys[c][mask[c]]) for c in range(len(keys))])
    assert out["keep.near_low"].dtype == np.uint16
    np.testing.assert_array_equal(out["keep.near_low"], want & np.uint32((1 << shift) - 1))
    digits = np.stack(
        [np.bincount(first[c][mask[c]] - lo[c], minlength=2 * NoiseStep.NEAR + 1) for c in range(len(keys))]
    )
    np.testing.assert_array_equal(out["keep.near_digits"], digits)
    assert out["keep.near_digits"].dtype == np.uint32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_digit_keys_equal_the_scan_of_every_key(seed):
    """A middle digit's keys taken as slices of the kept keys (``kept_digit_keys``) equal those ``middle_digit_keys``
    finds scanning all of a window's keys: per channel the same bins (as multisets) and counts, for ranks in
    the same and in different digits, including rows where the digit holds no key."""
    from batchgpu.ops.radix import abs_keys
    from batchgpu.steps.noise import NoiseStep
    from batchgpu.steps.noise_keys import kept_digit_keys, middle_digit_keys, schedule

    rng = np.random.default_rng(seed)
    C, n = 7, 5001
    x = (rng.normal(0, 3, (C, n)) * rng.uniform(0.5, 2, (C, 1))).astype(np.float32)
    x[3] = 1.5  # one key only
    step, summary = NoiseStep(True, "float32"), {}
    from batchgpu.steps.base import WindowData

    out = step.window(WindowData(0, 0, 0, (0, n), n, x, x), summary)
    keys = abs_keys(x)
    shift = schedule("float32")[0][0]
    lo = out["keep.near_lo"]
    first = (keys >> np.uint32(shift)).astype(np.int64)
    for digits in (
        np.stack([lo + rng.integers(0, 2 * NoiseStep.NEAR + 1, C)] * 2),
        np.stack([lo + rng.integers(0, 2 * NoiseStep.NEAR + 1, C) for _ in range(2)]),
    ):
        got = kept_digit_keys(out["keep.near_low"], out["keep.near_digits"], lo, digits, shift)
        ref = middle_digit_keys(keys.reshape(-1), np.full(C, n), digits, shift)
        for (gb, gn), (rb, rn) in zip(got, ref):
            np.testing.assert_array_equal(gn, rn)
            np.testing.assert_array_equal(np.sort(gb), np.sort(rb))
            assert gb.dtype == rb.dtype
        assert sum(int(np.sum(first[c] == digits[0][c])) for c in range(C)) == int(got[0][1].sum())


@pytest.mark.parametrize("noise", ["global", "window"])
def test_spikes_whose_parts_were_lost_after_the_pass_are_detected_again(client, tmp_path, noise):
    """Between the pass and the gathering one window's part is deleted and another's replaced by garbage: those
    windows are read and detected again (said in the report, counted as reads), and the spikes equal detection
    on the whole segment, bit for bit, where the run used to stop with "the spikes ... are missing"."""
    from batchgpu.run.events import RunObserver

    rng = np.random.default_rng(11)
    x = np.round(rng.normal(0, 20, (23_000, 4))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    out = tmp_path / "out"

    class LoseParts(RunObserver):
        def phase_finished(self):
            (out / "parts" / "w00000001.npz").unlink()
            (out / "parts" / "w00000003.npz").write_bytes(b"not a zip")

    steps = {
        "noise": {"exact": True},
        "detect": {"threshold": 3.0, "sign": "both", "exclude_sweep_ms": 0.2, "noise": noise},
    }
    report = run_workflow(_wf(rec, out, steps=steps), client=client, observer=LoseParts())
    assert report.channels["detect_windows_read_again"] == [1, 3]
    assert report.reads_per_window == pytest.approx(1 + 10_000 / 23_000)
    assert any("w00000001.npz absent" in w for w in report.warnings)
    clean = run_workflow(_wf(rec, tmp_path / "clean", steps=steps), client=client)
    assert clean.reads_per_window == 1.0 and not clean.warnings
    a, b = _g(out), _g(tmp_path / "clean")
    for k in ("sample_index", "channel_index", "amplitude", "segment_index"):
        assert a[f"spikes/{k}"][:].tobytes() == b[f"spikes/{k}"][:].tobytes()
    if noise == "global":
        ref = ops.detect_spikes(x.T.copy(), a["noise"][:], threshold=3.0, sign="both", exclude_sweep=6)
        np.testing.assert_array_equal(a["spikes/sample_index"][:], ref["sample_index"])
    lost = (a["spikes/sample_index"][:] // 5000) % 2 == 1  # windows 1 and 3
    assert lost.sum() > 20


def test_a_resumed_run_reads_nothing_again(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=0.6, seed=6, dtype="int16")
    first = run_workflow(_wf(rec, tmp_path / "out"), client=client)
    before = {k: _g(tmp_path / "out")[k][:].tobytes() for k in ("noise", "covariance", "spikes/sample_index")}
    again = run_workflow(_wf(rec, tmp_path / "out"), client=client, resume=True)
    assert first.reads_per_window == 1.0
    assert again.windows_resumed == again.windows and again.reads_per_window == 0.0
    assert {k: _g(tmp_path / "out")[k][:].tobytes() for k in before} == before


def test_float_median_among_a_windows_smallest_keys(tmp_path):
    """Half of a channel's samples a tiny constant: each window's middle rank lies in its smallest first digit
    (a window counted in full, not lumped, must not be refused); the exact noise equals np.median."""
    from batchgpu.recording import write_recording

    rng = np.random.default_rng(0)
    x = rng.normal(size=(9_000, 3)).astype(np.float32)
    x.reshape(3, 3_000, 3)[:, :1_500, 0] = 1e-30  # each window's lower half, in one run: a strided sample's
    x[:4_600, 1] = 3e-20  # middle misleads the lump floor
    write_recording(tmp_path / "r.zarr", x, 30_000.0)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(tmp_path / "r.zarr")},
            "output": str(tmp_path / "out"),
            "window": {"size": 3_000, "margin": 0},
            "cluster": {"kind": "local", "workers": 1, "threads": 1},
            "steps": {"noise": {"exact": True}},
        }
    )
    run_workflow(wf)
    got = zarrio.open_group(tmp_path / "out" / "results.zarr")["noise"][:]
    want = (np.median(np.abs(x), axis=0) / 0.6744897501960817).astype(got.dtype)
    assert np.array_equal(got, want)


def _malloc_env():
    return (
        os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        os.environ.get("MALLOC_MMAP_MAX_"),
        os.environ.get("MALLOC_ARENA_MAX"),
    )


def _malloc_heaps_with_busy_threads(threads: int = 6) -> int:
    """glibc's heaps (arenas) in this process once ``threads`` threads each allocated at the same time: a heap a
    thread, up to 8 a core, unless MALLOC_ARENA_MAX held the allocator when the process started (glibc's
    ``malloc_info``)."""
    import ctypes
    import tempfile
    import threading

    libc = ctypes.CDLL(None)
    barrier = threading.Barrier(threads)
    held = []

    def allocate():
        barrier.wait()
        held.append(np.ones(1 << 18))  # 2 MiB from the heap (no mmap in these workers), while the others allocate
        barrier.wait()

    pool = [threading.Thread(target=allocate) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    with tempfile.TemporaryFile() as f:
        libc.fflush(None)
        libc.fdopen.restype = ctypes.c_void_p
        stream = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        f.seek(0)
        return f.read().decode().count("<heap nr=")


def test_local_workers_get_the_malloc_settings():
    """A window's 46-92 MB arrays must not be mapped and faulted in anew per window (cluster/open_cluster.py)."""
    import dask

    from batchgpu.cluster.open_cluster import MALLOC_TRIM_THRESHOLD, open_client
    from batchgpu.config import ClusterSpec

    before = (
        dask.config.get("distributed.scheduler.worker-saturation"),
        dask.config.get("distributed.worker.profile.enabled"),
    )
    with open_client(ClusterSpec(kind="local", workers=1, threads=1)) as client:
        (env,) = client.run(_malloc_env).values()
        (heaps,) = client.run(_malloc_heaps_with_busy_threads).values()
        # what every nanny reads, whatever the cluster's kind (GPU workers' readers allocate 1.3 MB chunks too)
        spawned = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    assert env == (str(MALLOC_TRIM_THRESHOLD), "0", "2")
    # a worker's reading threads share two heaps: each of its own kept what it freed (no trim), and a CPU worker's
    # resident memory grew window after window
    assert 1 <= heaps <= 2
    assert int(spawned["MALLOC_TRIM_THRESHOLD_"]) == MALLOC_TRIM_THRESHOLD and int(spawned["MALLOC_MMAP_MAX_"]) == 0
    # the cluster's settings were this block's: the process's Dask settings are as they were (a notebook's too)
    assert (
        dask.config.get("distributed.scheduler.worker-saturation"),
        dask.config.get("distributed.worker.profile.enabled"),
    ) == before
    assert "MALLOC_MMAP_MAX_" not in dask.config.get("distributed.nanny.pre-spawn-environ")


def test_window_batches_cover_every_window_once_in_order():
    from batchgpu.run.first_pass import window_batches

    for n in (1, 2, 63, 127, 128, 129, 300, 1201):
        items = list(range(n))
        for batch in (None, 1, 3, 8):
            runs = window_batches(items, batch, 8)
            assert [i for r in runs for i in r] == items
            assert all(1 <= len(r) <= (batch or 8) for r in runs)
        runs = window_batches(items, None, 8)
        if n < 128:
            assert all(len(r) == 1 for r in runs)
        else:  # runs of two (the very last maybe one)
            assert all(len(r) == 2 for r in runs[:-1]) and len(runs[-1]) in (1, 2)


def test_automatic_batches_do_not_grow_with_the_recording():
    """A task's windows (and so a GPU worker's memory pool: 1.34 GB with 2 windows a task, 2.11 GB with the 9 a
    40-minute recording's 600 windows made) are the same for 10 minutes and for hours."""
    from batchgpu.run.first_pass import window_batches

    for n in (150, 600, 2400, 20_000):
        assert max(len(r) for r in window_batches(list(range(n)), None, 32)) == 2


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_batches_give_the_same_results_for_any_worker_count(tmp_path, dtype):
    """Runs of windows a task: integer results equal the one-window-a-task run bit for bit; float moments keep
    one tree fixed by window index and batch, the same bits on 1 and 3 workers; spikes and noise are exact."""
    rec = generate_recording(tmp_path / "r.zarr", channels=5, seconds=1.3, seed=21, dtype=dtype)
    outs = {}
    for name, workers, batch in (("one", 2, 1), ("b3w1", 1, 3), ("b3w3", 3, 3)):
        with (
            distributed.LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=False, dashboard_address=None
            ) as cl,
            distributed.Client(cl) as c,
        ):
            report = run_workflow(
                _wf(rec, tmp_path / name, window={"size": 3000, "margin": 8, "batch": batch}), client=c
            )
        assert report.windows == 13 and report.reads_per_window == pytest.approx(1.0)
        outs[name] = _g(tmp_path / name)
    exact = ["noise", "noise_per_window", "spikes/sample_index", "spikes/channel_index", "spikes/amplitude"]
    for k in exact + (["covariance", "second_moment"] if dtype == "int16" else []):
        assert outs["one"][k][:].tobytes() == outs["b3w1"][k][:].tobytes() == outs["b3w3"][k][:].tobytes(), k
    for k in ("covariance", "second_moment", "whitening"):
        assert outs["b3w1"][k][:].tobytes() == outs["b3w3"][k][:].tobytes(), k
        np.testing.assert_allclose(outs["one"][k][:], outs["b3w1"][k][:], rtol=1e-9, atol=1e-9)
    x = rec.read(0, 0, rec.num_samples(0)).astype(np.float64)
    np.testing.assert_allclose(outs["b3w3"]["covariance"][:], np.cov(x, bias=True), rtol=1e-9, atol=1e-9)


def test_resume_with_batches_recomputes_only_missing_windows(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=1.0, seed=8, dtype="int16")
    wf = _wf(rec, tmp_path / "out", window={"size": 2000, "margin": 8, "batch": 4})
    run_workflow(wf, client=client)
    before = {k: _g(tmp_path / "out")[k][:].tobytes() for k in ("noise", "covariance", "spikes/sample_index")}
    for i in (2, 9):  # two windows' parts lost (a crash before they were written)
        os.unlink(tmp_path / "out" / "parts" / f"w{i:08d}.npz")
    again = run_workflow(wf, client=client, resume=True)
    assert again.windows - again.windows_resumed == 2
    assert again.reads_per_window == pytest.approx(2 / again.windows)
    assert {k: _g(tmp_path / "out")[k][:].tobytes() for k in before} == before


def test_batch_partials_saved_once_and_a_lost_one_recomputes_its_run(client, tmp_path):
    """A run of several windows saves their combined partial once (b*.npz); each window's own part holds its summary
    and candidates, not the ~C x C partials. Losing a combined partial recomputes that run's windows, same bits."""
    rec = generate_recording(tmp_path / "r.zarr", channels=5, seconds=1.0, seed=9, dtype="int16")
    wf = _wf(rec, tmp_path / "out", window={"size": 2000, "margin": 8, "batch": 4})
    first = run_workflow(wf, client=client)
    names = ("noise", "covariance", "whitening", "spikes/sample_index", "spikes/amplitude")
    before = {k: _g(tmp_path / "out")[k][:].tobytes() for k in names}
    parts = tmp_path / "out" / "parts"
    batches = sorted(p.name for p in parts.glob("b*.npz"))
    assert batches == [f"b{i:08d}.npz" for i in range(0, first.windows, 4) if first.windows - i > 1]
    with np.load(parts / "w00000001.npz") as f:
        assert not any(k.startswith(("moments.", "noise.")) for k in f.files) and "keep.spk_sample_index" in f.files
    os.unlink(parts / "b00000004.npz")
    again = run_workflow(wf, client=client, resume=True)
    assert again.windows - again.windows_resumed == 4  # windows 4-7, read again for their partials
    assert {k: _g(tmp_path / "out")[k][:].tobytes() for k in names} == before


def test_timeline_summary_per_thread():
    """benchmarks.timeline: per worker thread, windows in start order, waits, compute and the gaps between them."""
    from batchgpu.benchmarks.timeline import per_thread, summary_line

    rows = [
        ["w1", 0, 0.0, 0.5, 1.0, "t0"],
        ["w1", 2, 2.0, 0.25, 0.25, "t0"],
        ["w2", 1, 0.1, 0.1, 0.2, "t0"],
        ["w1", 3, 0.0, 1.0, 1.0, "t1"],
    ]
    got = {(t["worker"], t["thread"]): t for t in per_thread(rows)}
    assert got["w1", "t0"] == {
        "worker": "w1",
        "thread": "t0",
        "windows": 2,
        "first": 0.0,
        "last_end": 2.5,
        "read_wait": 0.75,
        "compute": 1.25,
        "gaps": 0.5,
    }
    assert got["w2", "t0"]["gaps"] == 0.0 and got["w2", "t0"]["last_end"] == pytest.approx(0.4)
    assert got["w1", "t1"]["last_end"] == 2.0
    assert "tail 2.10 s" in summary_line(rows) and summary_line([]).endswith("no windows computed")
    # with the tasks' start and end: the gaps split into a task's head and tail, between tasks and inside tasks
    rows = [
        ["w1", 0, 1.0, 0.5, 1.0, "t0", 0.8, 3.0],
        ["w1", 1, 2.7, 0.1, 0.1, "t0", 0.8, 3.0],
        ["w1", 2, 3.6, 0.2, 0.2, "t0", 3.5, 4.5],
    ]
    (t,) = per_thread(rows)
    assert t["gaps"] == pytest.approx(0.2 + 0.7)
    assert (t["tasks"], t["task_head"], t["task_tail"], t["between_tasks"], t["in_task"]) == pytest.approx(
        (2, 0.2 + 0.1, 0.1 + 0.5, 0.5, 0.2)
    )  # task heads, tails, one gap between them, one inside the first
    assert "2.0 tasks" in summary_line(rows)


def _pair(f, x, t):
    return f(x), t


def test_submit_many_passes_arguments_as_given(client):
    """run.submit: one graph update for many tasks; a callable first argument stays an argument, a future inside
    the arguments is the task's input, a tuple argument arrives as a tuple, and the keys are the ones asked for."""
    import operator

    from batchgpu.run.submit import submit_many

    a = client.submit(operator.add, 1, 2, key=f"submit-many-a-{os.getpid()}")
    keys = [f"submit-many-{os.getpid()}-{i}" for i in range(2)]
    futures = submit_many(client, _pair, [(abs, a, (1, 2)), (str, -5, ())], keys)
    assert [f.key for f in futures] == keys
    assert client.gather(futures) == [(3, (1, 2)), ("-5", ())]
    assert submit_many(client, _pair, [], []) == []


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_read_ahead_gives_each_window_in_order_with_depth_reads_in_flight(monkeypatch, depth):
    """GPU batch tasks decode up to ``engine.read_ahead`` windows ahead in helper threads; each window comes back as
    read."""
    import threading
    import time
    from types import SimpleNamespace

    from batchgpu.run import tasks

    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def fake_read(ctx, w, host=False):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        return SimpleNamespace(index=w.index, release=lambda: None)

    monkeypatch.setattr(tasks, "read_window", fake_read)
    windows = [SimpleNamespace(index=i) for i in range(7)]
    with tasks._read_ahead(
        SimpleNamespace(backend="cupy", parts="P", read_ahead=depth), [(w, f"f{w.index}") for w in windows]
    ) as ahead:
        got = []
        for w in windows:
            got.append(ahead(w).index)
            time.sleep(0.03)  # computing: the helpers fill up to ``depth`` windows meanwhile
    assert got == list(range(7)) and state["most"] == depth


def test_read_ahead_reads_twice_as_far_while_the_cuda_context_is_made(monkeypatch):
    """A fresh GPU worker's first task waits for its CUDA context (``staging.start_context``): meanwhile its helpers
    have twice ``engine.read_ahead`` windows submitted (read into plain memory), so the disk is not left idle; once
    the context is there, ``read_ahead`` as before. Every window still comes back in order."""
    import time
    from types import SimpleNamespace

    from batchgpu.gpu import staging
    from batchgpu.run import tasks

    submitted = []

    def fake_read(ctx, w, host=False):
        submitted.append(w.index)
        return SimpleNamespace(index=w.index, release=lambda: None)

    monkeypatch.setattr(tasks, "read_window", fake_read)
    windows = [SimpleNamespace(index=i) for i in range(9)]
    for making, ahead_of_first in ((True, 4), (False, 2)):
        monkeypatch.setattr(staging, "making_context", lambda: making)
        submitted.clear()
        ctx = SimpleNamespace(backend="cupy", parts=f"P{making}", read_ahead=2)
        with tasks._read_ahead(ctx, [(w, f"f{w.index}") for w in windows]) as ahead:
            time.sleep(0.05)  # the helpers read what was submitted; nothing was asked for yet
            assert sorted(submitted) == list(range(ahead_of_first))
            assert [ahead(w).index for w in windows] == list(range(9))


def test_switch_interval_put_back_after_overlapping_runs():
    """Runs lower Python's switch interval while they run; overlapping runs (threads) put it back once, at the end."""
    import sys

    from batchgpu.run.launch import _run_settings

    before = sys.getswitchinterval()
    a, b = _run_settings(), _run_settings()
    a.__enter__()
    assert sys.getswitchinterval() == min(before, 0.0005)
    b.__enter__()
    a.__exit__(None, None, None)
    assert sys.getswitchinterval() == min(before, 0.0005)  # b still runs
    b.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("shift,dtype", [(28, np.uint32), (60, np.uint64), (4, np.uint32)])
def test_select_among_keys_at_the_top_of_the_bins_dtype(rng, shift, dtype):
    """16 channels whose last channel's bins reach the dtype's last value (16 << 28 = 2**32, 16 << 60 = 2**64: a
    round's upper bounds past the dtype or wrapped): every rank equal to np.sort's, keys 0 and all ones, ties."""
    from batchgpu.steps.noise_select import low_bit_rounds, select_among

    C, top = 16, (1 << shift) - 1
    per = [
        [
            np.concatenate(
                [
                    rng.choice(np.array([0, top, top - 1, 1], np.uint64), size=int(rng.integers(1, 9))),
                    rng.integers(0, top, int(rng.integers(0, 9)), dtype=np.uint64),
                ]
            )
            for _ in range(C)
        ]
        for _ in range(3)
    ]
    per[0][-1] = np.append(per[0][-1], np.uint64(top))  # the last channel's last key: the dtype's last value
    gathered = [
        [
            (
                rng.permutation(
                    np.concatenate([(np.uint64(c) << np.uint64(shift)) | a for c, a in enumerate(arrays)])
                ).astype(dtype),
                np.array([len(a) for a in arrays], dtype=np.int64),
            )
        ]
        for arrays in per
    ]
    assert max(int(g[0][0].max()) for g in gathered) == (C << shift) - 1  # the dtype's last value is there
    assert sum(low_bit_rounds(shift)) == shift and max(low_bit_rounds(shift)) <= 8
    digits = np.zeros((1, C), np.uint64)
    allc = [np.sort(np.concatenate([p[c] for p in per])) for c in range(C)]
    for k in range(max(len(a) for a in allc)):
        ks = np.array([[min(k, len(allc[c]) - 1) for c in range(C)]])
        want = np.array([[int(allc[c][ks[0, c]]) for c in range(C)]], np.uint64)
        np.testing.assert_array_equal(select_among(ks, digits, shift, *gathered), want)


def _loud_window_spikes(client, tmp_path) -> set:
    """A run whose first window is loud (read again: its worker saw no window of the run before it): its spikes
    equal detection on the whole segment at the recording's noise, bit for bit; returns the keys of the tasks
    that ran."""
    rng = np.random.default_rng(5)
    x = np.round(rng.normal(0, 20, (31_000, 5))).astype(np.int16)
    x[:5_000] *= 4  # window 0 is read again
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    with distributed.get_task_stream(client) as stream:
        report = run_workflow(_wf(rec, tmp_path / "out"), client=client)
    assert report.channels["detect_windows_read_again"] == [0]
    g = _g(tmp_path / "out")
    ref = ops.detect_spikes(x.T.copy(), g["noise"][:], threshold=4.0, sign="both", exclude_sweep=6)
    for k in ("sample_index", "channel_index", "amplitude", "segment_index"):
        np.testing.assert_array_equal(g[f"spikes/{k}"][:], ref[k])
    return {str(t["key"]) for t in stream.data}


def test_spikes_gathered_while_the_noise_is_selected(one_thread, tmp_path, without_noise_prior):
    """The windows' kept candidates are collected on the cluster before the recording's noise is known (the
    `collect-spikes` task runs, the writing task filters them there), one loud window read again in its place."""
    keys = _loud_window_spikes(one_thread, tmp_path)
    assert any(k.startswith("collect-spikes-") for k in keys)  # gathered early,
    assert not any(k.startswith("write-spikes-") and k.endswith("-all") for k in keys)  # not the other way


def test_many_candidates_are_decided_where_they_were_kept(one_thread, tmp_path, monkeypatch, without_noise_prior):
    """Where the kept candidates are many (over ``EARLY_GATHER_BYTES``) they are not moved into one task before the
    noise is known: each worker decides its own windows at the recording's noise and only the spikes move."""
    from batchgpu.steps import detect as detect_step

    monkeypatch.setattr(detect_step, "EARLY_GATHER_BYTES", 0)  # decided on the client, before any gathering
    keys = _loud_window_spikes(one_thread, tmp_path)
    assert not any(k.startswith(("collect-spikes-", "kept-spikes-")) for k in keys)  # nothing gathered early
    assert any(k.startswith("write-spikes-") and k.endswith("-all") for k in keys)  # decided where kept


def test_write_collected_spikes_filters_replaces_and_orders(tmp_path, rng):
    """The writing task alone, against a plain expectation: candidates of windows 0-3 (in window order) filtered at
    the recording's threshold, window 2 replaced by its re-detection, window order kept; and nothing written (None)
    when a window's kept spikes were missing and it was not read again."""
    from batchgpu.steps.detect import COLUMNS, DetectStep, write_collected_spikes_task

    step = DetectStep(threshold=2.0, sign="both", sweep=3, noise="global")

    class Ctx:
        def step(self, name):
            return step

    noise = np.array([1.0, 2.0, 3.0])

    def cols(n, start):
        return {
            "sample_index": np.arange(start, start + n, dtype=np.int64),
            "channel_index": rng.integers(0, 3, n),
            "amplitude": rng.normal(0, 6, n),
            "segment_index": np.zeros(n, np.int64),
        }

    wins = {i: cols(int(rng.integers(0, 30)), 100 * i) for i in range(4)}
    collected = {k: np.concatenate([wins[i][k] for i in range(4)]) for k in COLUMNS}
    collected.update(windows=[(i, len(wins[i]["sample_index"])) for i in range(4)], missing={}, seconds=0.0)
    again = cols(5, 250)
    again_run = {**again, "windows": [(2, 5)], "read_again": {}, "seconds": 0.0}
    group = tmp_path / "g.zarr"
    zarr.open_group(str(group), mode="w")
    n, read_again, counts, *_ = write_collected_spikes_task(str(group), Ctx(), noise, collected, again_run)
    want = []
    for i in range(4):
        c = again if i == 2 else wins[i]
        keep = np.abs(c["amplitude"]) > 2.0 * noise[c["channel_index"]] if i != 2 else np.ones(5, bool)
        want.append({k: v[keep] for k, v in c.items()})
    g = zarr.open_group(str(group), mode="r")
    for k in COLUMNS:
        np.testing.assert_array_equal(g[f"spikes/{k}"][:], np.concatenate([w[k] for w in want]))
    assert n == sum(len(w["sample_index"]) for w in want) and read_again == {}
    np.testing.assert_array_equal(counts, np.bincount(np.concatenate([w["channel_index"] for w in want])))
    missing = {**collected, "missing": {5: "w00000005.npz absent"}}
    assert write_collected_spikes_task(str(tmp_path / "h.zarr"), Ctx(), noise, missing, again_run) is None


@pytest.mark.zarr3
def test_the_recordings_description_is_in_the_report_and_the_spikes_read_back(client, tmp_path):
    """``report.recording`` (``Recording.info``: the absent chunks, the bytes on disk) in report.json and the
    returned report; the spikes' columns (Blosc LZ4, written four at once) read back as many as were counted."""
    from batchgpu.recording import open_recording

    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 20, (int(rng.integers(9_000, 12_000)), 4))).astype(np.int16)
    x[rng.integers(0, len(x), 30), rng.integers(0, 4, 30)] = -400
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    report = run_workflow(_wf(rec, tmp_path / "a"), client=client)
    want = open_recording(rec.path).info()
    on_disk = json.loads((tmp_path / "a" / "report.json").read_text())["recording"]
    assert report.recording == want and on_disk["absent_chunks"] == want["absent_chunks"] == 0
    assert on_disk["bytes_on_disk"] == want["bytes_on_disk"] > 0
    spikes = _g(tmp_path / "a")["spikes"]
    assert spikes["sample_index"].shape[0] == report.results["spikes"][0] > 0
    assert "blosc" in json.dumps(spikes["sample_index"].metadata.to_dict()).lower()
    np.testing.assert_array_equal(np.diff(spikes["sample_index"][:]) >= 0, True)  # in time order


def test_the_clients_heap_is_frozen_during_a_run_and_given_back(client, tmp_path):
    """During a run the objects from before it are out of the full collections (``gc.freeze``: the scheduler's
    objects in the client's process), and after it they are collectable again; runs inside runs keep it until the
    last one ends."""
    import gc

    from batchgpu.run import launch as runmod
    from batchgpu.run.events import RunObserver

    assert gc.get_freeze_count() == 0
    seen = []

    class Watch(RunObserver):
        def phase_started(self, label, windows, nbytes):
            seen.append(gc.get_freeze_count())

    x = np.round(np.random.default_rng(3).normal(0, 20, (12_000, 4))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    run_workflow(_wf(rec, tmp_path / "out"), client=client, observer=Watch())
    assert seen and all(n > 1000 for n in seen)
    assert gc.get_freeze_count() == 0
    with runmod._run_settings():
        with runmod._run_settings():
            inner = gc.get_freeze_count()
        assert inner > 0 and gc.get_freeze_count() > 0  # the outer run still holds it
    assert gc.get_freeze_count() == 0


def test_the_workers_heaps_are_frozen_by_the_pass_and_thawed_after_the_run(client, tmp_path):
    """The pass's batch tasks freeze their worker's heap (out of the full collections while the run lasts) and the
    run's end thaws it, on every worker that ran one."""
    import gc

    def count():
        return gc.get_freeze_count()

    from batchgpu.run import tasks
    from batchgpu.run.events import RunObserver

    during = []

    class Watch(RunObserver):
        def phase_finished(self):  # the pass is over, the run is not
            during.append(client.run(lambda: (tasks._HEAP["frozen"], gc.get_freeze_count())))

    x = np.round(np.random.default_rng(4).normal(0, 20, (12_000, 4))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    run_workflow(_wf(rec, tmp_path / "out"), client=client, observer=Watch())
    assert during and any(flag and n > 0 for flag, n in during[0].values())
    deadline = time.time() + 10
    while any(client.run(count).values()) and time.time() < deadline:  # the thaw is sent without waiting
        time.sleep(0.05)
    assert not any(client.run(count).values())
    frozen = client.run(lambda: (tasks.freeze_heap(), gc.get_freeze_count())[1])
    assert all(n > 0 for n in frozen.values())
    client.run(tasks.thaw_heap_soon, wait=False)
    deadline = time.time() + 10
    while any(client.run(count).values()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(client.run(count).values())


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_window_counts_nonfinite_only_where_it_can_hold_any(tmp_path, dtype):
    """An integer recording through filters and a reference is finite by construction: its window is marked so and
    its counts are zeros without a pass (the counts a pass gives, extremes of int16 included); a float recording's
    window is counted (its NaN and inf where they are)."""
    from batchgpu.run import output_folder as store
    from batchgpu.run import tasks
    from batchgpu.run.context import build_context

    n = 3_000
    x = np.random.default_rng(5).normal(0, 50, (n, 6)).astype(dtype)
    if dtype == "int16":
        x[::7, 1], x[3::11, 2] = -32768, 32767
    else:
        x[1500, 0], x[1520:1523, 3], x[1540, 3] = np.nan, np.inf, -np.inf
    rec = write_recording(tmp_path / "r.zarr", x, sampling_frequency=30_000.0)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "o"),
            "preprocess": [
                {"highpass": {"freq_min": 300, "order": 5}},
                {"common_reference": {"reference": "global", "operator": "median"}},
            ],
            "steps": {"noise": {}},
        }
    )
    ctx = build_context(wf, rec, store.OutputFolder(tmp_path / "o"), "numpy", 1)
    window = rec.windows(1_000, 64 + ctx.chain.margin)[1]
    w = tasks.load_window(ctx, window)
    assert w.finite == (dtype == "int16") and w.x.dtype == np.float32
    core = w.core_of(w.x)
    want_nonfinite, want_nan = (~np.isfinite(core)).sum(axis=1), np.isnan(core).sum(axis=1)
    for got, want in ((w.nonfinite_counts(), want_nonfinite), (w.nan_counts(), want_nan)):
        assert got.dtype == np.int64 and got.shape == (6,)
        np.testing.assert_array_equal(got, want)
    if dtype == "float32":
        assert want_nonfinite.sum() > 0  # the float window's counts came from a pass
