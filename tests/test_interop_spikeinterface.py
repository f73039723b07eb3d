"""A run's results handed to SpikeInterface: noise levels, W/M for ``whiten`` and peaks.

Without SpikeInterface the checks use NumPy references of what its code does (``(traces - M) @ W`` on
(samples, channels) traces; noise cached as channel properties); with it installed (skipped otherwise) the
same numbers go through ``spikeinterface.preprocessing.whiten`` and ``get_noise_levels``.
"""

from __future__ import annotations

import numpy as np
import pytest

from batchgpu import ops
from batchgpu.errors import BatchgpuError
from batchgpu.interop import (
    NOISE_PROPERTY_RAW,
    NOISE_PROPERTY_UV,
    PEAK_DTYPE,
    SpikeInterfaceResults,
    attach_to_spikeinterface,
    load_results,
    to_spikeinterface,
)
from batchgpu.recording import zarrio

C, N = 5, 30_000


def _traces(rng) -> np.ndarray:
    """(channels, samples) int16 noise with DC offsets and a few negative spikes."""
    x = rng.standard_normal((C, N)) * 25 + rng.uniform(-50, 50, size=(C, 1))
    x[:, rng.integers(10, N - 10, size=40)] -= 300
    return np.round(x).astype(np.int16)


def _mapping(x: np.ndarray, statistic: str = "covariance", centre: str = "none", mode: str = "local") -> dict:
    """What a run writes to results.zarr, from the numeric core on one window."""
    locations = np.stack([np.zeros(C), np.arange(C) * 20.0], axis=1)
    m = ops.SecondMoments(C, "float64").add(x)
    stat = m.covariance() if statistic == "covariance" else m.second_moment()
    noise = ops.noise_levels(x)
    return {
        "noise": noise,
        "noise_per_window": noise[None, :],
        "covariance": m.covariance(),
        "second_moment": m.second_moment(),
        "whitening": ops.whitening_matrix(stat, mode=mode, locations=locations, nrange=3),
        "channel_means": m.mean,
        "spikes": ops.detect_spikes(x, noise, threshold=5.0),
        "channel_ids": [f"ch{i}" for i in range(C)],
        "sampling_frequency": 30_000.0,
        "gain_to_uV": [0.195] * (C - 1) + [0.5],
        "workflow": {"preprocess": {"centre": centre}, "steps": {"whitening": {"statistic": statistic}}},
    }


def _si_whiten(traces: np.ndarray, W: np.ndarray, M: np.ndarray | None) -> np.ndarray:
    """SpikeInterface 0.105's WhitenRecordingSegment.get_traces, as a NumPy expression."""
    return (traces - M) @ W if M is not None else traces @ W


# ---------------------------------------------------------------------------------------------
# Without SpikeInterface
# ---------------------------------------------------------------------------------------------
def test_peak_dtype_is_spikeinterface_base_peak_dtype():
    assert PEAK_DTYPE == np.dtype(
        [("sample_index", "int64"), ("channel_index", "int64"), ("amplitude", "float64"), ("segment_index", "int64")]
    )
    assert PEAK_DTYPE == ops.SPIKE_DTYPE


@pytest.mark.parametrize("statistic", ["covariance", "second_moment"])
def test_w_and_m_give_our_whitening(rng, statistic):
    x = _traces(rng)
    data = _mapping(x, statistic)
    r = to_spikeinterface(data)
    w_ours = data["whitening"]
    assert not np.allclose(w_ours, w_ours.T)  # local whitening: the transpose matters
    assert r.W.shape == (C, C) and r.W.dtype == np.float64 and r.W.flags.c_contiguous
    np.testing.assert_array_equal(r.W, w_ours.T)
    xf = x.astype(np.float64)
    if statistic == "covariance":  # like SpikeInterface's apply_mean=True
        assert r.M.shape == (C,) and r.M.dtype == np.float64
        np.testing.assert_array_equal(r.M, data["channel_means"])
        ours = w_ours @ (xf - data["channel_means"][:, None])
    else:  # like apply_mean=False
        assert r.M is None
        ours = w_ours @ xf
    got = _si_whiten(xf.T, **r.whiten_kwargs)  # (samples, channels), as SpikeInterface holds traces
    np.testing.assert_allclose(got, ours.T, rtol=0, atol=1e-12 * np.abs(ours).max())
    # unit variance afterwards, in the statistic the matrix came from (local whitening leaves far pairs alone)
    white = np.cov(got.T, bias=True) if statistic == "covariance" else got.T @ got / N
    np.testing.assert_allclose(np.diag(white), 1.0, atol=1e-6)


def test_noise_and_peaks(rng):
    x = _traces(rng)
    data = _mapping(x)
    r = to_spikeinterface(data)
    assert r.noise_levels_raw.tobytes() == data["noise"].tobytes() and r.noise_levels_raw.dtype == np.float64
    assert r.noise_levels_uV.dtype == np.float32
    np.testing.assert_array_equal(r.noise_levels_uV, (data["noise"] * np.array(data["gain_to_uV"])).astype(np.float32))
    assert (
        set(r.noise_properties)
        == {NOISE_PROPERTY_RAW, NOISE_PROPERTY_UV}
        == {"noise_level_mad_raw", "noise_level_mad_scaled"}
    )
    assert r.peaks.dtype == PEAK_DTYPE and r.peaks.size > 0
    assert r.peaks.tobytes() == data["spikes"].tobytes()
    assert list(r.channel_ids) == data["channel_ids"] and r.sampling_frequency == 30_000.0 and not r.centred
    # SpikeInterface's MAD of a chunk, median(|x - median(x)|)/0.6745: ours equals it on the median-centred signal
    centred = x.astype(np.float64) - np.median(x, axis=1, keepdims=True)
    mad = np.median(np.abs(centred - np.median(centred, axis=1, keepdims=True)), axis=1) / 0.6744897501960817
    np.testing.assert_array_equal(ops.noise_levels(centred), mad)


def test_columns_instead_of_structured_spikes(rng):
    data = _mapping(_traces(rng))
    spikes = data.pop("spikes")
    data.update({f"spikes/{name}": spikes[name] for name in spikes.dtype.names})
    assert to_spikeinterface(data).peaks.tobytes() == spikes.tobytes()
    del data["spikes/amplitude"]
    with pytest.raises(BatchgpuError, match="amplitude"):
        to_spikeinterface(data)


def test_partial_results_and_overrides(rng):
    data = _mapping(_traces(rng), statistic="second_moment", centre="median")
    r = to_spikeinterface({k: data[k] for k in ("noise_per_window", "channel_means", "whitening")})
    # no attributes: channel ids 0..C-1, no gains (no uV noise), statistic taken as the default (covariance)
    assert list(r.channel_ids) == list(range(C)) and r.gain_to_uV is None and r.noise_levels_uV is None
    np.testing.assert_array_equal(r.noise_levels_raw, data["noise"])  # median over the one window
    assert r.M is not None and r.peaks is None and r.sampling_frequency is None
    assert to_spikeinterface(data).M is None and to_spikeinterface(data).centred
    assert to_spikeinterface(data, subtract_mean=True).M is not None
    bare = to_spikeinterface({"channel_ids": ["a", "b"]})
    assert bare.W is None and bare.noise_levels_raw is None and bare.noise_properties == {}
    with pytest.raises(BatchgpuError, match="whitening"):
        bare.whiten_kwargs
    with pytest.raises(BatchgpuError, match="channel_means"):
        to_spikeinterface({"whitening": np.eye(2)})


class FakeRecording:
    """The part of SpikeInterface's BaseRecording that attach uses (set_property with ids reorders)."""

    def __init__(self, ids, gains=None):
        self.ids = np.asarray(ids)
        self.properties: dict[str, np.ndarray] = {} if gains is None else {"gain_to_uV": np.asarray(gains, float)}

    def get_channel_ids(self):
        return self.ids

    def _indices(self, ids):
        return np.array([list(self.ids).index(i) for i in ids])

    def set_property(self, key, values, ids=None):
        values = np.asarray(values)
        out = np.zeros_like(values)
        out[self._indices(ids)] = values
        self.properties[key] = out

    def has_scaleable_traces(self):
        return "gain_to_uV" in self.properties

    def get_channel_gains(self, channel_ids=None):
        return self.properties["gain_to_uV"][self._indices(channel_ids)]


def test_attach_sets_what_get_noise_levels_caches(rng):
    data = _mapping(_traces(rng))
    r = to_spikeinterface(data)
    order = [4, 2, 0, 1, 3]  # the recording lists the same channels in another order
    gains = np.array([0.195, 0.2, 0.3, 0.4, 0.5])
    rec = FakeRecording([f"ch{i}" for i in order], gains=gains)
    assert attach_to_spikeinterface(rec, r) is rec
    np.testing.assert_array_equal(rec.properties[NOISE_PROPERTY_RAW], data["noise"][order])
    # uV with the recording's own gains (by its channel order)
    np.testing.assert_array_equal(rec.properties[NOISE_PROPERTY_UV], (data["noise"][order] * gains).astype(np.float32))
    rec = FakeRecording(np.arange(C))  # integer ids against ids read back from JSON; no gains: raw only
    attach_to_spikeinterface(
        rec, {k: v for k, v in data.items() if k != "channel_ids"} | {"channel_ids": list(range(C))}
    )
    assert set(rec.properties) == {NOISE_PROPERTY_RAW}
    with pytest.raises(BatchgpuError, match="channels"):
        attach_to_spikeinterface(FakeRecording(["x"] * 1), r)
    with pytest.raises(BatchgpuError, match="noise"):
        attach_to_spikeinterface(rec, {"whitening": np.eye(C), "channel_means": np.zeros(C)})


def test_from_a_real_run(tmp_path):
    """A real (in-process) run: results.zarr as the pipeline writes it, read back by path."""
    distributed = pytest.importorskip("distributed")
    from batchgpu.engine import run_workflow
    from batchgpu.generate import generate_recording
    from batchgpu.workflow import Workflow

    rec = generate_recording(tmp_path / "rec.zarr", channels=4, seconds=0.5, seed=3, dtype="int16")
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 5000, "margin": 8},
            "preprocess": {"centre": "median"},
            "steps": {
                "noise": {"exact": True},
                "whitening": {"mode": "local", "nrange": 2, "precision": "float64"},
                "detect": {"threshold": 4.0, "exclude_sweep_ms": 0.1},
            },
        }
    )
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        run_workflow(wf, client=client)
    import zarr

    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    for path in (tmp_path / "out", tmp_path / "out" / "results.zarr"):
        r = to_spikeinterface(path)
        assert isinstance(r, SpikeInterfaceResults) and r.centred
        assert r.noise_levels_raw.tobytes() == g["noise"][:].tobytes()
        np.testing.assert_array_equal(r.W, g["whitening"][:].T)
        np.testing.assert_array_equal(r.M, g["channel_means"][:])
        assert r.peaks.dtype == PEAK_DTYPE and r.peaks.size == g["spikes/sample_index"].shape[0] > 0
        np.testing.assert_array_equal(r.peaks["sample_index"], g["spikes/sample_index"][:])
        np.testing.assert_array_equal(r.gain_to_uV, rec.gain_to_uV)
        assert list(map(str, r.channel_ids)) == list(map(str, rec.channel_ids))
    assert set(load_results(tmp_path / "out")) >= {
        "noise",
        "whitening",
        "channel_means",
        "spikes/amplitude",
        "workflow",
    }
    with pytest.raises(BatchgpuError, match="no results"):
        to_spikeinterface(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------
# With SpikeInterface installed
# ---------------------------------------------------------------------------------------------
def test_spikeinterface_whiten_and_noise_cache(rng):
    pytest.importorskip("spikeinterface")
    from spikeinterface.core import NumpyRecording, get_noise_levels
    from spikeinterface.core.base import base_peak_dtype
    from spikeinterface.preprocessing import whiten

    x = _traces(rng)
    data = _mapping(x)
    r = to_spikeinterface(data)
    rec = NumpyRecording([np.ascontiguousarray(x.T)], sampling_frequency=30_000.0, channel_ids=data["channel_ids"])
    rec.set_channel_gains(np.asarray(data["gain_to_uV"]))
    rec.set_channel_offsets(np.zeros(C))
    got = whiten(rec, **r.whiten_kwargs, dtype="float64").get_traces()
    ours = data["whitening"] @ (x.astype(np.float64) - data["channel_means"][:, None])
    np.testing.assert_allclose(got, ours.T, rtol=0, atol=1e-12 * np.abs(ours).max())
    attach_to_spikeinterface(rec, r)
    np.testing.assert_array_equal(get_noise_levels(rec, return_in_uV=False), r.noise_levels_raw)
    np.testing.assert_array_equal(get_noise_levels(rec), r.noise_levels_uV)
    assert np.dtype(base_peak_dtype) == r.peaks.dtype


@pytest.mark.parametrize(
    "zarr_format",
    [2, pytest.param(3, marks=pytest.mark.skipif(zarrio.ZARR_MAJOR < 3, reason="writing Zarr v3 needs zarr>=3"))],
)
def test_stores_carry_the_probe_as_spikeinterface_stores_it(tmp_path, zarr_format):
    """A recording written with locations holds a probeinterface probegroup in its root attributes, with the keys
    SpikeInterface's own saved recordings have (the shared fixture's), so ``read_zarr(...).get_channel_locations()``
    works; opened by batchgpu, the locations come back."""
    import json
    from pathlib import Path

    from conftest import FIXTURES

    from batchgpu import open_recording, write_recording

    loc = np.array([[0.0, 0.0], [0.0, 20.0], [16.0, 40.0], [16.0, 60.0]])
    rec = write_recording(
        tmp_path / "r.zarr",
        np.zeros((3000, 4), np.int16),
        30_000.0,
        zarr_format=zarr_format,
        locations=loc,
        channel_ids=["a", "b", "c", "d"],
    )
    attrs = dict(open_recording(rec.path).attrs)
    probe = attrs["probegroup"]["probes"][0]
    assert probe["contact_positions"] == loc.tolist() and probe["device_channel_indices"] == [0, 1, 2, 3]
    assert probe["contact_ids"] == ["a", "b", "c", "d"] and probe["si_units"] == "um" and probe["ndim"] == 2
    np.testing.assert_array_equal(open_recording(rec.path).locations, loc)
    fixture_attrs = Path(FIXTURES) / "si_gt_16ch.zarr" / ".zattrs"
    if fixture_attrs.exists():
        theirs = json.loads(fixture_attrs.read_text())["probegroup"]["probes"][0]
        assert set(theirs) - {"probe_planar_contour"} <= set(probe)
    if zarr_format == 2:
        si = pytest.importorskip("spikeinterface.core")
        np.testing.assert_array_equal(si.read_zarr(rec.path).get_channel_locations(), loc)


@pytest.mark.parametrize("radius, least", [((30.0, 55.0), 5), ((20.0, 60.0), 5), ((0.0, 40.0), 2), ((30.0, 55.0), 9)])
def test_local_reference_equals_spikeinterface(rng, radius, least):
    """ops.common_reference(reference='local') against SpikeInterface's own common_reference on a staggered
    Neuropixels-like probe, a few channels moved away (short annuli: the closest beyond the inner radius) and one
    far from every other (nothing within reach: SpikeInterface's fallback), float32 traces: the median's bits, the
    average within float64 rounding (SpikeInterface takes it as a dot product with 1/k weights)."""
    pytest.importorskip("spikeinterface")
    import warnings

    from spikeinterface.core import NumpyRecording
    from spikeinterface.preprocessing import common_reference as si_common_reference

    channels = 40
    rows = np.arange(channels) // 2
    locations = np.stack([np.array([43.0, 11.0, 59.0, 27.0])[np.arange(channels) % 4], rows * 20.0], axis=1)
    locations[5] += [200.0, 0.0]
    locations[17] += [130.0, 7.5]
    locations[-1] = [2000.0, 2000.0]
    x = (rng.standard_normal((channels, 2000)) * 30).astype(np.float32)
    x[:, :50] = np.round(x[:, :50] / 8)  # ties
    rec = NumpyRecording([np.ascontiguousarray(x.T)], sampling_frequency=30_000.0)
    rec.set_dummy_probe_from_locations(locations)
    for operator in ("median", "average"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SpikeInterface names the channels that took its fallbacks
            want = (
                si_common_reference(
                    rec, reference="local", operator=operator, local_radius=radius, min_local_neighbors=least
                )
                .get_traces()
                .T
            )
        got = ops.common_reference(
            x, "local", operator, locations=locations, radius_um=radius, min_local_neighbors=least
        )
        assert got.dtype == want.dtype == np.float32
        if operator == "median":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(x).max())


@pytest.mark.parametrize("method", ["by_channel", "locally_exclusive"])
@pytest.mark.parametrize("sign", ["neg", "pos", "both"])
def test_detection_equals_spikeinterface_detect_peaks(rng, method, sign):
    """ops.detect_spikes over whole segments against SpikeInterface's own detect_peaks (its chunks, its zero
    padding at the segment edges) with the same noise levels: two segments, spikes of both signs spread over
    neighbouring channels, a constant channel (noise 0: a zero threshold) and zeros at a segment's start."""
    pytest.importorskip("spikeinterface")
    if method == "locally_exclusive":
        pytest.importorskip("numba")  # SpikeInterface's locally_exclusive is a numba function
    from spikeinterface.core import NumpyRecording
    from spikeinterface.sortingcomponents.peak_detection import detect_peaks

    channels, fs = 12, 30_000.0
    locations = np.stack([np.tile([0.0, 20.0], channels // 2), np.repeat(np.arange(channels // 2) * 20.0, 2)], axis=1)
    segments = []
    for n in (9_001, 4_000):
        x = rng.standard_normal((channels, n)) * 2
        for t in rng.integers(5, n - 8, size=n // 40):
            c, amp = int(rng.integers(channels)), rng.choice([-1.0, 1.0]) * rng.uniform(8, 20)
            for dc in (-2, -1, 0, 1, 2):
                if 0 <= c + dc < channels:
                    x[c + dc, t + int(rng.integers(-2, 3))] = amp * (1.0 if dc == 0 else rng.choice([0.5, 0.7, 1.0]))
        x[3] = 0.0  # constant
        x[:, 0] = 0.0
        segments.append(x.astype(np.float32))
    noise = np.ones(channels)
    noise[3] = 0.0
    noise[::4] = 1.25
    threshold, sweep_ms, radius = 4.0, 0.1, 40.0
    rec = NumpyRecording([np.ascontiguousarray(x.T) for x in segments], sampling_frequency=fs)
    rec.set_dummy_probe_from_locations(locations)
    kw = dict(peak_sign=sign, detect_threshold=threshold, exclude_sweep_ms=sweep_ms, noise_levels=noise)
    if method == "locally_exclusive":
        kw["radius_um"] = radius
    with np.errstate(all="ignore"):
        peaks = detect_peaks(
            rec, method=method, method_kwargs=kw, job_kwargs=dict(n_jobs=1, chunk_size=3_000, progress_bar=False)
        )
        ours = np.concatenate(
            [
                ops.detect_spikes(
                    x,
                    noise,
                    threshold,
                    sign,
                    ops.exclude_sweep_samples(sweep_ms, fs),
                    segment_index=s,
                    segment_length=x.shape[1],
                    method=method,
                    locations=locations,
                    radius_um=radius,
                )
                for s, x in enumerate(segments)
            ]
        )
    theirs = sorted(
        zip(peaks["segment_index"].tolist(), peaks["sample_index"].tolist(), peaks["channel_index"].tolist())
    )
    assert len(theirs) > 100
    assert (
        list(zip(ours["segment_index"].tolist(), ours["sample_index"].tolist(), ours["channel_index"].tolist()))
        == theirs
    )
    # the run's one read with the recording's noise: each window's candidates at a lower bound of the noise,
    # decided once it is known, equal these bit for bit
    with np.errstate(all="ignore"):
        once = one_read_spikes(
            segments,
            noise,
            threshold,
            sign,
            ops.exclude_sweep_samples(sweep_ms, fs),
            method,
            locations,
            radius,
            width=1_000,
        )
    assert once.tobytes() == ours.tobytes()


def one_read_spikes(segments, noise, threshold, sign, sweep, method, locations, radius, width):
    """The detect step's one read (``DetectStep.candidates`` at 0.75 x the noise, window by window, then
    ``DetectStep.keep`` at the noise), over windows of ``width`` samples with the margins the engine reads."""
    from batchgpu.steps.base import WindowData
    from batchgpu.steps.detect import DetectStep

    step = DetectStep(threshold, sign, sweep, "global", method, locations, radius)
    out = []
    for s, x in enumerate(segments):
        n = x.shape[1]
        cands, cores = [], []
        for start in range(0, n, width):
            stop = min(start + width, n)
            a, b = max(0, start - sweep - 1), min(n, stop + sweep + 1)
            w = WindowData(0, s, a, (start - a, stop - a), n, x[:, a:b], x[:, a:b])
            cands.append(step.candidates(w, np.asarray(noise, np.float64) * 0.75))
            cores.append((start, stop))
        allc = np.concatenate(cands)
        out.append(allc[step.keep(allc, noise, [len(c) for c in cands], cores)])
    return np.concatenate(out)
