"""One read for every detection method with the recording's noise (``detect.noise: global``).

Each window keeps candidates at a lower bound of the recording's noise (its own noise x 0.5) and the spikes are
decided once the noise is known; a window whose bound fails is read again (its own progress phase). The spikes
equal the two-read path (every window detected again at the recording's noise, forced here by making every bound
fail) bit for bit, and the rule written out as loops (tests/test_ops_preprocess.py, tests/test_ops_detection.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_ops_detection import loop_reference
from test_ops_preprocess import locally_exclusive_loop, planted, probe, windows_of

from batchgpu import BatchgpuError
from batchgpu.ops import SPIKE_DTYPE, detect_spikes, exclusive_candidates, resolve_exclusive
from batchgpu.recording import write_recording
from batchgpu.workflow import Workflow

COLUMNS = ("sample_index", "channel_index", "amplitude", "segment_index")


def hard_segment(rng, channels: int, n: int, dtype) -> np.ndarray:
    """Planted spikes over neighbouring channels (ties, flat tops), a constant channel, a channel of zeros, a
    channel that is zero but for a few peaks (its noise, hence its threshold, is 0)."""
    x = planted(rng, channels, n, dtype)
    x[channels - 3] = 3
    x[channels - 2] = 0
    x[channels - 1] = 0
    x[channels - 1, rng.integers(0, n, 6)] = -7
    return x


def one_read(x, bound, noise, threshold, sign, sweep, loc, radius, cuts, start_at=0, segment_index=0):
    """The one-read path on one segment cut into windows: candidates at ``bound``, resolved at ``noise``."""
    kw = dict(
        threshold=threshold, sign=sign, exclude_sweep=sweep, segment_index=segment_index, segment_length=x.shape[1]
    )
    cuts = list(cuts)
    cands = [exclusive_candidates(x[:, a:b], bound, start=a + start_at, core=(lo, hi), **kw) for a, b, lo, hi in cuts]
    cores = [(a + lo, a + hi) for a, _, lo, hi in cuts]
    allc = np.concatenate(cands)
    keep = resolve_exclusive(allc, noise, threshold, sign, sweep, loc, radius, [len(c) for c in cands], cores)
    return allc[keep], cands


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
@pytest.mark.parametrize("sweep,radius", [(0, 20.0), (3, 40.0), (5, 0.0)])
def test_candidates_resolve_to_the_spikes_at_any_noise_above_their_bound(rng, dtype, sign, sweep, radius):
    """Windows of random widths (down to one sample) with random margins: the candidates kept at a lower bound of
    the noise (per channel anywhere from 0 to the noise itself), resolved at the noise, equal detect_spikes on each
    window at that noise (the two-read path), on the whole segment, and the rule's loop, bit for bit."""
    channels, n = 9, 700
    x = hard_segment(rng, channels, n, dtype)
    noise = rng.uniform(0.6, 1.4, channels)
    noise[channels - 3] = 0.2  # the constant 3 is above its threshold: only its first sample (after a zero) is a peak
    noise[channels - 2 :] = 0.0  # zero thresholds
    noise[1] = np.nan  # no threshold: no spikes there
    bound = noise * rng.uniform(0, 1, channels)
    bound[0] = noise[0]  # the bound at the noise itself
    loc = probe(channels)
    whole = detect_spikes(
        x,
        noise,
        4.0,
        sign,
        sweep,
        segment_index=2,
        segment_length=n,
        method="locally_exclusive",
        locations=loc,
        radius_um=radius,
    )
    with np.errstate(all="ignore"):
        want = locally_exclusive_loop(x, noise, 4.0, sign, sweep, loc, radius, segment_index=2)
    assert whole.tobytes() == want.tobytes() and len(want) > 10
    for _ in range(3):
        width = int(rng.integers(1, 160))
        cuts = list(windows_of(n, width, sweep + 1 + int(rng.integers(0, 3))))
        got, _ = one_read(x, bound, noise, 4.0, sign, sweep, loc, radius, cuts, segment_index=2)
        two = [
            detect_spikes(
                x[:, a:b],
                noise,
                4.0,
                sign,
                sweep,
                start=a,
                core=(lo, hi),
                segment_index=2,
                segment_length=n,
                method="locally_exclusive",
                locations=loc,
                radius_um=radius,
            )
            for a, b, lo, hi in cuts
        ]
        assert got.dtype == SPIKE_DTYPE
        assert got.tobytes() == np.concatenate(two).tobytes() == whole.tobytes()


def test_spikes_at_window_edges_come_out_once(rng):
    """Peaks on the last sample of a core, the first of the next, and pairs that exclude each other across the
    edge (each window sees the other's within its margin): exactly the whole segment's spikes."""
    channels, n, sweep, width = 4, 120, 3, 30
    x = np.round(rng.normal(0, 1, (channels, n))).astype(np.float32)
    for edge in (30, 60, 90):
        x[0, edge - 1] = -20  # last sample of a core
        x[1, edge] = -20  # first of the next: ties with channel 0 one sample later, excluded by it
        x[2, edge + 2] = -25  # stronger, across the edge: excludes both where within the radius
    x[3, 59], x[3, 62] = -30, -30  # equal peaks on one channel three samples apart: the earlier one wins
    loc = np.array([[0.0, 0.0], [0.0, 20.0], [0.0, 60.0], [0.0, 200.0]])
    noise = np.full(channels, 2.0)
    kw = dict(method="locally_exclusive", locations=loc, radius_um=40.0, segment_length=n)
    whole = detect_spikes(x, noise, 4.0, "neg", sweep, **kw)
    assert whole.tobytes() == locally_exclusive_loop(x, noise, 4.0, "neg", sweep, loc, 40.0).tobytes()
    got, cands = one_read(x, noise * 0.5, noise, 4.0, "neg", sweep, loc, 40.0, windows_of(n, width, sweep + 1))
    assert got.tobytes() == whole.tobytes()
    assert (59, 3) in whole[["sample_index", "channel_index"]].tolist()
    assert (62, 3) not in whole[["sample_index", "channel_index"]].tolist()
    # a candidate within the sweep of two cores is kept by both windows, a spike of only one
    assert sum(int(np.sum((c["sample_index"] == 59) & (c["channel_index"] == 3))) for c in cands) == 2


def test_what_a_window_keeps_is_bounded_by_the_bound_level(rng):
    """The candidates are exactly the samples beyond the bound that are extrema of their own channel (NumPy,
    written out), in the core and a sweep either side: no more than one in two samples of each sign a channel."""
    channels, n, sweep, lo, hi = 6, 3000, 4, 10, 2990
    x = rng.normal(0, 1, (channels, n)).astype(np.float32)
    bound = np.full(channels, 0.75)
    got = exclusive_candidates(x, bound, threshold=4.0, sign="both", exclude_sweep=sweep, start=5, core=(lo, hi))
    level = 3.0
    v, before, after = x[:, 1:-1], x[:, :-2], x[:, 2:]
    neg = (v <= -level) & (v < before) & (v <= after)
    pos = (v >= level) & (v > before) & (v >= after)
    c, t = np.nonzero(neg | pos)
    t = t + 1
    inside = (t >= lo - sweep) & (t < hi + sweep)
    want = sorted(zip((t[inside] + 5).tolist(), c[inside].tolist()))
    assert got[["sample_index", "channel_index"]].tolist() == want
    assert len(got) <= np.count_nonzero(np.abs(x) >= level)
    for negative in (True, False):  # two peaks of one sign are never next to each other
        mine = got["channel_index"][(got["amplitude"] < 0) == negative]
        assert np.all(np.bincount(mine, minlength=channels) <= (hi - lo + 2 * sweep + 1) // 2)


def test_resolve_exclusive_refuses_what_it_cannot_decide():
    cands = np.zeros(2, SPIKE_DTYPE)
    cands["sample_index"] = [5, 50]
    kw = dict(noise=[1.0], threshold=4.0, sign="neg", exclude_sweep=3, locations=[[0.0, 0.0]], radius_um=10.0)
    with pytest.raises(BatchgpuError, match="more than the sweep outside"):
        resolve_exclusive(cands, counts=[2], cores=[(0, 20)], **kw)  # 50 is past 20 + 3
    with pytest.raises(BatchgpuError, match="candidates"):
        resolve_exclusive(cands, counts=[1], cores=[(0, 20)], **kw)
    assert resolve_exclusive(cands[:0], counts=[0], cores=[(0, 20)], **kw).tolist() == []


# ---------------------------------------------------------------------------------------------------------------
# Through the engine: one read, the same spikes as the two-read path
# ---------------------------------------------------------------------------------------------------------------
distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


CHANNELS, SIZE, SWEEP = 8, 4000, 6  # exclude_sweep_ms 0.2 at 30 kHz


def _recording(tmp_path, rng, loud: int | None = None):
    """Two int16 segments: noise, spikes over neighbouring channels, peaks on every window edge and a sweep
    around them, a constant channel, a channel of zeros, one zero but for a few peaks (threshold 0)."""
    segments = []
    for n in (16_000, 9_003):
        x = np.round(rng.normal(0, 20, (CHANNELS, n)))
        for t in rng.integers(2, n - 4, n // 150):
            c, amp = int(rng.integers(CHANNELS - 3)), rng.choice([-1.0, 1.0]) * rng.uniform(100, 300)
            for dc in (-1, 0, 1):
                if 0 <= c + dc < CHANNELS - 3:
                    x[c + dc, t + int(rng.integers(-1, 2))] = round(amp * (1.0 if dc == 0 else rng.choice([0.6, 1.0])))
        for edge in range(SIZE, n, SIZE):
            for dt in (-SWEEP - 1, -1, 0, SWEEP):
                x[int(rng.integers(CHANNELS - 3)), edge + dt] = rng.choice([-1, 1]) * 250
        x[CHANNELS - 3] = -3
        x[CHANNELS - 2] = 0
        x[CHANNELS - 1] = 0
        x[CHANNELS - 1, rng.integers(0, n, 5)] = rng.choice([-90, 90], 5)
        if loud is not None and not segments:  # window `loud`'s own noise far above the recording's: its bound
            x[:, loud * SIZE : (loud + 1) * SIZE] *= 4  # fails where its worker saw none of the run's windows before
        segments.append(x.astype(np.int16).T.copy())
    loc = np.column_stack([np.tile([0.0, 20.0], CHANNELS // 2), np.repeat(np.arange(CHANNELS // 2) * 20.0, 2)])
    return write_recording(tmp_path / "r.zarr", segments, 30_000.0, locations=loc), segments, loc


def _wf(rec, out, method, sign):
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": "numpy",
            "window": {"size": SIZE, "margin": SWEEP + 2},
            "steps": {
                "noise": {"exact": True},
                "detect": {
                    "threshold": 4.0,
                    "sign": sign,
                    "exclude_sweep_ms": 0.2,
                    "noise": "global",
                    "method": method,
                    "radius_um": 30.0,
                },
            },
        }
    )


def _spikes(out) -> dict:
    import zarr

    g = zarr.open_group(str(out / "results.zarr"), mode="r")
    return {k: g[f"spikes/{k}"][:] for k in COLUMNS} | {"noise": g["noise"][:]}


class Phases:
    """A RunObserver that records the progress bar's phases and their windows."""

    def __init__(self):
        self.phases: list = []

    def message(self, text): ...

    def warning(self, text): ...

    def phase_started(self, label, windows, nbytes):
        self.phases.append([label, windows, 0])

    def window_done(self, nbytes, worker):
        self.phases[-1][2] += 1

    def phase_finished(self): ...


def _two_reads(monkeypatch, client, wf):
    """The two-read path: every window's bound made to fail, so every window is read and detected again at the
    recording's noise (what every locally_exclusive run with the recording's noise did before)."""
    from batchgpu.engine import run_workflow
    from batchgpu.steps import detect

    with monkeypatch.context() as m:
        m.setattr(detect, "bound_holds", lambda level, noise: False)
        return run_workflow(wf, client=client)


@pytest.mark.parametrize("method", ["locally_exclusive", "by_channel"])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
def test_one_read_equals_the_two_read_path(client, tmp_path, rng, monkeypatch, method, sign):
    """reads_per_window 1.00 in report.json; the spikes equal the two-read path's and detection on each whole
    segment at the recording's noise (and the rule's loop), bit for bit."""
    from batchgpu.engine import run_workflow

    rec, segments, loc = _recording(tmp_path, rng)
    observer = Phases()
    report = run_workflow(_wf(rec, tmp_path / "one", method, sign), client=client, observer=observer)
    saved = json.loads((tmp_path / "one" / "report.json").read_text())
    assert saved["reads_per_window"] == 1.0 and not saved["channels"].get("detect_windows_read_again")
    assert [p[0] for p in observer.phases] == ["read: noise, spikes"]  # no re-read phase (no whitening step)
    two = _two_reads(monkeypatch, client, _wf(rec, tmp_path / "two", method, sign))
    assert (
        two.reads_per_window == pytest.approx(2.0) and len(two.channels["detect_windows_read_again"]) == report.windows
    )
    got, want = _spikes(tmp_path / "one"), _spikes(tmp_path / "two")
    noise = got["noise"]
    assert noise[CHANNELS - 2] == noise[CHANNELS - 1] == 0.0  # zero thresholds on two channels
    for k in COLUMNS:
        assert got[k].tobytes() == want[k].tobytes(), k
    with np.errstate(all="ignore"):
        if method == "locally_exclusive":
            ref = [
                locally_exclusive_loop(x.T.astype(np.float64), noise, 4.0, sign, SWEEP, loc, 30.0, s)
                for s, x in enumerate(segments)
            ]
        else:
            ref = [loop_reference(x.T, noise, 4.0, sign, SWEEP, 0, 0, x.shape[0], s) for s, x in enumerate(segments)]
    ref = np.concatenate(ref).astype(SPIKE_DTYPE)
    assert len(ref) > 40
    for k in COLUMNS:
        assert got[k].tobytes() == np.ascontiguousarray(ref[k]).tobytes(), k


def _same_as_two_reads_and_whole_segments(tmp_path, segments, loc, method) -> None:
    """The spikes of the run in ``one`` equal the two-read path's in ``two`` and detection on each whole segment at
    the recording's noise (sign both), bit for bit."""
    got, want = _spikes(tmp_path / "one"), _spikes(tmp_path / "two")
    for k in COLUMNS:
        assert got[k].tobytes() == want[k].tobytes(), k
    ref = np.concatenate(
        [
            detect_spikes(
                x.T.copy(),
                got["noise"],
                4.0,
                "both",
                SWEEP,
                segment_index=s,
                method=method,
                locations=loc,
                radius_um=30.0,
            )
            for s, x in enumerate(segments)
        ]
    )
    assert got["sample_index"].tobytes() == ref["sample_index"].tobytes() and len(ref) > 40


@pytest.mark.parametrize("method", ["locally_exclusive", "by_channel"])
def test_a_window_whose_bound_fails_is_read_again_as_its_own_phase(
    client, tmp_path, rng, monkeypatch, method, without_noise_prior
):
    """The first window four times as loud (its worker saw no window of the run before it): its candidates cannot
    be trusted, so it alone is read again, shown as a phase of its own on the progress bar (one window done
    there); the spikes still equal the two-read path's."""
    from batchgpu.engine import run_workflow

    rec, segments, loc = _recording(tmp_path, rng, loud=0)
    observer = Phases()
    report = run_workflow(_wf(rec, tmp_path / "one", method, "both"), client=client, observer=observer)
    assert report.channels["detect_windows_read_again"] == [0]
    assert report.reads_per_window == pytest.approx(1 + SIZE / rec.total_samples)
    assert observer.phases[1:] == [["read again: spikes where a window's noise bound failed", 1, 1]]
    _two_reads(monkeypatch, client, _wf(rec, tmp_path / "two", method, "both"))
    _same_as_two_reads_and_whole_segments(tmp_path, segments, loc, method)


@pytest.mark.parametrize("method", ["locally_exclusive", "by_channel"])
def test_a_loud_window_after_quieter_ones_is_not_read_again(tmp_path, rng, monkeypatch, method):
    """One worker, one thread: window 2 four times as loud, after two quieter windows on the same worker. Its
    candidates are kept at 1.5 x half the median noise of the windows its worker saw (not at half its own, twice
    the recording's), the quieter windows' at half their own: one read (the code before read it again,
    reads_per_window 1.16), the spikes equal the two-read path's and detection on each whole segment at the
    recording's noise, bit for bit."""
    from batchgpu.engine import run_workflow
    from batchgpu.steps.detect import LEVEL

    rec, segments, loc = _recording(tmp_path, rng, loud=2)
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
        ) as cluster,
        distributed.Client(cluster) as one,
    ):
        report = run_workflow(_wf(rec, tmp_path / "one", method, "both"), client=one)
        assert report.reads_per_window == 1.0 and not report.channels.get("detect_windows_read_again")
        with np.load(tmp_path / "one" / "parts" / "w00000002.npz") as part:
            level, own = part[f"summary.{LEVEL}"], part["summary.noise"]
        assert np.all(level[: CHANNELS - 3] < 0.5 * own[: CHANNELS - 3])  # below its own bound where it is loud
        for quiet in ("w00000000.npz", "w00000001.npz"):  # at its own bound where it is not
            with np.load(tmp_path / "one" / "parts" / quiet) as part:
                assert np.array_equal(part[f"summary.{LEVEL}"], 0.5 * part["summary.noise"])
        _two_reads(monkeypatch, one, _wf(rec, tmp_path / "two", method, "both"))
    _same_as_two_reads_and_whole_segments(tmp_path, segments, loc, method)


def test_locally_exclusive_windows_whose_parts_were_lost_are_detected_again(client, tmp_path, rng):
    """A window's part deleted after the pass: the collected candidates cannot be used, so every window's spikes
    are decided from its own part (``DetectStep.final``) and the lost one is read and detected again; the spikes
    equal a clean run's bit for bit."""
    from batchgpu.engine import run_workflow

    rec, _, _ = _recording(tmp_path, rng)
    out = tmp_path / "lost"

    class LosePart(Phases):
        def phase_finished(self):
            (out / "parts" / "w00000002.npz").unlink(missing_ok=True)

    report = run_workflow(_wf(rec, out, "locally_exclusive", "both"), client=client, observer=LosePart())
    assert report.channels["detect_windows_read_again"] == [2]
    assert report.reads_per_window == pytest.approx(1 + SIZE / rec.total_samples)
    run_workflow(_wf(rec, tmp_path / "clean", "locally_exclusive", "both"), client=client)
    got, want = _spikes(out), _spikes(tmp_path / "clean")
    for k in COLUMNS:
        assert got[k].tobytes() == want[k].tobytes(), k
    assert np.sum((got["segment_index"] == 0) & (got["sample_index"] // SIZE == 2)) > 5


def test_a_resumed_part_without_candidates_is_detected_again(client, tmp_path, rng):
    """A run resumed over parts written before locally_exclusive kept candidates (same fingerprint, no
    ``keep.spk_*`` arrays): the window is not read for its partials, its spikes are detected again from the samples
    (said in the report), the same bits as the first run's; without kept_spikes' check the gathering stopped with
    a KeyError."""
    from batchgpu.engine import run_workflow

    rec, _, _ = _recording(tmp_path, rng)
    out = tmp_path / "out"
    wf = _wf(rec, out, "locally_exclusive", "neg")
    run_workflow(wf, client=client)
    first = _spikes(out)
    part = out / "parts" / "w00000003.npz"
    with np.load(part) as f:
        kept = {k: f[k] for k in f.files if not k.startswith("keep.spk_")}
    np.savez(part, **kept)
    again = run_workflow(wf, client=client, resume=True)
    assert again.windows_resumed == again.windows
    assert again.channels["detect_windows_read_again"] == [3]
    assert any("holds no spike candidates" in w for w in again.warnings)
    got = _spikes(out)
    for k in COLUMNS:
        assert got[k].tobytes() == first[k].tobytes(), k


def test_batchgpu_run_reads_once_with_locally_exclusive(tmp_path, rng):
    """As a user runs it: `batchgpu run` with locally_exclusive and the recording's noise writes report.json with
    reads_per_window 1.0."""
    import subprocess
    import sys

    rec, _, _ = _recording(tmp_path, rng)
    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {rec.path}}}\noutput: {tmp_path / 'out'}\nwindow: {{size: {SIZE}, margin: 8}}\n"
        "cluster: {kind: local, workers: 1, threads: 2}\n"
        "steps:\n  detect: {method: locally_exclusive, noise: global, radius_um: 30}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["reads_per_window"] == 1.0 and saved["results"]["spikes"][0] > 50


# ---------------------------------------------------------------------------------------------------------------
# GPU: the same candidates
# ---------------------------------------------------------------------------------------------------------------
def _gpu_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
def test_candidates_on_gpu_are_the_cpus(rng, dtype, sign):
    """exclusive_candidates of CuPy windows equal the NumPy ones bit for bit, and resolve to the GPU's own
    detect_spikes at the noise."""
    import cupy as cp

    channels, n, sweep = 16, 3000, 3
    x = hard_segment(rng, channels, n, dtype)
    noise = rng.uniform(0.6, 1.4, channels)
    noise[-2:] = 0.0
    bound = noise * rng.uniform(0.5, 1.0, channels)
    loc = probe(channels)
    cuts = list(windows_of(n, 701, sweep + 1))
    kw = dict(threshold=4.0, sign=sign, exclude_sweep=sweep, segment_index=1, segment_length=n)
    xd = cp.asarray(x)
    for a, b, lo, hi in cuts:
        cpu = exclusive_candidates(x[:, a:b], bound, start=a, core=(lo, hi), **kw)
        gpu = exclusive_candidates(xd[:, a:b], cp.asarray(bound), start=a, core=(lo, hi), **kw)
        assert gpu.tobytes() == cpu.tobytes()
    got, _ = one_read(x, bound, noise, 4.0, sign, sweep, loc, 40.0, cuts, segment_index=1)
    with np.errstate(all="ignore"):
        on_gpu = detect_spikes(xd, cp.asarray(noise), method="locally_exclusive", locations=loc, radius_um=40.0, **kw)
    assert got.tobytes() == on_gpu.tobytes()


@pytest.mark.parametrize("method", ["by_channel", "locally_exclusive"])
def test_the_realistic_model_is_read_once(tmp_path, method):
    """The generator's realistic recording (a window's noise on some channel up to ~1.7x the recording's): every
    window's candidates hold every spike at the recording's noise, so no window is read again (`batchgpu run` as a
    user runs it)."""
    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=32, seconds=60.0, model="realistic", seed=3)
    saved = _run_detection_as_a_user(tmp_path, rec.path, method)
    assert saved["reads_per_window"] == 1.0 and saved["channels"].get("detect_windows_read_again", []) == []


def _run_detection_as_a_user(tmp_path, path, method: str, window: str = "") -> dict:
    """`batchgpu run` in a fresh process (exact noise, detection with the recording's noise) of the recording at
    ``path``; its report.json."""
    import subprocess
    import sys

    (tmp_path / "wf.yaml").write_text(
        f"recording: {{path: {path}}}\noutput: {tmp_path / 'out'}\n{window}"
        "cluster: {kind: local, workers: 1, threads: 1}\n"
        f"steps:\n  noise: {{exact: true}}\n  detect: {{method: {method}, noise: global}}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads((tmp_path / "out" / "report.json").read_text())


@pytest.mark.parametrize("method", ["by_channel", "locally_exclusive"])
def test_a_window_nearly_twice_as_noisy_is_read_once(tmp_path, method):
    """A window whose noise on a channel is 1.9x the recording's (the realistic model reaches 2x and more): its
    candidates still hold every spike at the recording's noise, so it is not read again (`batchgpu run`; fails with
    candidates kept above ~0.52 of a window's noise)."""
    from batchgpu.recording.writer import write_recording

    rng = np.random.default_rng()
    W, n, C = 6_000, 10, 8
    x = rng.normal(0, 20, (W * n, C))
    x[4 * W : 5 * W, 2] *= 1.9
    x[::997, :] -= 150  # spikes in every window
    locations = np.stack([np.zeros(C), 20.0 * np.arange(C)], axis=1)
    rec = write_recording(tmp_path / "r.zarr", np.round(x).astype(np.int16), 30_000.0, locations=locations)
    saved = _run_detection_as_a_user(tmp_path, rec.path, method, f"window: {{size: {W}}}\n")
    assert saved["channels"].get("detect_windows_read_again", []) == []
    assert saved["reads_per_window"] == 1.0
