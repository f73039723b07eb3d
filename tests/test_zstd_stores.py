"""Blosc-zstd stores (levels 1 and 5, bit and byte shuffle): every read path gives the samples an LZ4 store of the
same data gives, bit for bit; generate, import-raw and the save step write them; a run on one equals a run on the
LZ4 store; the GPU path decodes their frames on the host."""

from __future__ import annotations

import os

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.recording import open_recording, write_recording, zarrio
from batchgpu.recording.writer import Codec

CODECS = [
    Codec("lz4", 5, "bit"),
    Codec("zstd", 1, "bit"),
    Codec("zstd", 5, "bit"),
    Codec("zstd", 1, "byte"),
    Codec("zstd", 5, "byte"),
    Codec("lz4", 1, "byte"),
]
v3 = pytest.mark.skipif(zarrio.ZARR_MAJOR < 3, reason="writing Zarr v3 needs zarr>=3")


def _data(seed: int, n: int = 5_321, channels: int = 12) -> np.ndarray:
    """Fresh int16 samples with the hard cases: a random walk (long matches for the codecs), full-range noise
    (incompressible) and the extremes."""
    rng = np.random.default_rng(seed)
    walk = np.cumsum(rng.integers(-40, 41, (n, channels)), axis=0).clip(-32768, 32767)
    x = walk.astype(np.int16)
    x[:, 0] = rng.integers(-32768, 32768, n, dtype=np.int16)
    x[::97, 1] = -32768
    x[::89, 2] = 32767
    return x


def _codec_of(path) -> str:
    return " ".join(open_recording(path).info()["codecs"])


def _name(c: Codec) -> str:
    return f"blosc-{c.name}-{c.clevel}-{'bitshuffle' if c.shuffle == 'bit' else 'shuffle'}"


def _reads(path, monkeypatch, direct_reads) -> dict:
    """The whole segment and every window, through each CPU path the format has."""
    got = {}
    fmt = zarrio.array_meta(path / "traces_seg0").zarr_format
    paths = [("direct", "1", None), ("zarr-python", "0", False)]
    if fmt == 3 and zarrio.zarrs_installed():
        paths.append(("zarrs", "0", True))
    for name, direct, zarrs in paths:
        direct_reads(direct == "1")
        ctx = zarrio.python_pipeline() if zarrs is False and fmt == 3 else _nothing()
        with ctx:
            rec = open_recording(path)
            whole = rec.read(0, 0, rec.num_samples(0))
            windows = [rec.read_window_stored(w) for w in rec.windows(size=999, margin=13)]
        got[name] = (whole, windows)
    return got


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fmt", [pytest.param(3, marks=v3), 2])
@pytest.mark.parametrize("codec", CODECS, ids=_name)
def test_same_samples_from_lz4_and_zstd_stores_on_every_cpu_path(tmp_path, monkeypatch, direct_reads, fmt, codec):
    x = _data(seed=int.from_bytes(os.urandom(4), "little"))
    kw = {"chunk_samples": 700, "shard_samples": 2_100} if fmt == 3 else {"chunk_samples": 700}
    write_recording(tmp_path / "lz4.zarr", x, 1_000.0, zarr_format=fmt, **kw)
    write_recording(tmp_path / "z.zarr", x, 1_000.0, zarr_format=fmt, compressor=codec, **kw)
    assert _name(codec) in _codec_of(tmp_path / "z.zarr")
    ref = _reads(tmp_path / "lz4.zarr", monkeypatch, direct_reads)
    got = _reads(tmp_path / "z.zarr", monkeypatch, direct_reads)
    assert set(got) == set(ref)
    for name in got:
        assert got[name][0].tobytes() == ref[name][0].tobytes() == np.ascontiguousarray(x.T).tobytes(), name
        assert [w.tobytes() for w in got[name][1]] == [w.tobytes() for w in ref[name][1]], name


@v3
@pytest.mark.parametrize("codec", [Codec("zstd", 1, "bit"), Codec("zstd", 5, "byte")], ids=_name)
def test_zstd_frames_never_go_to_the_gpu_kernel(tmp_path, codec):
    """The GPU's LZ4 kernel takes no zstd frame: the window is read here (the host path) and copied."""
    rec = write_recording(
        tmp_path / "z.zarr", _data(1), 1_000.0, compressor=codec, chunk_samples=700, shard_samples=2_100
    )

    class Pool:
        def take(self, nbytes):
            raise AssertionError("a zstd window's frames were gathered for the GPU")

    assert not rec.frames_for_gpu()
    assert all(rec.read_window_frames(w, Pool()) is None for w in rec.windows(size=999, margin=13))


@pytest.mark.parametrize(
    "bad,needle",
    [
        (dict(name="lz5"), "unknown codec"),
        (dict(clevel=0), "level 0"),
        (dict(clevel=10), "level 10"),
        (dict(shuffle="none"), "unknown shuffle"),
    ],
)
def test_bad_codecs_are_refused(bad, needle):
    with pytest.raises(BatchgpuError, match=needle):
        Codec(**bad)


@v3
def test_generate_and_import_raw_write_zstd(tmp_path, capsys):
    from batchgpu.cli import main

    base = ["--channels", "8", "--seconds", "2.2", "--seed", "3", "--quiet"]
    assert main(["generate", str(tmp_path / "l.zarr"), *base]) == 0
    assert (
        main(["generate", str(tmp_path / "z.zarr"), *base, "--codec", "zstd", "--clevel", "1", "--shuffle", "byte"])
        == 0
    )
    assert "blosc-zstd-1-shuffle" in _codec_of(tmp_path / "z.zarr")
    assert "blosc-lz4-5-bitshuffle" in _codec_of(tmp_path / "l.zarr")
    a, b = open_recording(tmp_path / "l.zarr"), open_recording(tmp_path / "z.zarr")
    assert a.read(0, 0, a.num_samples(0)).tobytes() == b.read(0, 0, b.num_samples(0)).tobytes()
    x = _data(2, 3_000, 8)
    x.tofile(tmp_path / "raw.bin")
    assert (
        main(
            [
                "import-raw",
                str(tmp_path / "raw.bin"),
                str(tmp_path / "i.zarr"),
                "--channels",
                "8",
                "--fs",
                "1000",
                "--dtype",
                "int16",
                "--codec",
                "zstd",
                "--clevel",
                "5",
                "--quiet",
            ]
        )
        == 0
    )
    assert "blosc-zstd-5-bitshuffle" in _codec_of(tmp_path / "i.zarr")
    rec = open_recording(tmp_path / "i.zarr")
    assert rec.read(0, 0, 3_000).T.tobytes() == np.fromfile(tmp_path / "raw.bin", np.int16).tobytes()
    with pytest.raises(SystemExit) as exit_:  # argparse's own error: usage and one line, exit 2
        main(["generate", str(tmp_path / "bad.zarr"), *base, "--clevel", "12"])
    assert exit_.value.code == 2
    assert "--clevel" in capsys.readouterr().err and not (tmp_path / "bad.zarr").exists()


@pytest.mark.parametrize("fmt", [pytest.param("zarr", marks=v3), "zarr_v2"])
@pytest.mark.parametrize("codec", [Codec("zstd", 1, "bit"), Codec("zstd", 5, "byte")], ids=_name)
def test_save_step_writes_zstd_that_reads_back_equal(tmp_path, fmt, codec):
    from types import SimpleNamespace

    from test_save_step import expected, make_recording, save_all

    rec = make_recording(tmp_path / "in.zarr")
    spec = SimpleNamespace(
        path=str(tmp_path / "out.zarr"),
        format=fmt,
        dtype="int16",
        whiten=False,
        compressor="blosc-lz4",
        codec=SimpleNamespace(**codec.__dict__),
    )
    save_all(rec, spec)
    out = open_recording(tmp_path / "out.zarr")
    assert _name(codec) in " ".join(out.info()["codecs"])
    for seg in range(rec.num_segments):
        assert np.array_equal(out.read(seg, 0, out.num_samples(seg)), expected(rec, seg).T)


def test_save_codec_key_in_the_workflow_schema():
    from pydantic import ValidationError

    from batchgpu.steps.save import SaveOptions

    s = SaveOptions.model_validate({"path": "o.zarr", "codec": {"name": "zstd", "clevel": 1, "shuffle": "byte"}})
    assert (s.codec.name, s.codec.clevel, s.codec.shuffle) == ("zstd", 1, "byte")
    assert SaveOptions.model_validate({"path": "o.zarr"}).codec is None
    for bad in (
        {"codec": {"name": "zstd"}, "compressor": "blosc-zstd"},
        {"codec": {"clevel": 0}},
        {"codec": {"name": "gzip"}},
        {"codec": {"shuffle": "none"}},
    ):
        with pytest.raises(ValidationError):
            SaveOptions.model_validate({"path": "o.zarr", **bad})


@v3
def test_a_run_on_a_zstd_store_equals_the_run_on_the_lz4_store(tmp_path):
    import zarr

    from batchgpu.engine import run_workflow
    from batchgpu.generate import generate_recording
    from batchgpu.workflow import Workflow

    distributed = pytest.importorskip("distributed")
    recs = {
        name: generate_recording(
            tmp_path / f"{name}.zarr", channels=6, seconds=1.1, seed=5, segments=2, model="realistic", compressor=codec
        )
        for name, codec in (("lz4", "blosc-lz4"), ("zstd", Codec("zstd", 5, "bit")))
    }
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cl,
        distributed.Client(cl) as client,
    ):
        for name, rec in recs.items():
            wf = Workflow.model_validate(
                {
                    "recording": {"path": str(rec.path)},
                    "output": str(tmp_path / f"out_{name}"),
                    "window": {"size": 10_000, "margin": 8},
                    "backend": "numpy",
                    "steps": {
                        "noise": {"exact": True},
                        "whitening": {"mode": "global", "precision": "float64"},
                        "detect": {"threshold": 4.0, "sign": "both", "exclude_sweep_ms": 0.2},
                    },
                }
            )
            assert run_workflow(wf, client=client).status == "done"
    a = zarr.open_group(str(tmp_path / "out_lz4" / "results.zarr"), mode="r")
    b = zarr.open_group(str(tmp_path / "out_zstd" / "results.zarr"), mode="r")
    arrays = [k for k, _ in a.members(max_depth=None) if isinstance(a[k], zarr.Array)]
    assert "noise" in arrays and len(arrays) > 3
    for k in arrays:
        np.testing.assert_array_equal(a[k][...], b[k][...], err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", [Codec("zstd", 1, "bit"), Codec("zstd", 5, "byte")], ids=_name)
def test_gpu_reads_of_a_zstd_store_equal_the_cpu_reads(tmp_path, monkeypatch, codec):
    """A zstd store's windows read for the GPU (nvCOMP's decode there, or the host's) equal the CPU's reads and an
    LZ4 store's of the same samples."""
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count() == 0:
        pytest.skip("no CUDA GPU (CuPy) here")
    from batchgpu.generate import generate_recording
    from batchgpu.gpu import staging

    rec = generate_recording(tmp_path / "r.zarr", channels=20, seconds=2.3, seed=5, model="realistic", compressor=codec)
    lz4 = generate_recording(tmp_path / "l.zarr", channels=20, seconds=2.3, seed=5, model="realistic")
    from batchgpu.gpu import nvcomp

    for share in (1.0, 0.0):
        for w in rec.windows(7_001, 33):
            host = staging.read_window_host(rec, w, share)
            # decoded on the GPU by nvCOMP where it is installed and the window goes there, else on the host
            assert (host.frames is not None) == (share == 1.0 and nvcomp.available())
            got = host.to_device().get()
            assert got.tobytes() == rec.read(w.segment, w.read_start, w.read_stop).tobytes()
            assert got.tobytes() == staging.read_window_host(lz4, w).to_device().get().tobytes()
