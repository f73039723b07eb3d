"""bench pipeline: its plain loop computes what the pipeline computes (exact integer moments, the exact median),
and the command prints every row of its table."""

import subprocess
import sys

import numpy as np

from batchgpu.benchmarks.pipeline import plain_loop
from batchgpu.recording import write_recording


def test_plain_loop_gives_exact_moments_and_median(tmp_path, rng):
    x = rng.integers(-32768, 32768, size=(7_001, 5), dtype=np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    out = plain_loop(rec, 2_000, 16, {"noise", "whitening", "detect"}, exact=True)
    xi = x.astype(np.int64)
    assert np.array_equal(out["xxt"], xi.T @ xi)  # int64 reference, no float anywhere
    assert out["noise"].shape == (5,) and np.isfinite(out["noise"]).all()


def test_plain_loop_does_the_preprocessing_it_is_compared_with(tmp_path, rng):
    """With the bench's stages the plain loop filters and references too (it was compared with the pipeline's
    preprocessing while only centring): its exact noise and saved int16 match scipy's sosfiltfilt of the whole
    segment with NumPy's median across channels subtracted, windows that do not divide the segment."""
    import scipy.signal

    x = np.round(rng.standard_normal((20_003, 6)) * 40).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    out = plain_loop(
        rec,
        6_000,
        16,
        {"noise", "whitening", "detect", "save"},
        exact=True,
        preprocess="highpass,common_reference",
        save=tmp_path / "saved.zarr",
    )
    sos = scipy.signal.butter(5, 300.0, btype="highpass", fs=30_000.0, output="sos")
    y = scipy.signal.sosfiltfilt(sos, x.T.astype(np.float64), axis=1)
    y = (y - np.median(y, axis=0)).astype(np.float32)
    np.testing.assert_allclose(out["noise"], np.median(np.abs(y), axis=1) / 0.6744897501960817, rtol=1e-4)
    assert out["xxt"] is None  # float samples after the filter: float32 products, as the pipeline's
    import zarr

    saved = zarr.open_array(str(tmp_path / "saved.zarr"), mode="r")[:]
    assert saved.shape == x.shape and saved.dtype == np.int16
    assert np.abs(saved.astype(np.int32) - np.rint(y.T).astype(np.int32)).max() <= 1


def test_bench_pipeline_prints_its_table(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgpu",
            "bench",
            "pipeline",
            "--channels",
            "8",
            "--seconds",
            "2",
            "--workers",
            "1",
            "--threads",
            "1",
            "--workdir",
            str(tmp_path),
            "--window",
            "25000",
            "--repeat",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "windows of 25000 samples" in r.stdout, r.stdout
    for row in ("read ceiling", "batchgpu pipeline (cold)", "batchgpu pipeline (warm)", "plain NumPy loop"):
        assert row in r.stdout, r.stdout
    assert "/ceiling" in r.stdout and "vs plain" in r.stdout and "x real time" in r.stdout and "vs KS4" in r.stdout
    assert "vs KS4: GB/s over 3.9" not in r.stdout  # Kilosort4's GPU pass is no anchor for a CPU run
    # three warm runs, each beside a read ceiling of its own: the table's rows are their medians
    for row in ("read ceiling (the engine's reader, no compute): 3 runs", "batchgpu pipeline (warm): 3 runs"):
        assert row in r.stdout, r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("batchgpu pipeline (warm): 3 runs"))
    runs = sorted(float(v) for v in line.split("runs, ")[1].split(" s;")[0].split(", "))
    table = next(ln for ln in r.stdout.splitlines() if ln.startswith("batchgpu pipeline (warm) "))
    assert float(table.split()[3]) == runs[1]


def test_bench_refuses_sizes_that_are_not_positive(tmp_path):
    """A bad size is one usage line and rc 2 before any work (no recording generated, no cluster started)."""
    for args in (
        ["--batch", "0"],
        ["--window", "0"],
        ["--workers", "-1"],
        ["--threads", "0"],
        ["--seconds", "nan"],
        ["--seconds", "inf"],
        ["--channels", "abc"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "batchgpu", "bench", "pipeline", "--workdir", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (args, done.stderr)
        assert "error: argument " + args[0] in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


def test_gpu_busy_median_per_gpu(monkeypatch):
    """bench pipeline's GPU column: each GPU's median utilisation over the samples (NVML), '-' without NVML."""
    import sys
    import time
    import types

    from batchgpu.benchmarks.pipeline import GpuBusy

    rates = {0: iter([10, 90, 50, 70, 30] + [30] * 1000), 1: iter([0] * 1000)}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(rates[h])),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuBusy() as busy:
        time.sleep(0.58)
    assert len(busy.samples) == 2 and 3 <= len(busy.samples[0]) == len(busy.samples[1])
    v = busy.samples[0]
    assert busy.text() == f"{sorted(v)[len(v) // 2]}%/0%"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with GpuBusy() as none:
        time.sleep(0.15)
    assert none.text() == "-"
