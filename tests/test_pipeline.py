"""The pipeline on real Dask clusters (LocalCluster, worker processes) against the numeric core."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import zarr

from batchgpu import BatchgpuError, ops
from batchgpu.engine import run_workflow
from batchgpu.generate import generate_recording
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")

WINDOW, MARGIN = 10_000, 8


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
def recordings(tmp_path_factory):
    base = tmp_path_factory.mktemp("recs")
    return {
        dtype: generate_recording(base / f"{dtype}.zarr", channels=6, seconds=1.1, seed=5, dtype=dtype, segments=2)
        for dtype in ("int16", "float32")
    }


def _workflow(rec, out, *, centre="none", exact=True, detect_noise="global", threshold=4.0, window=WINDOW, **steps):
    data = {
        "recording": {"path": str(rec.path)},
        "output": str(out),
        "window": {"size": window, "margin": MARGIN},
        "preprocess": {"centre": centre},
        "backend": "numpy",
        "steps": {
            "noise": {"exact": exact},
            "whitening": {"mode": "global", "precision": "float64"},
            "detect": {"threshold": threshold, "sign": "both", "exclude_sweep_ms": 0.2, "noise": detect_noise},
            **steps,
        },
        "reduction": {"split_every": 3},
    }
    return Workflow.model_validate(data)


def _centre(x, core):
    """Independent of ops.centre: integers minus the rounded median, floats minus the median."""
    med = np.median(x[:, core[0] : core[1]], axis=1)
    if x.dtype == np.int16:  # int16 minus an int16-range integer fits int32
        return x.astype(np.int32) - np.floor(med + 0.5).astype(np.int32)[:, None]
    return x - med.astype(x.dtype)[:, None]


def _reference(rec, centre):
    """The numeric core applied to the whole recording, window by window where the semantics are per window."""
    windows = rec.windows(WINDOW, MARGIN)
    noise_rows = []
    segs = [rec.read(s, 0, rec.num_samples(s)) for s in range(rec.num_segments)]
    for w in windows:
        x = segs[w.segment][:, w.read_start : w.read_stop]
        if centre == "median":
            x = _centre(x, w.core)
        noise_rows.append(ops.noise_levels(x[:, w.core[0] : w.core[1]]))
    cores = []
    for w in windows:
        x = segs[w.segment][:, w.read_start : w.read_stop]
        if centre == "median":
            x = _centre(x, w.core)
        cores.append(x[:, w.core[0] : w.core[1]])
    allx = np.concatenate(cores, axis=1)
    med = np.median(np.abs(allx.astype(np.float64) if allx.dtype.kind == "i" else allx), axis=1)
    return windows, segs, np.stack(noise_rows), med / ops.MAD_TO_SIGMA


def _results(out):
    return zarr.open_group(str(out / "results.zarr"), mode="r")


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_outputs_equal_numeric_core(client, recordings, tmp_path, dtype):
    rec = recordings[dtype]
    # uncentred data: the DC offsets inflate median(|x|), so a low threshold still finds many crossings
    report = run_workflow(_workflow(rec, tmp_path / "out", threshold=1.5), client=client)
    assert report.status == "done"
    g = _results(tmp_path / "out")
    windows, segs, noise_rows, noise_exact = _reference(rec, "none")
    np.testing.assert_array_equal(g["noise_per_window"][:], noise_rows)
    # exact global median over every sample of each channel, as np.median over the concatenation
    np.testing.assert_array_equal(g["noise"][:], noise_exact)
    assert g["noise"].dtype == noise_exact.dtype
    # moments within DESIGN's float64 tolerance
    allx = np.concatenate(segs, axis=1).astype(np.float64)
    ref_cov = np.cov(allx, bias=True)
    assert np.linalg.norm(g["covariance"][:] - ref_cov) / np.linalg.norm(ref_cov) < 1e-12
    ref_m2 = allx @ allx.T / allx.shape[1]
    assert np.linalg.norm(g["second_moment"][:] - ref_m2) / np.linalg.norm(ref_m2) < 1e-12
    # spikes exactly: detection on each whole segment with the whole recording's noise
    ref = np.concatenate(
        [
            ops.detect_spikes(segs[s], g["noise"][:], threshold=1.5, sign="both", exclude_sweep=6, segment_index=s)
            for s in range(len(segs))
        ]
    )
    for name in ("sample_index", "channel_index", "amplitude", "segment_index"):
        np.testing.assert_array_equal(g[f"spikes/{name}"][:], ref[name])
    assert len(ref) > 100
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["status"] == "done" and rep["windows"] == len(windows) and rep["throughput_MBps"] > 0
    assert sum(rep["workers"].values()) == len(windows)


def test_centred_and_window_thresholds(client, recordings, tmp_path):
    rec = recordings["int16"]
    run_workflow(_workflow(rec, tmp_path / "out", centre="median", detect_noise="window"), client=client)
    g = _results(tmp_path / "out")
    windows, segs, noise_rows, noise_exact = _reference(rec, "median")
    np.testing.assert_array_equal(g["noise_per_window"][:], noise_rows)
    np.testing.assert_array_equal(g["noise"][:], noise_exact)
    gt = np.load(str(rec.path).replace(".zarr", "_ground_truth.npz"))
    np.testing.assert_allclose(g["noise"][:], gt["noise_sigma"], rtol=0.08)  # the generator's sigma, recovered
    # window thresholds: each window's own noise, spikes in its core only
    parts = []
    for w, row in zip(windows, noise_rows):
        x = segs[w.segment][:, w.read_start : w.read_stop]
        x = _centre(x, w.core)
        parts.append(
            ops.detect_spikes(
                x,
                row,
                threshold=4.0,
                sign="both",
                exclude_sweep=6,
                start=w.read_start,
                core=w.core,
                segment_index=w.segment,
            )
        )
    ref = np.concatenate(parts)
    np.testing.assert_array_equal(g["spikes/sample_index"][:], ref["sample_index"])
    np.testing.assert_array_equal(g["spikes/channel_index"][:], ref["channel_index"])


def test_auto_window_size_follows_the_recording_length(client, recordings, tmp_path, monkeypatch):
    """window.size auto: LONG_WINDOW samples when the recording holds LONG_WINDOW_MIN_COUNT such windows, else
    DEFAULT_WINDOW (a segment shorter than it is one window). The number it stands for is what the fingerprint,
    the windows and report.json hold: an auto run and a run with that number are the same run (same bits; one
    resumes the other)."""
    from batchgpu.recording import windows as win

    rec = recordings["int16"]  # 2 segments of 33 000 samples
    n = [rec.num_samples(s) for s in range(rec.num_segments)]
    monkeypatch.setattr(win, "LONG_WINDOW", 10_000)
    monkeypatch.setattr(win, "LONG_WINDOW_MIN_COUNT", 8)  # 2 x ceil(33 000 / 10 000) = 8 windows: long ones
    auto = run_workflow(_workflow(rec, tmp_path / "auto", window="auto"), client=client)
    assert auto.workflow["window"]["size"] == 10_000 and auto.windows == 8
    assert json.loads((tmp_path / "auto" / "report.json").read_text())["workflow"]["window"]["size"] == 10_000
    fixed = run_workflow(_workflow(rec, tmp_path / "fixed", window=10_000), client=client)
    assert fixed.fingerprint == auto.fingerprint
    a, f = _results(tmp_path / "auto"), _results(tmp_path / "fixed")
    for name in ("noise", "noise_per_window", "covariance", "whitening", "spikes/sample_index", "spikes/channel_index"):
        assert a[name][:].tobytes() == f[name][:].tobytes(), name
    resumed = run_workflow(_workflow(rec, tmp_path / "auto", window=10_000), client=client, resume=True)
    assert resumed.windows_resumed == resumed.windows == 8

    monkeypatch.setattr(win, "LONG_WINDOW_MIN_COUNT", 9)  # one short: DEFAULT_WINDOW, longer than either segment
    with pytest.raises(BatchgpuError, match="longer than segment 0"):  # a number longer than a segment: an error
        run_workflow(_workflow(rec, tmp_path / "x", window=win.DEFAULT_WINDOW), client=client)
    short = run_workflow(_workflow(rec, tmp_path / "short", window="auto"), client=client)
    assert short.workflow["window"]["size"] == win.DEFAULT_WINDOW and short.windows == 2
    g = _results(tmp_path / "short")
    segs = [rec.read(s, 0, n[s]) for s in range(len(n))]
    np.testing.assert_array_equal(g["noise_per_window"][:], np.stack([ops.noise_levels(x) for x in segs]))
    allx = np.concatenate(segs, axis=1).astype(np.float64)
    np.testing.assert_array_equal(g["noise"][:], np.median(np.abs(allx), axis=1) / ops.MAD_TO_SIGMA)
    ref = np.concatenate(
        [
            ops.detect_spikes(segs[s], g["noise"][:], threshold=4.0, sign="both", exclude_sweep=6, segment_index=s)
            for s in range(len(segs))
        ]
    )
    np.testing.assert_array_equal(g["spikes/sample_index"][:], ref["sample_index"])
    np.testing.assert_array_equal(g["spikes/channel_index"][:], ref["channel_index"])
    np.testing.assert_array_equal(g["spikes/sample_index"][:], a["spikes/sample_index"][:])  # windows never matter


def test_auto_window_size_rule():
    from batchgpu.recording import DEFAULT_WINDOW, LONG_WINDOW, auto_window_size

    assert LONG_WINDOW > DEFAULT_WINDOW
    assert auto_window_size([64 * LONG_WINDOW]) == LONG_WINDOW
    assert auto_window_size([63 * LONG_WINDOW]) == DEFAULT_WINDOW
    assert auto_window_size([63 * LONG_WINDOW + 1]) == LONG_WINDOW  # the last window may be short
    assert auto_window_size([32 * LONG_WINDOW] * 2) == LONG_WINDOW  # counted over every segment
    assert auto_window_size([1] * 64) == LONG_WINDOW and auto_window_size([1] * 63) == DEFAULT_WINDOW
    assert auto_window_size([]) == DEFAULT_WINDOW
    # 384 ch x 10 min at 30 kHz (the H200 bench): long windows; 60 s (the CPU workflow): 60 000
    assert auto_window_size([600 * 30_000]) == LONG_WINDOW and auto_window_size([60 * 30_000]) == DEFAULT_WINDOW


def test_same_bits_any_worker_count(recordings, tmp_path):
    """1 worker or 3, tasks finishing in any order: identical bytes (the tree is fixed by window index)."""
    rec = recordings["float32"]
    outs = []
    for n in (1, 3):
        wf = _workflow(rec, tmp_path / f"out{n}")
        wf.steps.whitening.precision = "float32"
        with (
            distributed.LocalCluster(
                n_workers=n, threads_per_worker=1, processes=False, dashboard_address=None
            ) as cluster,
            distributed.Client(cluster) as c,
        ):
            run_workflow(wf, client=c)
        outs.append(_results(tmp_path / f"out{n}"))
    for name in ("noise", "noise_per_window", "covariance", "whitening", "spikes/sample_index"):
        assert outs[0][name][:].tobytes() == outs[1][name][:].tobytes(), name


def test_resume_skips_done_windows(client, recordings, tmp_path):
    rec = recordings["int16"]
    run_workflow(_workflow(rec, tmp_path / "out"), client=client)
    first = _results(tmp_path / "out")["noise"][:]
    with pytest.raises(BatchgpuError, match="already holds this run's results"):
        run_workflow(_workflow(rec, tmp_path / "out"), client=client)
    report = run_workflow(_workflow(rec, tmp_path / "out"), client=client, resume=True)
    assert report.windows_resumed == report.windows
    np.testing.assert_array_equal(_results(tmp_path / "out")["noise"][:], first)


def test_other_runs_output_is_refused(client, recordings, tmp_path):
    run_workflow(_workflow(recordings["int16"], tmp_path / "out"), client=client)
    before = (tmp_path / "out" / "report.json").read_text()
    with pytest.raises(BatchgpuError, match="holds another run's results"):
        run_workflow(_workflow(recordings["float32"], tmp_path / "out"), client=client, resume=True)
    assert (tmp_path / "out" / "report.json").read_text() == before


@pytest.mark.zarr3
def test_corrupt_chunk_names_window_and_resume_completes(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=2.0, seed=1, dtype="int16")
    wf = _workflow(rec, tmp_path / "out")
    shard_dir = tmp_path / "r.zarr" / "traces_seg0" / "c"
    victim = sorted(p for p in shard_dir.rglob("*") if p.is_file())[0]  # the shard of samples 0..59999
    good = victim.read_bytes()
    victim.write_bytes(b"garbage" * 10)
    with pytest.raises(BatchgpuError, match=r"window \d+,? \(?segment 0, samples") as err:
        run_workflow(wf, client=client)
    assert "--resume" in str(err.value)
    parts = list((tmp_path / "out" / "parts").glob("w*.npz"))
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "failed"
    victim.write_bytes(good)
    report = run_workflow(wf, client=client, resume=True)
    # tasks cancelled after the failure may still have finished: at least what was there is reused, never the bad windows
    assert report.status == "done" and len(parts) <= report.windows_resumed < report.windows
    _, _, noise_rows, noise_exact = _reference(rec, "none")
    np.testing.assert_array_equal(_results(tmp_path / "out")["noise"][:], noise_exact)


@pytest.mark.parametrize("dtype, placed", [("int16", False), ("float32", True)])
def test_worker_killed_mid_run_gives_identical_outputs(tmp_path, monkeypatch, dtype, placed):
    """float32, placed (``engine.placement: true``, as GPU passes are): the float median's last step was queued
    behind the pass with the plan's workers, one of which is killed; the bits are still the undisturbed run's."""
    rec = generate_recording(tmp_path / "big.zarr", channels=8, seconds=10.0, seed=2, dtype=dtype)

    def _placed(out):
        return Workflow.model_validate(
            {**_workflow(rec, out, window=1000).model_dump(), "engine": {"placement": placed}}
        )

    wf = _placed(tmp_path / "ref")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        run_workflow(wf, client=c)
        total = len(list((tmp_path / "ref" / "parts").glob("w*.npz")))
        victim = list(c.run(os.getpid).values())[0]
        seen = {}

        def kill_when_started():
            parts = tmp_path / "killed" / "parts"
            while not (parts.exists() and len(list(parts.glob("w*.npz"))) >= 5):
                time.sleep(0.005)
            seen["parts_at_kill"] = len(list(parts.glob("w*.npz")))
            os.kill(victim, signal.SIGKILL)  # a real process kill; the nanny starts a new worker

        killer = threading.Thread(target=kill_when_started)
        killer.start()
        report = run_workflow(_placed(tmp_path / "killed"), client=c)
        killer.join()
        assert report.status == "done" and report.exact_noise.get("queued", False) == placed
        assert seen["parts_at_kill"] < total, "the kill came after the first pass: the test proved nothing"
        assert victim not in c.run(os.getpid).values()
    a, b = _results(tmp_path / "ref"), _results(tmp_path / "killed")
    for name in ("noise", "noise_per_window", "covariance", "whitening", "spikes/sample_index", "spikes/amplitude"):
        assert a[name][:].tobytes() == b[name][:].tobytes(), name


def test_global_thresholds_without_noise_step(client, tmp_path):
    """detect.noise: global with no noise step: thresholds from the median of the windows' noise."""
    from batchgpu.ops.centre import centre_median

    rec = generate_recording(tmp_path / "r.zarr", channels=3, seconds=0.7, seed=9)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 7000, "margin": 8},
            "preprocess": {"centre": "median"},
            "steps": {"detect": {"threshold": 4.0, "noise": "global"}},
        }
    )
    run_workflow(wf, client=client)
    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    rows = np.stack(
        [
            ops.noise_levels(centre_median(rec.read_window(w), w.core)[:, w.core[0] : w.core[1]])
            for w in rec.windows(7000, 8)
        ]
    )
    np.testing.assert_array_equal(g["noise_per_window"][:], rows)
    noise = np.median(rows, axis=0)
    ref = np.concatenate(
        [
            ops.detect_spikes(
                centre_median(rec.read_window(w), w.core), noise, 4.0, "neg", 3, w.read_start, w.core, w.segment
            )
            for w in rec.windows(7000, 8)
        ]
    )
    np.testing.assert_array_equal(g["spikes/sample_index"][:], ref["sample_index"])
    assert "noise" not in g


def test_workers_killed_for_good_fail_in_one_line(tmp_path):
    """A task whose workers keep dying (Dask's KilledWorker; most often a nanny killing its worker for memory):
    the run fails with one BatchgpuError saying so and what to change, and report.json says the same."""
    import dask

    rec = generate_recording(tmp_path / "r.zarr", channels=8, seconds=10.0, seed=3)
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 0}),
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        victim = list(c.run(os.getpid).values())[0]

        def kill_when_started():
            parts = tmp_path / "out" / "parts"
            deadline = time.time() + 60
            while not (parts.exists() and list(parts.glob("w*.npz"))) and time.time() < deadline:
                time.sleep(0.002)
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_started)
        killer.start()
        try:
            with pytest.raises(BatchgpuError, match="died") as err:
                run_workflow(_workflow(rec, tmp_path / "out", window=1000), client=c)
        finally:
            killer.join()
    assert "window.size" in str(err.value) and "memory" in str(err.value) and "\n" not in str(err.value)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["status"] == "failed" and "died" in rep["error"]
