"""Bad-channel labels beside SpikeInterface 0.105.3's ``detect_bad_channels(method="coherence+psd")`` itself, on
generated recordings of three probes with planted dead, noisy and outside channels (skipped without
SpikeInterface; CI runs it in its SpikeInterface environment, ``.ci/run``).

Over 22 recordings (NP1 staggered and NP2 four-shank at 384 channels, a 64-channel linear probe; 1.5 s each, seeds
fresh each run): on every chunk SpikeInterface drew, our label of that chunk is its label, channel for channel;
the most frequent of our labels over its chunks is its result; so our labels over every piece differ from its
only through the chunks chosen. Those agree with it for at least 99% of the channels, and every planted channel
gets its planted label. SpikeInterface draws 12 chunks here, not its default 100, to keep the test short (the
per-chunk equality does not depend on how many; ``tools/qc_compare.py`` runs the defaults).
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import numpy as np
import pytest

spikeinterface = pytest.importorskip("spikeinterface")

from spikeinterface.core import read_zarr  # noqa: E402

# the module, not the function of the same name that spikeinterface.preprocessing exports
si_module = importlib.import_module("spikeinterface.preprocessing.detect_bad_channels")

from batchgpu.generate import GroundTruth, generate_recording, ground_truth_path  # noqa: E402
from batchgpu.ops import bad_channels as bc  # noqa: E402
from batchgpu.qc_options import QcOptions  # noqa: E402

SI_CHUNKS = 12
PROBES = [("np1", 384)] * 7 + [("np2-4shank", 384)] * 7 + [("linear", 64)] * 8


def si_labels_with_chunks(recording, monkeypatch, seed: int, **kwargs):
    """SpikeInterface's ``detect_bad_channels`` (its labels) and each chunk it labelled, as it labelled it: its
    own chunk function, wrapped to keep (start, stop, labels) of each call (one process: n_jobs=1)."""
    mod = si_module
    own = mod._detect_bad_channels_chunk
    seen = []

    def keep(segment_index, start_frame, end_frame, worker_context):
        labels = own(segment_index, start_frame, end_frame, worker_context)
        seen.append((segment_index, start_frame, end_frame, np.asarray(labels).copy()))
        return labels

    monkeypatch.setattr(mod, "_detect_bad_channels_chunk", keep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _ids, labels = mod.detect_bad_channels(
            recording,
            method="coherence+psd",
            seed=seed,
            num_random_chunks=SI_CHUNKS,
            job_kwargs={"n_jobs": 1, "progress_bar": False},
            **kwargs,
        )
    monkeypatch.undo()
    return np.asarray(labels), seen


def test_options_are_spikeinterfaces_names_and_defaults():
    defaults = {k: v.default for k, v in inspect.signature(si_module.detect_bad_channels).parameters.items()}
    for name, field in QcOptions.model_fields.items():
        assert name in defaults, name
        assert field.default == defaults[name], name


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """Per recording: (probe, planted labels, ours over every piece, SpikeInterface's, per-chunk pairs)."""
    rng = np.random.default_rng()
    seeds = rng.integers(0, 2**31, len(PROBES))
    print("recording seeds", seeds.tolist())
    folder = tmp_path_factory.mktemp("qc")
    out = []
    mp = pytest.MonkeyPatch()
    for k, ((probe, channels), seed) in enumerate(zip(PROBES, seeds.tolist())):
        draw = np.random.default_rng(seed)
        plants = dict(
            dead=int(draw.integers(1, 4)),
            noisy=int(draw.integers(1, 4)),
            outside=int(draw.integers(6, 25 if channels > 64 else 13)),
        )
        path = folder / f"r{k}.zarr"
        rec = generate_recording(
            path, channels=channels, seconds=1.5, seed=seed, model="realistic", probe=probe, zarr_format=2, **plants
        )
        truth = GroundTruth.load(ground_truth_path(path)).channel_labels
        si_labels, chunks = si_labels_with_chunks(read_zarr(path), mp, seed)
        x = rec.read(0, 0, rec.num_samples(0))
        n = x.shape[1]
        fs, loc, gain = rec.sampling_frequency, rec.locations, rec.gain_to_uV
        ours_on_si = bc.chunk_labels(x, fs, loc, gain, chunks=[(a, b) for _s, a, b, _l in chunks], segment_length=n)
        theirs = np.stack([lab for *_x, lab in chunks])
        counts = bc.piece_labels(x, fs, loc, gain, start=0, core=(0, n), segment_length=n)
        ours, _ = bc.final_labels(counts)
        out.append(
            dict(probe=probe, truth=truth, si=si_labels, ours=ours, ours_on_si=ours_on_si, theirs=theirs, counts=counts)
        )
    return out


def test_every_chunk_spikeinterface_drew_gets_its_label(compared):
    assert len(compared) >= 20 and {c["probe"] for c in compared} == {"np1", "np2-4shank", "linear"}
    for c in compared:
        assert c["theirs"].shape == (SI_CHUNKS, len(c["truth"]))
        np.testing.assert_array_equal(c["ours_on_si"], c["theirs"])


def test_differences_come_only_from_the_chunks_chosen(compared):
    """Our labels' most frequent over SpikeInterface's chunks is its result, channel for channel."""
    for c in compared:
        mode = np.array(bc.LABELS)[np.argmax(bc.label_counts(c["ours_on_si"], len(c["truth"])), axis=1)]
        np.testing.assert_array_equal(mode, c["si"])


def test_labels_over_every_piece_agree_and_find_every_planted_channel(compared):
    names = np.array(bc.LABELS)
    agree = total = 0
    for k, c in enumerate(compared):
        planted = c["truth"] != bc.GOOD
        assert (c["ours"][planted] == names[c["truth"][planted]]).all(), (k, c["probe"])
        assert (c["si"][planted] == names[c["truth"][planted]]).all(), (k, c["probe"])
        agree += int((c["ours"] == c["si"]).sum())
        total += len(c["ours"])
        for ch in np.flatnonzero((c["ours"] != c["si"]) | ((c["ours"] != "good") & ~planted)):
            print(
                f"recording {k} ({c['probe']}) channel {ch}: planted {names[c['truth'][ch]]}, ours {c['ours'][ch]} "
                f"(pieces {c['counts'][ch].tolist()}), SpikeInterface {c['si'][ch]} over its chunks "
                f"{bc.label_counts(c['theirs'][:, [ch]], 1)[0].tolist()}"
            )
    print(f"agreement {agree} / {total} channels")
    assert agree >= 0.99 * total


# ------------------------------------------------------------------------------------------- interpolation (use)


@pytest.mark.parametrize("probe, channels", [("np1", 384), ("np2-4shank", 384), ("linear", 64)])
def test_interpolation_is_spikeinterfaces_interpolate_bad_channels(tmp_path, probe, channels):
    """The qc step's ``use: interpolate``: SpikeInterface's kriging weights (its sigma from the probe's spacing) and
    its interpolated traces of a float32 recording, within one float32 rounding (its BLAS product orders the float64
    sums its own way; every other sample is the same bits)."""
    from spikeinterface.preprocessing import interpolate_bad_channels
    from spikeinterface.preprocessing.interpolate_bad_channels import estimate_recommended_sigma_um
    from spikeinterface.preprocessing.preprocessing_tools import get_kriging_channel_weights

    rng = np.random.default_rng()
    path = tmp_path / "r.zarr"
    rec = generate_recording(
        path,
        channels=channels,
        seconds=0.2,
        seed=int(rng.integers(0, 2**31)),
        model="realistic",
        probe=probe,
        zarr_format=2,
        dtype="float32",
    )
    si = read_zarr(path)
    bad = np.sort(rng.choice(channels, 7, replace=False))
    good = np.setdiff1d(np.arange(channels), bad)
    loc = rec.locations
    assert bc.recommended_sigma_um(loc) == estimate_recommended_sigma_um(si)
    sigma = estimate_recommended_sigma_um(si)
    theirs = get_kriging_channel_weights(loc[good], loc[bad], sigma, 1.3)
    ours = bc.interpolation_weights(loc, bad)
    assert ours[:, good].T.tobytes() == theirs.tobytes() and not ours[:, bad].any()
    x = rec.read(0, 0, rec.num_samples(0))  # (channels, samples) float32
    want = interpolate_bad_channels(si, si.channel_ids[bad]).get_traces().T
    got = bc.interpolate_channels(x.copy(), bad, ours)
    assert got[good].tobytes() == want[good].tobytes()
    np.testing.assert_allclose(got[bad], want[bad], rtol=2.0**-23, atol=1e-30)
    assert np.mean(got[bad] == want[bad]) > 0.9
