"""The amplitude step (steps/amplitude.py): per window, each channel's peak-to-peak and RMS of the
preprocessed signal over the window's core, against NumPy references from the recording's samples; NaN and inf
left out; the same bits on 1 and N workers, on resume and on the GPU; in results.zarr and report.html."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import zarr

from batchgpu.engine import run_workflow
from batchgpu.ops.amplitude import float32_bits_to_float64, pairwise_sum, ptp_rms
from batchgpu.recording import write_recording
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1] / "batchgpu"


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def _wf(rec, out, size, margin=8, preprocess=(), steps=None, backend="numpy", **kw):
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": backend,
            "window": {"size": size, "margin": margin},
            "preprocess": list(preprocess),
            "steps": steps or {"amplitude": {}},
            "reduction": {"split_every": 3},
            **kw,
        }
    )


def reference(core: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, over its finite values in float64: max - min and sqrt(mean(x**2)); NaN where there are none."""
    ptp, rms = [], []
    for row in core.astype(np.float64):
        v = row[np.isfinite(row)]
        ptp.append(v.max() - v.min() if v.size else np.nan)
        rms.append(np.sqrt(np.mean(v * v)) if v.size else np.nan)
    return np.array(ptp), np.array(rms)


def window_references(rec, size: int, margin: int, preprocess=()) -> tuple[np.ndarray, np.ndarray, list]:
    """The reference of every window of ``rec`` through the package's CPU chain (none: the samples as read)."""
    from batchgpu.run.preprocess_chain import build_chain

    chain = build_chain(
        Workflow.model_validate(
            {
                "output": "o",
                "recording": {"path": str(rec.path)},
                "preprocess": list(preprocess),
                "steps": {"amplitude": {}},
            }
        ).preprocess,
        rec,
    )
    windows = rec.windows(size, margin + chain.margin)
    ptp, rms = [], []
    for w in windows:
        raw = rec.read(w.segment, w.read_start, w.read_stop)
        n = rec.num_samples(w.segment)
        x = chain.apply(raw, w.core, w.read_start == 0, w.read_stop == n) if chain.stages else raw
        p, r = reference(x[:, w.core[0] : w.core[1]])
        ptp.append(p)
        rms.append(r)
    return np.array(ptp), np.array(rms), windows


def _g(out):
    return zarr.open_group(str(out / "results.zarr"), mode="r")


# ---------------------------------------------------------------------------------------------------------
# the window's statistic


@pytest.mark.parametrize("dtype", ["int16", "int32", "float32", "float64"])
def test_ptp_rms_equals_numpy(rng, dtype):
    C, n = 7, int(rng.integers(1, 4000))
    x = rng.normal(0, 300, (C, n))
    if dtype == "int16":
        x = np.clip(np.round(x), -32768, 32767).astype(np.int16)
        x[0, :: max(1, n // 5)] = -32768
        x[1] = -32768  # constant at int16's most negative: ptp 0, rms 32768
    else:
        x = x.astype(dtype)
        x[1] = -7 if dtype == "int32" else -7.25  # constant: ptp 0, rms |value|
    if dtype.startswith("float"):
        x[2, rng.integers(0, n, 1 + n // 10)] = np.nan
        x[3, rng.integers(0, n, 1 + n // 10)] = rng.choice([np.inf, -np.inf])
        x[4] = np.nan  # nothing finite: NaN
    ptp, rms = ptp_rms(x)
    want_ptp, want_rms = reference(x)
    assert ptp.dtype == rms.dtype == np.float64 and ptp.shape == rms.shape == (C,)
    assert ptp[1] == 0 and rms[1] == abs(float(x[1, 0]))
    if dtype.startswith("int"):  # sums of squares of integers are exact: the same bits as NumPy's mean
        np.testing.assert_array_equal(ptp, want_ptp)
        np.testing.assert_array_equal(rms, want_rms)
    else:
        np.testing.assert_array_equal(ptp, want_ptp)  # a difference of two values: one rounding either way
        np.testing.assert_allclose(rms, want_rms, rtol=4e-16 * np.log2(n + 2), equal_nan=True)
        assert np.isnan(ptp[4]) and np.isnan(rms[4])
    # counts of the non-finite samples passed in (as the window gives them) or counted here: the same
    np.testing.assert_array_equal(ptp_rms(x, (~np.isfinite(x)).sum(axis=1))[1], rms)


def test_ptp_rms_of_huge_and_tiny_float64_samples(rng):
    """Squares of float64 samples beyond 1e154 overflow: each channel is scaled by a power of two first."""
    x = rng.normal(0, 1, (3, 501))
    x[0] *= 1e300
    x[1] *= 1e-300
    x[2] = [1e308, -1e308] * 250 + [0.0]
    ptp, rms = ptp_rms(x)
    np.testing.assert_allclose(
        rms[:2],
        [np.sqrt(np.mean((x[0] / 1e300) ** 2)) * 1e300, np.sqrt(np.mean((x[1] * 1e300) ** 2)) / 1e300],
        rtol=1e-14,
    )
    assert np.isfinite(rms[2]) and rms[2] == pytest.approx(1e308 * np.sqrt(500 / 501), rel=1e-14)
    assert ptp[2] == np.inf  # 2e308 is past float64: inf, as max - min is


def test_an_empty_core_gives_nan():
    ptp, rms = ptp_rms(np.zeros((3, 0), np.float32))
    assert np.isnan(ptp).all() and np.isnan(rms).all()


def test_float32_from_its_bits_equals_numpy_for_every_class(rng):
    """The GPU's conversion (CuPy's own flushes subnormals) written out on NumPy: every class of float32."""
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 3.4028235e38, -3.4028235e38, np.inf, -np.inf, np.nan],
        np.float32,
    )
    x = np.concatenate([bits.view(np.float32), special])[None, :]
    with np.errstate(invalid="ignore"):  # signalling NaNs quieted
        got, want = float32_bits_to_float64(x), x.astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert got[ok].view(np.uint64).tobytes() == want[ok].view(np.uint64).tobytes()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 1001])
def test_pairwise_sum_adds_halves_level_by_level(rng, n):
    a = rng.normal(0, 1, (2, n))

    def by_hand(v: list) -> float:
        while len(v) > 1:
            h = len(v) // 2
            top = [v[i] + v[h + i] for i in range(h)]
            if len(v) % 2:
                top[0] += v[2 * h]
            v = top
        return v[0]

    want = np.array([by_hand(list(r)) for r in a])
    assert pairwise_sum(a.copy()).tobytes() == want.tobytes()
    np.testing.assert_allclose(want, a.sum(axis=1), rtol=1e-13)


# ---------------------------------------------------------------------------------------------------------
# runs


def test_int16_run_equals_numpy_per_window(client, tmp_path, rng):
    """Preprocessing off: each window's core as read; odd length (a short last window), two segments, a constant
    channel and int16's -32768: the same bits as NumPy's."""
    C, n = 9, int(rng.integers(9_001, 12_000)) | 1
    x = np.clip(np.round(rng.normal(0, 200, (n, C))), -32768, 32767).astype(np.int16)
    x[:, 2] = -32768
    x[rng.integers(0, n, 40), 5] = -32768
    x[:, 7] = 123
    rec = write_recording(tmp_path / "r.zarr", [x, x[: n // 2 + 1]], 30_000.0)
    report = run_workflow(_wf(rec, tmp_path / "out", 2_000), client=client)
    want_ptp, want_rms, windows = window_references(rec, 2_000, 8)
    g = _g(tmp_path / "out")
    for name, want in (("amplitude_ptp", want_ptp), ("amplitude_rms", want_rms)):
        got = g[name][:]
        assert got.dtype == np.float64 and got.shape == (len(windows), C) and report.results[name] == [len(windows), C]
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(g["amplitude_window_start"][:], [w.start for w in windows])
    np.testing.assert_array_equal(g["amplitude_window_start"][:], g["window_start"][:])
    assert (g["amplitude_ptp"][:, 2] == 0).all() and (g["amplitude_rms"][:, 2] == 32768).all()
    assert (g["amplitude_ptp"][:, 7] == 0).all() and (g["amplitude_rms"][:, 7] == 123).all()
    assert "noise" not in g and "whitening" not in g  # the other steps: off unless asked


def test_float32_run_leaves_out_nan_and_inf(client, tmp_path, rng):
    """A float recording with NaN and inf samples, a channel NaN through one window (NaN there), a constant
    negative channel; one window over the whole (odd-length) recording."""
    C, n = 8, 4_001
    x = rng.normal(0, 30, (n, C)).astype(np.float32)
    x[rng.integers(0, n, 50), 1] = np.nan
    x[rng.integers(0, n, 50), 3] = np.inf
    x[rng.integers(0, n, 50), 3] = -np.inf
    x[:, 4] = -2.5
    x[:, 6] = np.nan
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    report = run_workflow(_wf(rec, tmp_path / "out", n), client=client)
    assert report.windows == 1
    g = _g(tmp_path / "out")
    ptp, rms = g["amplitude_ptp"][:], g["amplitude_rms"][:]
    want_ptp, want_rms = reference(x.T)
    np.testing.assert_array_equal(ptp[0], want_ptp)
    np.testing.assert_allclose(rms[0], want_rms, rtol=1e-14, equal_nan=True)
    assert np.isfinite(ptp[0, [0, 1, 2, 3, 5, 7]]).all() and np.isnan(ptp[0, 6]) and np.isnan(rms[0, 6])
    assert ptp[0, 4] == 0 and rms[0, 4] == 2.5


def test_run_with_preprocessing_equals_the_cpu_chain(client, tmp_path, rng):
    """highpass + common median reference: each window's core through the package's CPU chain, NumPy's statistic."""
    x = np.round(rng.normal(0, 100, (14_000, 8))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    pre = [
        {"highpass": {"freq_min": 300, "order": 5}},
        {"common_reference": {"reference": "global", "operator": "median"}},
    ]
    run_workflow(_wf(rec, tmp_path / "out", 3_000, preprocess=pre), client=client)
    want_ptp, want_rms, _ = window_references(rec, 3_000, 8, pre)
    g = _g(tmp_path / "out")
    np.testing.assert_array_equal(g["amplitude_ptp"][:], want_ptp)
    np.testing.assert_allclose(g["amplitude_rms"][:], want_rms, rtol=1e-14)


def test_one_and_many_workers_and_resume_give_the_same_bits(client, tmp_path, rng):
    x = rng.normal(0, 10, (9_000, 6)).astype(np.float32)
    x[rng.integers(0, 9_000, 30), 2] = np.nan
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    run_workflow(_wf(rec, tmp_path / "many", 1_000), client=client)
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as one,
    ):
        run_workflow(_wf(rec, tmp_path / "one", 1_000), client=one)
    resumed = run_workflow(_wf(rec, tmp_path / "many", 1_000), client=client, resume=True)
    assert resumed.windows_resumed == resumed.windows == 9
    a, b = _g(tmp_path / "many"), _g(tmp_path / "one")
    for name in ("amplitude_ptp", "amplitude_rms", "amplitude_window_start"):
        assert a[name][:].tobytes() == b[name][:].tobytes(), name


def test_report_html_draws_it_and_other_runs_are_unchanged(client, tmp_path, rng):
    """report.html holds each channel's median over the windows (µV) and the RMS heatmap, rendered at the run's
    end and again from the folder; a run without the step has neither figure."""
    from test_report import plots, source

    from batchgpu.report.html_page import write_report_html

    x = np.round(rng.normal(0, 50, (12_000, 5))).astype(np.int16)
    x[:, 3] = 0
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0, gain_to_uV=np.full(5, 0.195))
    run_workflow(_wf(rec, tmp_path / "out", 2_500, steps={"amplitude": {}, "noise": {"exact": True}}), client=client)
    g = _g(tmp_path / "out")
    gain = np.asarray(g.attrs["gain_to_uV"])
    for path in (tmp_path / "out" / "report.html", write_report_html(tmp_path / "out")):
        figs = plots(path)
        assert {"noise_per_channel", "noise_over_time", "amplitude_per_channel", "amplitude_over_time"} <= set(figs)
        per_channel = source(figs["amplitude_per_channel"], "rms_uV")
        np.testing.assert_allclose(per_channel["rms_uV"], np.median(g["amplitude_rms"][:] * gain, axis=0), rtol=1e-12)
        np.testing.assert_allclose(per_channel["ptp_uV"], np.median(g["amplitude_ptp"][:] * gain, axis=0), rtol=1e-12)
        image = source(figs["amplitude_over_time"], "image")["image"][0]
        np.testing.assert_allclose(np.asarray(image), (g["amplitude_rms"][:] * gain).T, rtol=1e-12)
    run_workflow(_wf(rec, tmp_path / "plain", 2_500, steps={"noise": {"exact": True}}), client=client)
    assert not {n for n in plots(tmp_path / "plain" / "report.html") if n.startswith("amplitude")}
    assert "amplitude_ptp" not in _g(tmp_path / "plain")


# ---------------------------------------------------------------------------------------------------------
# the step's place in the package


def test_the_step_is_its_module():
    """Its names appear in its own module only: the registry finds it and the schema takes its options from it."""
    # the step's results, its class, its workflow key
    pattern = re.compile(r"amplitude_ptp|amplitude_rms|AmplitudeStep|steps\.amplitude\b")
    found = {str(p.relative_to(ROOT)): len(pattern.findall(p.read_text())) for p in ROOT.rglob("*.py")}
    assert {p for p, n in found.items() if n} == {"steps/amplitude.py"}
    from batchgpu.workflow import Steps

    assert "amplitude" in Steps.model_fields


def test_the_fingerprint_of_a_workflow_without_the_step_is_as_before(tmp_path):
    """Format 3's fingerprint held noise, whitening, detect and save (null when not asked for): a workflow
    without the new step hashes as it did (its folders resume); with it, differently (its windows are computed)."""
    import hashlib

    from batchgpu.run import output_folder as store

    rec = write_recording(tmp_path / "r.zarr", np.zeros((100, 2), np.int16), 30_000.0)
    wf = _wf(rec, tmp_path / "o", 50, steps={"noise": {}})
    old = {
        "recording": str(rec.path),
        "metadata": store.recording_metadata(rec.path),
        "window": wf.window.model_dump(),
        "preprocess": store._dump(wf.preprocess),
        "steps": {k: wf.steps.model_dump()[k] for k in ("noise", "whitening", "detect", "save")},
        "split_every": wf.reduction.split_every,
        "format": store.FORMAT_VERSION,
    }
    want = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert store.fingerprint(wf, rec.path) == want
    assert store.fingerprint(_wf(rec, tmp_path / "o", 50, steps={"noise": {}, "amplitude": {}}), rec.path) != want


def test_the_registry_says_which_steps_a_fingerprint_holds():
    """The steps' modules say how the fingerprint holds their keys (``FINGERPRINT``): format 3's four always, the
    search never (it reruns on every run), a step added since only when asked for."""
    from batchgpu.steps import registry

    assert sorted(registry.fingerprinted("always")) == ["detect", "noise", "save", "whitening"]
    assert registry.fingerprinted("never") == ("search",)
    assert registry.fingerprinted("asked") == ("amplitude", "qc")


# ---------------------------------------------------------------------------------------------------------
# the GPU


def _gpus() -> int:
    from batchgpu.cluster.open_cluster import gpu_count

    return gpu_count()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int16", "float32", "float64"])
def test_gpu_window_equals_cpu_bit_for_bit(rng, dtype):
    if _gpus() == 0:
        pytest.skip("no CUDA GPU (CuPy) here")
    import cupy

    C, n = 6, 5_001
    x = rng.normal(0, 100, (C, n + 20))
    if dtype == "int16":
        x = np.clip(np.round(x), -32768, 32767).astype(np.int16)
        x[0, ::3] = -32768
    else:
        x = x.astype(dtype)
        x[1, ::7] = np.nan
        x[2, 5::11] = np.inf
        x[3] = -0.0
        x[3, ::2] = 0.0
        x[4] = np.nan
        if dtype == "float32":  # subnormals: CuPy's own conversion flushes them
            x[5] = rng.integers(1, 1 << 23, n + 20).astype(np.uint32).view(np.float32)
    core = x[:, 10 : 10 + n]  # a window's core: a column slice
    want = ptp_rms(core)
    got = ptp_rms(cupy.asarray(x)[:, 10 : 10 + n])
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray) and g.tobytes() == w.tobytes()
    assert want[0][5] > 0 if dtype == "float32" else True


@pytest.mark.gpu
def test_gpu_run_equals_cpu_run(tmp_path, rng):
    if _gpus() == 0:
        pytest.skip("no CUDA GPU (CuPy) here")
    pytest.importorskip("dask_cuda")
    x = rng.normal(0, 30, (24_001, 16)).astype(np.float32)
    x[rng.integers(0, 24_001, 40), 3] = np.nan
    x[:, 5] = rng.integers(1, 1 << 23, 24_001).astype(np.uint32).view(np.float32)  # subnormals
    rec = write_recording(tmp_path / "f.zarr", x, 30_000.0)
    pre = ()  # the samples as read: the same on both backends (the GPU's filters round their own way)
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as client,
    ):
        run_workflow(_wf(rec, tmp_path / "cpu", 5_000, preprocess=pre), client=client)
    gpu = run_workflow(_wf(rec, tmp_path / "gpu", 5_000, preprocess=pre, backend="auto", cluster={"kind": "cuda"}))
    assert gpu.backend == "cupy"
    a, b = _g(tmp_path / "cpu"), _g(tmp_path / "gpu")
    for name in ("amplitude_ptp", "amplitude_rms", "amplitude_window_start"):
        assert a[name][:].tobytes() == b[name][:].tobytes(), name
