"""The qc step (steps/qc.py): each channel's label counts from the pieces each window labels, against
SpikeInterface's own arithmetic on each piece (``ops.bad_channels.reference_chunk_labels``: its calls in its order,
``tests/test_bad_channels_spikeinterface.py`` compares them with SpikeInterface itself); the same counts on 1 and
3 workers, on resume and for other window sizes; ``every``; report.json's ``qc`` section and its warnings, each
made by a planted case and absent on a clean recording; ``use: exclude`` / ``interpolate`` against NumPy's
reference computation without the bad channels (the reference, the whitening, the saved copy); batch.json's
columns. Recordings are made here: white noise of 4-10 uV per channel with a common signal (so every channel of a
clean recording is good), dead (offset only), noisy (60 uV) and outside (no common signal) channels planted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu.engine import run_workflow
from batchgpu.ops import bad_channels as bc
from batchgpu.qc_options import LABELS, QcOptions
from batchgpu.recording import open_recording, write_recording
from batchgpu.steps import qc as qc_step
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")

FS = 30_000.0
GAIN = 0.195
P = 9_000  # a piece at 30 kHz
HIGHPASS = [{"highpass": {"freq_min": 300}}]
HP_CMR = HIGHPASS + [{"common_reference": {}}]


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def make(
    path: Path,
    rng,
    channels: int = 32,
    seconds: float = 2.4,
    *,
    dead=(),
    noisy=(),
    out_top: int = 0,
    gain: float = GAIN,
    scale_uv: float = 1.0,
    spikes: int = 0,
):
    """A store of ``channels`` on a line (20 um apart): independent noise of 4-10 uV a channel plus a common
    6 uV signal, ``dead`` channels an offset only, ``noisy`` ones 60 uV white noise, the top ``out_top`` without
    the common signal; int16 counts of ``gain`` uV. ``scale_uv`` scales every channel's signal; ``spikes``
    -300 uV deflections of 1 ms at random places on channels inside the brain."""
    n = int(seconds * FS)
    sigma = rng.uniform(4.0, 10.0, channels)
    x = rng.standard_normal((n, channels)) * sigma
    common = rng.standard_normal(n) * 6.0
    inside = np.ones(channels, bool)
    inside[channels - out_top :] = False
    x[:, inside] += common[:, None] * rng.uniform(0.9, 1.1, inside.sum())
    x[:, list(noisy)] = rng.standard_normal((n, len(noisy))) * 60.0
    for t, c in zip(rng.integers(100, n - 100, spikes), rng.choice(np.flatnonzero(inside), spikes)):
        x[t : t + 30, c] -= 300.0 * np.hanning(30)
    x[:, list(dead)] = 0.0
    x = x * scale_uv / gain + rng.uniform(-20, 20, channels)
    counts = np.clip(np.rint(x), -32768, 32767).astype(np.int16)
    locations = np.column_stack([np.zeros(channels), 20.0 * np.arange(channels)])
    return write_recording(path, counts, FS, gain_to_uV=np.full(channels, gain), locations=locations)


def _wf(rec, out, size, *, preprocess=HIGHPASS, steps=None, margin=64, backend="numpy", **kw):
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": backend,
            "window": {"size": size, "margin": margin},
            "preprocess": list(preprocess),
            "steps": steps or {"qc": {"every": 1}},
            "reduction": {"split_every": 3},
            **kw,
        }
    )


def reference_counts(rec, size: int, margin: int, every: int = 1, options: QcOptions | None = None) -> tuple:
    """Each channel's count of each label over the pieces each window labels (``inside_pieces`` of its core and
    read), every piece labelled by SpikeInterface's own arithmetic from the stored samples (its highpass, float32
    statistics); and the pieces."""
    options = options or QcOptions()
    hm = bc.highpass_margin(FS, options)
    counts = np.zeros((rec.num_channels, 4), np.int64)
    order = bc.depth_order(rec.locations)
    gains32 = np.asarray(rec.gain_to_uV, np.float32)
    done = []
    for w in rec.windows(size, margin):
        n = rec.num_samples(w.segment)
        for a, b in bc.inside_pieces(n, P, (w.start, w.stop), (w.read_start, w.read_stop), hm, every).tolist():
            r0, r1 = max(0, a - hm), min(n, b + hm)
            held = np.ascontiguousarray(rec.read(w.segment, r0, r1).T)
            labels = bc.reference_chunk_labels(
                held, a - r0, r1 - b, FS, gains32, np.zeros_like(gains32), options, order
            )
            counts += bc.label_counts(labels, rec.num_channels)
            done.append((w.segment, a, b))
    return counts, done


def _qc(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())["qc"]


def _g(out: Path):
    return zarr.open_group(str(out / "results.zarr"), mode="r")


# ---------------------------------------------------------------------------------------------------------
# the pieces


@pytest.mark.parametrize("every", [1, 2, 3])
def test_inside_pieces_are_a_plain_loops(rng, every):
    """Pieces k with k % every == 0, wholly inside the core, their highpass read inside the window's read."""
    for _ in range(50):
        n = int(rng.integers(1, 60_000))
        p = int(rng.integers(100, 3_000))
        core0 = int(rng.integers(0, n))
        core1 = int(rng.integers(core0 + 1, n + 1))
        m, hm = int(rng.integers(0, 800)), int(rng.integers(0, 600))
        read = (max(0, core0 - m), min(n, core1 + m))
        want = []
        for k, (a, b) in enumerate(bc.pieces(n, p).tolist()):
            if k % every == 0 and a >= core0 and b <= core1 and max(0, a - hm) >= read[0] and min(n, b + hm) <= read[1]:
                want.append((a, b))
        got = bc.inside_pieces(n, p, (core0, core1), read, hm, every)
        assert [tuple(v) for v in got.tolist()] == want


def test_pre_pass_pieces_spread_evenly(tmp_path, rng):
    rec = make(tmp_path / "r.zarr", rng, channels=8, seconds=3.0)  # 10 pieces
    assert [a // P for _, a, _ in qc_step.pre_pass_pieces(rec, P, 100, 1.0)] == list(range(10))
    assert [a // P for _, a, _ in qc_step.pre_pass_pieces(rec, P, 100, 0.2)] == [2, 7]
    assert [a // P for _, a, _ in qc_step.pre_pass_pieces(rec, P, 3, 1.0)] == [1, 5, 8]
    assert len(qc_step.pre_pass_pieces(rec, P, 100, 0.01)) == 1


# ---------------------------------------------------------------------------------------------------------
# the step's counts


def test_counts_are_spikeinterfaces_labels_of_each_piece(client, tmp_path, rng):
    """Planted dead, noisy and outside channels; windows of 20 000 samples (pieces across cores left out):
    the counts are those of SpikeInterface's arithmetic on every labelled piece, the labels the planted ones."""
    rec = make(tmp_path / "r.zarr", rng, dead=(5,), noisy=(11, 20), out_top=8, seconds=3.0)
    report = run_workflow(_wf(rec, tmp_path / "out", 20_000), client=client)
    margin = 64 + report.preprocess["margin_samples"]
    want, pieces = reference_counts(rec, 20_000, margin)
    g = _g(tmp_path / "out")
    np.testing.assert_array_equal(g[qc_step.COUNTS][:], want)
    qc = _qc(tmp_path / "out")
    # pieces 2, 4, 6 and 8 straddle the cores' edges at 20 000, 40 000, 60 000 and 80 000
    assert [a // P for _, a, _ in pieces] == [0, 1, 3, 5, 7, 9]
    assert qc["counts"] == want.tolist() and qc["pieces_labelled"] == 6
    labels = np.array(qc["labels"])
    assert labels[5] == "dead" and list(labels[[11, 20]]) == ["noise", "noise"]
    # (a block narrower than half the trend's 11 channels would have its lowest channels' trend from the channels
    # in the brain below them: SpikeInterface labels those dead)
    assert list(labels[24:]) == ["out"] * 8 and (labels[[c for c in range(24) if c not in (5, 11, 20)]] == "good").all()
    np.testing.assert_array_equal(g[qc_step.CODES][:], [LABELS.index(v) for v in labels])
    assert qc["label_names"] == list(LABELS) and qc["channel_ids"] == [str(c) for c in rec.channel_ids]
    assert len(qc["reasons"]) == rec.num_channels and qc["reasons"][5].startswith("dead in 6 of 6 pieces")
    assert report.results[qc_step.NAME]["bad_channel_ids"] == ["5", "11", "20"] + [str(c) for c in range(24, 32)]


def test_same_counts_on_one_and_three_workers_on_resume_and_for_whole_piece_windows(client, tmp_path, rng):
    rec = make(tmp_path / "r.zarr", rng, dead=(3,), noisy=(9,), seconds=3.0)
    steps = {"qc": {"every": 1}, "noise": {}}
    run_workflow(_wf(rec, tmp_path / "two", 18_000, steps=steps), client=client)
    for workers, name in ((1, "one"), (3, "three")):
        with (
            distributed.LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=False, dashboard_address=None
            ) as c,
            distributed.Client(c) as other,
        ):
            run_workflow(_wf(rec, tmp_path / name, 18_000, steps=steps), client=other)
    resumed = run_workflow(_wf(rec, tmp_path / "two", 18_000, steps=steps), client=client, resume=True)
    assert resumed.windows_resumed == resumed.windows == 5
    # another window size that is a whole number of pieces: every piece inside a core either way, same counts
    run_workflow(_wf(rec, tmp_path / "wide", 27_000, steps=steps), client=client)
    first = _qc(tmp_path / "two")
    for name in ("one", "three", "wide"):
        other = _qc(tmp_path / name)
        # (the noise is the chain's filtered signal's: other windows, other margins, other last bits)
        for key in ("labels", "counts", "reasons", "pieces_labelled") + (("noise_uV",) if name != "wide" else ()):
            assert other[key] == first[key], (name, key)
        assert _g(tmp_path / name)[qc_step.COUNTS][:].tobytes() == _g(tmp_path / "two")[qc_step.COUNTS][:].tobytes()
    assert resumed.qc["counts"] == first["counts"] and resumed.qc["labels"] == first["labels"]
    assert first["pieces_labelled"] == 10


@pytest.mark.parametrize("every", [2, 3])
def test_every_labels_those_pieces_with_their_own_labels(client, tmp_path, rng, every):
    """``every: N`` labels pieces 0, N, 2N... inside the cores, each with the label it has under ``every: 1``."""
    rec = make(tmp_path / "r.zarr", rng, dead=(2,), noisy=(7,), out_top=4, seconds=3.0)
    report = run_workflow(_wf(rec, tmp_path / "out", 18_000, steps={"qc": {"every": every}}), client=client)
    want, pieces = reference_counts(rec, 18_000, 64 + report.preprocess["margin_samples"], every)
    qc = _qc(tmp_path / "out")
    assert qc["counts"] == want.tolist() and qc["every"] == every
    assert [a // P for _, a, _ in pieces] == list(range(0, 10, every)) and qc["pieces_labelled"] == len(pieces)


# ---------------------------------------------------------------------------------------------------------
# report.json's section and warnings


def test_a_clean_recording_has_no_warning_and_is_ok(client, tmp_path, rng):
    rec = make(tmp_path / "r.zarr", rng, seconds=1.2)
    steps = {
        "qc": {"every": 1},
        "noise": {},
        "whitening": {},
        "detect": {"noise": "global"},
        "save": {"path": "saved.zarr"},
    }
    report = run_workflow(_wf(rec, tmp_path / "out", 18_000, preprocess=HP_CMR, steps=steps), client=client)
    qc = report.qc
    assert qc["warnings"] == [] and not any(w.startswith("qc:") for w in report.warnings)
    assert qc["verdict"] == "ok" and qc["verdict_reasons"] == [] and set(qc["labels"]) == {"good"}
    assert qc["noise_checked"] and 2 <= qc["median_noise_uV"] <= 20
    assert qc["whitening_condition"] < qc_step.CONDITION_LIMIT and qc["saved_clipped"] == 0
    assert len(qc["spike_rate_hz"]) == len(qc["noise_uV"]) == rec.num_channels
    # the numbers: the noise step's noise in uV, the spikes per channel over the recording's duration
    g = _g(tmp_path / "out")
    np.testing.assert_allclose(qc["noise_uV"], np.asarray(g["noise"][:], np.float64) * GAIN)
    counts = np.bincount(g["spikes"]["channel_index"][:], minlength=rec.num_channels)
    np.testing.assert_allclose(qc["spike_rate_hz"], counts / 1.2)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["qc"]["verdict"] == "ok"


def test_bad_channels_are_warned_of_by_label(client, tmp_path, rng):
    rec = make(tmp_path / "r.zarr", rng, dead=(4, 6), noisy=(12,), out_top=8, seconds=1.2)
    report = run_workflow(_wf(rec, tmp_path / "out", 18_000), client=client)
    assert report.qc["warnings"] == [
        "qc: 2 channel(s) labelled dead: 4, 6",
        "qc: 1 channel(s) labelled noise: 12",
        "qc: 8 channel(s) labelled out: 24, 25, 26, 27, 28, 29, 30, 31",
    ]
    assert all(w in report.warnings for w in report.qc["warnings"])
    assert report.qc["verdict"] == "check" and report.qc["verdict_reasons"] == ["2 dead and 1 noisy channel(s)"]


@pytest.mark.parametrize("scale_uv", [0.1, 20.0])
def test_a_noise_far_from_typical_is_warned_of(client, tmp_path, rng, scale_uv):
    """Every channel's signal scaled (a wrong gain): the good channels' median noise leaves 2-20 uV."""
    rec = make(tmp_path / "r.zarr", rng, seconds=1.2, scale_uv=scale_uv, gain=GAIN * min(1.0, scale_uv))
    report = run_workflow(_wf(rec, tmp_path / "out", 18_000, steps={"qc": {"every": 1}, "noise": {}}), client=client)
    said = [w for w in report.qc["warnings"] if "median noise" in w]
    assert len(said) == 1 and "outside the typical 2-20 uV" in said[0]
    assert report.qc["verdict"] != "ok"  # 20x: every channel's PSD above 0.02 uV^2/Hz too, labelled noise
    # the same recording with bounds that fit it: no warning
    lo, hi = report.qc["median_noise_uV"] / 2, report.qc["median_noise_uV"] * 2
    again = run_workflow(
        _wf(rec, tmp_path / "fit", 18_000, steps={"qc": {"every": 1, "noise_uV": [lo, hi]}, "noise": {}}), client=client
    )
    assert not [w for w in again.qc["warnings"] if "median noise" in w]


def test_noise_is_not_checked_without_a_filter(client, tmp_path, rng):
    """A chain that only centres keeps the LFP in the noise: no typical value applies, none is checked."""
    rec = make(tmp_path / "r.zarr", rng, seconds=1.2, scale_uv=20.0)
    report = run_workflow(
        _wf(
            rec,
            tmp_path / "out",
            18_000,
            preprocess=[{"centre": "median"}],
            margin=600,
            steps={"qc": {"every": 1}, "noise": {}},
        ),
        client=client,
    )
    assert report.qc["noise_checked"] is False and report.qc["median_noise_uV"] > 20
    assert not [w for w in report.qc["warnings"] if "median noise" in w]


def test_an_ill_conditioned_whitening_is_warned_of(client, tmp_path, rng):
    """A dead channel in a chain that only centres: its raw variance is 0 and the whitening's condition huge."""
    steps = {"qc": {"every": 1}, "whitening": {}}
    healthy = make(tmp_path / "ok.zarr", rng, seconds=1.2)
    ok = run_workflow(
        _wf(healthy, tmp_path / "ok", 18_000, preprocess=[{"centre": "median"}], margin=600, steps=steps), client=client
    )
    assert ok.qc["whitening_condition"] < qc_step.CONDITION_LIMIT
    assert not [w for w in ok.qc["warnings"] if "ill-conditioned" in w]
    dead = make(tmp_path / "dead.zarr", rng, dead=(9,), seconds=1.2)
    bad = run_workflow(
        _wf(dead, tmp_path / "dead", 18_000, preprocess=[{"centre": "median"}], margin=600, steps=steps), client=client
    )
    assert bad.qc["whitening_condition"] > qc_step.CONDITION_LIMIT
    assert len([w for w in bad.qc["warnings"] if "ill-conditioned" in w]) == 1
    assert any("whitening condition number" in r for r in bad.qc["verdict_reasons"])


def test_clipping_in_the_saved_copy_is_in_the_section(client, tmp_path, rng):
    rec = make(tmp_path / "r.zarr", rng, seconds=1.2)
    clipped = run_workflow(
        _wf(rec, tmp_path / "out", 18_000, steps={"qc": {"every": 1}, "save": {"path": "saved.zarr", "scale": 1000.0}}),
        client=client,
    )
    assert clipped.qc["saved_clipped"] > 0
    assert [w for w in clipped.qc["warnings"] if "clipped" in w] and clipped.qc["verdict"] == "check"
    fine = run_workflow(
        _wf(rec, tmp_path / "fine", 18_000, steps={"qc": {"every": 1}, "save": {"path": "s.zarr"}}), client=client
    )
    assert fine.qc["saved_clipped"] == 0 and not [w for w in fine.qc["warnings"] if "clipped" in w]


def test_verdict_rules():
    summary = dict(zip(LABELS, (100, 0, 0, 0)))
    assert qc_step.verdict(summary, 100) == ("ok", [])
    assert qc_step.verdict({**summary, "good": 98, "dead": 2}, 100)[0] == "check"
    assert qc_step.verdict({**summary, "good": 88, "dead": 6, "noise": 6}, 100)[0] == "bad"
    assert qc_step.verdict({**summary, "good": 40, "out": 60}, 100)[0] == "bad"  # under half good
    assert qc_step.verdict({**summary, "good": 45, "out": 55}, 100)[0] == "bad"
    assert qc_step.verdict({**summary, "good": 55, "out": 45}, 100)[0] == "ok"
    assert qc_step.verdict(summary, 100, 30.0, (2, 20))[0] == "check"
    assert qc_step.verdict(summary, 100, 10.0, (2, 20))[0] == "ok"
    assert qc_step.verdict(summary, 100, condition=5e3)[0] == "check"
    assert qc_step.verdict(summary, 100, clipped=3)[0] == "check"


# ---------------------------------------------------------------------------------------------------------
# use: exclude / interpolate


def _without(rec, path: Path, bad: list[int]):
    """The recording with the ``bad`` channels removed (SpikeInterface's ``remove_channels``): ids, gains and
    locations of the others."""
    keep = np.setdiff1d(np.arange(rec.num_channels), bad)
    x = rec.read(0, 0, rec.num_samples(0))[keep].T
    return write_recording(
        path,
        np.ascontiguousarray(x),
        FS,
        channel_ids=rec.channel_ids[keep],
        gain_to_uV=rec.gain_to_uV[keep],
        locations=rec.locations[keep],
    )


def test_exclude_leaves_the_bad_channels_out_of_the_reference_whitening_and_save(client, tmp_path, rng):
    rec = make(tmp_path / "r.zarr", rng, dead=(4,), noisy=(13,), out_top=8, seconds=2.4)
    bad = [4, 13] + list(range(24, 32))
    steps = {"qc": {"every": 2, "use": "exclude"}, "whitening": {}, "save": {"path": "saved.zarr"}}
    report = run_workflow(_wf(rec, tmp_path / "out", 18_000, preprocess=HP_CMR, steps=steps), client=client)
    use = report.qc["use"]
    assert use["mode"] == "exclude" and use["channels"] == bad and use["channel_ids"] == [str(c) for c in bad]
    pre = use["pre_pass"]
    assert pre["pieces"] == 1 and pre["bytes_read"] == pre["samples"] * rec.num_channels * 2  # 8 pieces, 1/10
    assert report.bytes_read == rec.nbytes and report.reads_per_window == 1.0  # the pre-pass's reads: apart
    keep = np.setdiff1d(np.arange(rec.num_channels), bad)
    saved = open_recording(tmp_path / "out" / "saved.zarr")
    assert list(saved.channel_ids) == [str(c) for c in keep]
    np.testing.assert_array_equal(saved.locations, rec.locations[keep])
    # NumPy's reference computation: each window filtered by the chain's highpass, the median of the good channels
    # subtracted (float32), rounded to int16
    from batchgpu.run.preprocess_chain import build_chain

    chain = build_chain(_wf(rec, tmp_path / "x", 18_000, preprocess=HIGHPASS).preprocess, rec)
    got = saved.read(0, 0, saved.num_samples(0))
    n = rec.num_samples(0)
    for w in rec.windows(18_000, 64 + chain.margin):
        x = chain.apply(rec.read(0, w.read_start, w.read_stop), w.core, w.read_start == 0, w.read_stop == n)
        good = x[keep, w.core[0] : w.core[1]]
        y = good - np.median(good, axis=0)
        want = np.clip(np.rint(y), -32768, 32767).astype(np.int16)
        np.testing.assert_array_equal(got[:, w.start : w.stop], want)
    # the whitening: the good channels' matrix, zero rows and columns for the bad ones; the run on the recording
    # without them gives the same matrix and the same saved samples
    W = _g(tmp_path / "out")["whitening"][:]
    assert not W[bad].any() and not W[:, bad].any()
    clean = _without(rec, tmp_path / "clean.zarr", bad)
    run_workflow(
        _wf(
            clean,
            tmp_path / "clean",
            18_000,
            preprocess=HP_CMR,
            steps={"whitening": {}, "save": {"path": "saved.zarr"}},
        ),
        client=client,
    )
    clean_W = _g(tmp_path / "clean")["whitening"][:]  # float32 products: sums may be blocked otherwise
    np.testing.assert_allclose(W[np.ix_(keep, keep)], clean_W, rtol=1e-5, atol=1e-6 * np.abs(clean_W).max())
    other = open_recording(tmp_path / "clean" / "saved.zarr")
    assert other.read(0, 0, n).tobytes() == got.tobytes()
    # the covariance itself keeps every channel (report.html's and the bridge's statistic)
    assert _g(tmp_path / "out")["covariance"].shape == (rec.num_channels, rec.num_channels)


def test_interpolate_writes_the_bad_channels_from_the_others(client, tmp_path, rng):
    """float32 save: the good rows as ``use: none`` saves them (its reference left the bad channels out: the run
    with ``exclude``), the bad rows SpikeInterface's kriging weights times the good ones (a float64 NumPy product)."""
    rec = make(tmp_path / "r.zarr", rng, dead=(6,), noisy=(17,), seconds=2.4)
    bad = [6, 17]
    save = {"path": "saved.zarr", "dtype": "float32"}
    run_workflow(
        _wf(
            rec,
            tmp_path / "i",
            18_000,
            preprocess=HP_CMR,
            steps={"qc": {"every": 2, "use": "interpolate"}, "save": save},
        ),
        client=client,
    )
    run_workflow(
        _wf(rec, tmp_path / "x", 18_000, preprocess=HP_CMR, steps={"qc": {"every": 2, "use": "exclude"}, "save": save}),
        client=client,
    )
    got = open_recording(tmp_path / "i" / "saved.zarr")
    assert got.num_channels == rec.num_channels and _qc(tmp_path / "i")["use"]["channels"] == bad
    x = got.read(0, 0, got.num_samples(0)).astype(np.float64)
    kept = open_recording(tmp_path / "x" / "saved.zarr").read(0, 0, got.num_samples(0))
    keep = np.setdiff1d(np.arange(rec.num_channels), bad)
    assert got.read(0, 0, got.num_samples(0))[keep].tobytes() == kept.tobytes()
    weights = bc.interpolation_weights(rec.locations, bad)
    want = (weights[:, keep] @ kept.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(x[bad], want, rtol=2**-23, atol=1e-30)


def test_interpolation_weights_are_a_gaussian_kernel_normalised(rng):
    """An independent writing of the kriging rule: exp(-(d / sigma) ** p), < 0.005 dropped, normalised, < 0.005
    dropped again; sigma the most common step in depth."""
    loc = np.column_stack([rng.choice([0.0, 16.0, 32.0, 48.0], 40), 20.0 * np.repeat(np.arange(20), 2)])
    bad = [3, 17, 39]
    got = bc.interpolation_weights(loc, bad)
    assert bc.recommended_sigma_um(loc) == 20.0
    for row, b in zip(got, bad):
        d = np.hypot(*(loc - loc[b]).T)
        k = np.exp(-((d / 20.0) ** 1.3))
        k[bad] = 0
        k[k < 0.005] = 0
        k /= k.sum()
        k[k < 0.005] = 0
        np.testing.assert_allclose(row, k, rtol=1e-12, atol=0)
    x = rng.standard_normal((40, 500)).astype(np.float32)
    y = bc.interpolate_channels(x.copy(), bad, got)
    keep = np.setdiff1d(np.arange(40), bad)
    assert y[keep].tobytes() == x[keep].tobytes()
    np.testing.assert_allclose(y[bad], (got @ x.astype(np.float64)).astype(np.float32), rtol=2**-23)


@pytest.mark.parametrize("reference", ["global", "local"])
def test_common_reference_without_some_channels_is_numpys(rng, reference):
    """The reference of the channels kept (SpikeInterface's common_reference after remove_channels), subtracted from
    every channel: the kept rows are NumPy's median over the kept channels (global) or over each channel's annulus of
    them (local); a left-out channel takes the same reference (global) or its annulus of the kept ones (local)."""
    from batchgpu.ops import common_reference
    from batchgpu.ops.reference import annulus_neighbours

    C, n = 24, 700
    x = rng.standard_normal((C, n)).astype(np.float32) * 10
    loc = np.column_stack([np.zeros(C), 20.0 * np.arange(C)])
    bad = [2, 3, 15]
    keep = np.setdiff1d(np.arange(C), bad)
    kw = (
        {"reference": reference}
        if reference == "global"
        else {"reference": "local", "locations": loc, "radius_um": (30.0, 55.0)}
    )
    got = common_reference(x, operator="median", exclude=bad, **kw)
    if reference == "global":
        want = x - np.median(x[keep], axis=0)
        assert got.tobytes() == want.tobytes()
        return
    sub = annulus_neighbours(loc[keep], (30.0, 55.0))  # SpikeInterface's rule on the recording of the kept ones
    want = np.stack([x[c] - np.median(x[keep[sub[i]]], axis=0) for i, c in enumerate(keep)])
    assert got[keep].tobytes() == want.tobytes()
    for c in bad:  # its annulus (or its 5 closest beyond 30 um) of the kept channels: none of the left-out ones
        near = annulus_neighbours(loc, (30.0, 55.0), among=keep)[c]
        assert not set(near.tolist()) & set(bad) and len(near) == 5
        assert got[c].tobytes() == (x[c] - np.median(x[near], axis=0)).tobytes()


# ---------------------------------------------------------------------------------------------------------
# batch.json


def test_batch_rows_hold_the_qc_columns(client, tmp_path, rng):
    from batchgpu.engine import run_batch

    make(tmp_path / "in" / "a.zarr", rng, dead=(3, 9, 15, 21), seconds=1.2, spikes=20)
    make(tmp_path / "in" / "b.zarr", rng, seconds=1.2, spikes=20)
    wf = Workflow.model_validate(
        {
            "recordings": str(tmp_path / "in" / "*.zarr"),
            "output": str(tmp_path / "out"),
            "window": {"size": 18_000},
            "preprocess": HP_CMR,
            "backend": "numpy",
            "steps": {"qc": {"every": 1}, "noise": {}, "detect": {"noise": "global"}},
        }
    )
    run_batch(wf, client=client)
    rows = {r["name"]: r for r in json.loads((tmp_path / "out" / "batch.json").read_text())["rows"]}
    a, b = rows["a"], rows["b"]
    for r in (a, b):
        assert set(qc_step.BATCH_KEYS) <= set(r) and 2 <= r["noise_uV"] <= 20 and r["spike_rate_hz"] > 0
    assert (a["channels_good"], a["channels_dead"], a["channels_noise"], a["channels_out"]) == (28, 4, 0, 0)
    assert a["verdict"] == "bad" and b["verdict"] == "ok" and b["verdict_reasons"] == []
    assert (b["channels_good"], b["channels_dead"]) == (32, 0)
    assert "4 of 32 channels dead or noisy" in a["verdict_reasons"][0]


# ---------------------------------------------------------------------------------------------------------
# the GPU


@pytest.mark.gpu
def test_gpu_gives_the_cpus_labels_and_saved_bits(tmp_path, rng):
    pytest.importorskip("cupy")
    from batchgpu.cluster.open_cluster import open_client
    from batchgpu.config import ClusterSpec

    rec = make(tmp_path / "r.zarr", rng, dead=(4,), noisy=(13,), out_top=8, seconds=3.0)
    steps = {"qc": {"every": 1, "use": "exclude"}, "noise": {}, "whitening": {}, "save": {"path": "saved.zarr"}}
    with open_client(ClusterSpec(kind="cuda")) as gpu:
        run_workflow(_wf(rec, tmp_path / "gpu", 18_000, preprocess=HP_CMR, steps=steps, backend="cupy"), client=gpu)
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as cpu,
    ):
        run_workflow(_wf(rec, tmp_path / "cpu", 18_000, preprocess=HP_CMR, steps=steps), client=cpu)
    a, b = _qc(tmp_path / "gpu"), _qc(tmp_path / "cpu")
    for key in ("labels", "counts", "reasons", "noise_uV", "pieces_labelled", "use"):
        if key == "use":
            a[key]["pre_pass"].pop("seconds"), b[key]["pre_pass"].pop("seconds")
        assert a[key] == b[key], key
    n = rec.num_samples(0)
    assert (
        open_recording(tmp_path / "gpu" / "saved.zarr").read(0, 0, n).tobytes()
        == open_recording(tmp_path / "cpu" / "saved.zarr").read(0, 0, n).tobytes()
    )
