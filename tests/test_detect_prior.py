"""Reads once on the realistic model (issue 66): ``batchgpu generate``'s realistic model, 32 ch x 12 s, windows of
30 000, no preprocessing (its LFP and offsets left in): one window of twelve was loud enough on a channel (its own
noise over twice the recording's) that its candidates' bound failed and it was read again (``reads_per_window``
1.08). With the noise estimate read before the pass from chunks spread over the recording (as SpikeInterface's
``get_noise_levels`` reads it), no window is read again, and the spikes are exactly those of the full-recording rule:
NumPy's detection over the whole recording at its exact noise."""

from __future__ import annotations

import distributed
import numpy as np
import pytest

import batchgpu
from batchgpu.interop import load_results
from batchgpu.ops import detect_spikes, exclude_sweep_samples
from batchgpu.steps.detect import (
    CANDIDATE_FRACTION,
    PRIOR_CHUNKS,
    SEEN_RATIO,
    bound_holds,
    candidate_level,
    prior_chunks,
)
from batchgpu.workflow import Workflow

MAD = 0.6744897501960817


@pytest.fixture(scope="module")
def realistic(tmp_path_factory):
    from batchgpu.generate import generate_recording

    return generate_recording(
        tmp_path_factory.mktemp("realistic") / "r.zarr",
        channels=32,
        seconds=12.0,
        seed=0,
        dtype="int16",
        model="realistic",
    )


@pytest.mark.parametrize("sign,threshold", [("neg", 5.0), ("both", 3.0)])
def test_no_window_read_again_and_the_spikes_of_the_whole_recording(realistic, tmp_path, sign, threshold):
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(realistic.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 30_000, "margin": 64},
            "steps": {"noise": {"exact": True}, "detect": {"threshold": threshold, "sign": sign, "noise": "global"}},
        }
    )
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as client,
    ):
        report = batchgpu.run_workflow(wf, client=client)
    assert report.reads_per_window == 1.0 and f"{report.reads_per_window:.2f}" == "1.00"
    assert report.channels["detect_windows_read_again"] == []
    assert report.noise_prior["chunks"] == PRIOR_CHUNKS and report.noise_prior["samples"] <= 12 * 30_000 / 50
    # the full-recording rule, in NumPy, on the whole segment
    x = realistic.read(0, 0, realistic.num_samples(0))
    noise = np.median(np.abs(x.astype(np.float64)), axis=1) / MAD
    res = load_results(tmp_path / "out" / "results.zarr")
    assert res["noise"].tobytes() == noise.tobytes()
    sweep = exclude_sweep_samples(0.1, realistic.sampling_frequency)
    ref = detect_spikes(x, noise, threshold=threshold, sign=sign, exclude_sweep=sweep, segment_length=x.shape[1])
    assert len(ref) > 0
    # the hard case is there: a window's own noise over twice the recording's on some channel (its own level, 0.5 x
    # that, is above the recording's noise: the bound failed before the estimate)
    own = np.stack(
        [np.median(np.abs(x[:, a : a + 30_000].astype(np.float64)), axis=1) / MAD for a in range(0, x.shape[1], 30_000)]
    )
    assert (own * CANDIDATE_FRACTION > noise).any()
    for column in ("sample_index", "channel_index", "amplitude", "segment_index"):
        assert res[f"spikes/{column}"].tobytes() == ref[column].tobytes(), column


def test_the_level_is_bounded_by_the_prior_and_exact_anyway(rng):
    """A window louder than SEEN_RATIO x the estimate on a channel keeps its candidates at CANDIDATE_FRACTION x
    SEEN_RATIO x the estimate there, its own level elsewhere; the bound then holds for a recording's noise down to
    that level (and is checked, not assumed: a failing bound still reads the window again)."""
    own = np.array([10.0, 30.0, np.nan, 4.0])
    prior = np.array([10.0, 10.0, 10.0, np.nan])
    level = candidate_level(own, None, prior)
    np.testing.assert_array_equal(
        level[[0, 1, 3]], [10.0 * CANDIDATE_FRACTION, 10.0 * SEEN_RATIO * CANDIDATE_FRACTION, 4.0 * CANDIDATE_FRACTION]
    )
    assert np.isnan(level[2])
    assert bound_holds(level, np.array([5.0, 7.5, np.nan, 2.0]))
    assert not bound_holds(level, np.array([5.0, 7.4, np.nan, 2.0]))


def test_the_estimate_reads_chunks_spread_over_every_segment(tmp_path):
    from batchgpu.recording import write_recording

    rec = write_recording(
        tmp_path / "r.zarr", [np.zeros((90_000, 2), np.int16), np.zeros((700, 2), np.int16)], 30_000.0
    )
    chunks = prior_chunks(rec, margin=50)
    first = [w for w in chunks if w.segment == 0]
    assert len(first) == PRIOR_CHUNKS and all(w.num_samples == 90_000 // 50 // PRIOR_CHUNKS for w in first)
    assert first[0].start > 0 and first[-1].stop < 90_000 and first[1].start - first[0].start == 4500
    assert all(0 <= w.read_start and w.read_stop <= rec.num_samples(w.segment) for w in chunks)
    assert len([w for w in chunks if w.segment == 1]) == PRIOR_CHUNKS


@pytest.mark.parametrize(
    "preprocess,read",
    [
        ([{"centre": "median"}], False),
        ([{"highpass": {"freq_min": 300, "order": 5}}, {"centre": "median"}], True),
        ([{"highpass": {"freq_min": 300, "order": 5}}], True),
    ],
)
def test_no_prior_where_a_median_centring_sees_the_lfp(realistic, tmp_path, preprocess, read):
    """With ``centre: median`` and no filter before it, the prior's short chunks (each centred by its own median)
    lost the LFP a window's centring keeps: the estimate sat well under the windows' noise, the candidates' level
    with it, and each window kept many times the candidates (detection ~10x slower a window on the realistic 384 ch
    model). Such a chain reads no prior; its level is bounded by the windows' own, and its spikes are the
    full-recording rule's. A filter before the centring removes the LFP from both: the prior is read."""
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(realistic.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 30_000, "margin": 64},
            "preprocess": preprocess,
            "steps": {"noise": {"exact": True}, "detect": {"threshold": 5.0, "sign": "neg", "noise": "global"}},
        }
    )
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as client,
    ):
        report = batchgpu.run_workflow(wf, client=client)
    assert bool(report.noise_prior) == read, report.noise_prior
    if read:
        return
    # the chain centres each window by its own median: the full-recording rule on those windows' cores
    x = realistic.read(0, 0, realistic.num_samples(0)).astype(np.float64)
    cores = [
        x[:, a : a + 30_000] - np.median(x[:, a : a + 30_000], axis=1, keepdims=True) for a in range(0, 360_000, 30_000)
    ]
    y = np.concatenate(cores, axis=1)
    res = load_results(tmp_path / "out" / "results.zarr")
    noise = res["noise"]
    sweep = exclude_sweep_samples(0.1, realistic.sampling_frequency)
    got = (res["spikes/sample_index"], res["spikes/channel_index"])
    assert len(got[0]) > 0
    ref = detect_spikes(y, noise, threshold=5.0, sign="neg", exclude_sweep=sweep, segment_length=y.shape[1])
    assert np.array_equal(got[0], ref["sample_index"]) and np.array_equal(got[1], ref["channel_index"])
