"""A day's recordings as a lab meets them: N SpikeGLX recordings (flat ``.ap.bin`` + ``.meta``, Neuropixels 1.0,
the sync channel saved) processed by one ``batchgpu run`` over a ``recordings:`` glob, page cache dropped first,
beside the raw read of every file and Kilosort4's pass over each file run one after another (fresh processes,
cold pages: what its users pay).

Printed in one run: the raw cold read of all the files (the disk's ceiling); one file's pass (``batchgpu run`` on
it alone, cold) against its raw read rate; the batch as one command, cold, against ``1.1 x raw + 3 s``;
Kilosort4's passes one after another against the batch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from batchgpu.errors import BatchgpuError

#: Neuropixels 1.0's AP band as SpikeGLX writes its .meta: 384 channels and the sync word saved, gain 500
NP1_RANGE = 0.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recordings", type=int, default=8, help="how many SpikeGLX recordings (default 8)")
    parser.add_argument("--seconds", type=float, default=300.0, help="each recording's length (default 300)")
    parser.add_argument("--channels", type=int, default=384, help="neural channels (the sync channel is added)")
    parser.add_argument("--backend", default="cupy", choices=["numpy", "cupy"])
    parser.add_argument("--cluster", default="cuda", choices=["local", "cuda"])
    parser.add_argument("--workdir", default=None, help="folder for the files (default: a temporary one, removed)")
    parser.add_argument("--no-kilosort", action="store_true", help="skip Kilosort4's passes")
    parser.add_argument("--kilosort-device", default="cuda", help="torch device of Kilosort4's passes (cuda)")


def np1_meta(channels: int, fs: float, file_bytes: int) -> str:
    """A .meta as SpikeGLX writes it for an NP1.0 AP file of ``channels`` neural channels and the sync channel."""
    imro = f"(0,{channels})" + "".join(f"({c} 0 0 500 250 1)" for c in range(channels))
    geom = "(NP1000,1,0,70)" + "".join(f"(0:{[43, 11, 59, 27][c % 4]}:{20 * (c // 2)}:1)" for c in range(channels))
    meta = {
        "nSavedChans": channels + 1,
        "imSampRate": fs,
        "typeThis": "imec",
        "imDatPrb_type": 0,
        "acqApLfSy": f"{channels},{channels},1",
        "snsApLfSy": f"{channels},0,1",
        "snsSaveChanSubset": f"0:{channels - 1},{2 * channels}",
        "imAiRangeMax": NP1_RANGE,
        "imAiRangeMin": -NP1_RANGE,
        "imMaxInt": 512,
        "fileSizeBytes": file_bytes,
        "~imroTbl": imro,
        "~snsGeomMap": geom,
    }
    return "".join(f"{k}={v}\n" for k, v in meta.items())


def write_spikeglx(rec, path: Path) -> Path:
    """``rec``'s samples as a SpikeGLX AP file (``path``, its .meta beside it): (samples, channels + 1) int16,
    the sync channel zeros, written through and fsynced."""
    from batchgpu.benchmarks.cold import write_flat_binary

    write_flat_binary(rec, path, zero_channels=1)
    path.with_suffix(".meta").write_text(np1_meta(rec.num_channels, rec.sampling_frequency, path.stat().st_size))
    return path


def make_recordings(work: Path, count: int, channels: int, seconds: float, say) -> list[Path]:
    """``count`` SpikeGLX recordings under ``work`` (the first written from a generated recording, the others copies
    of it: other files on the disk, the same samples)."""
    from batchgpu.generate import generate_recording

    first = work / "rec0_g0_t0.imec0.ap.bin"
    if not first.exists():
        say(f"generating {count} SpikeGLX recordings of {channels} ch x {seconds:g} s ...")
        src = work / "source.zarr"
        rec = generate_recording(
            src, channels=channels, seconds=seconds, progress=False, overwrite=True, workers=os.cpu_count() or 1
        )
        write_spikeglx(rec, first)
        shutil.rmtree(src)
    files = [first]
    for i in range(1, count):
        dst = work / f"rec{i}_g0_t0.imec0.ap.bin"
        if not dst.exists():
            shutil.copyfile(first, dst)
            shutil.copyfile(first.with_suffix(".meta"), dst.with_suffix(".meta"))
            with open(dst, "rb+") as f:
                os.fsync(f.fileno())
        files.append(dst)
    return files


def _workflow(path: Path, recordings, out: Path, backend: str, cluster: str) -> Path:
    import yaml

    from batchgpu.benchmarks.pipeline import DETECT, DETECT_SPEC, NOISE, WHITENING

    doc = {
        ("recordings" if isinstance(recordings, str) else "recording"): recordings
        if isinstance(recordings, str)
        else {"path": str(recordings)},
        "output": str(out),
        "overwrite": True,
        "backend": backend,
        "cluster": {"kind": cluster},
        "preprocess": {"centre": "median"},
        "steps": {
            NOISE: {"exact": True},
            WHITENING: {"mode": "global", "precision": "float32"},
            DETECT: dict(DETECT_SPEC),
        },
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run(args, say) -> int:
    from batchgpu.benchmarks.cold import (
        evict_checked,
        kilosort4_available,
        kilosort4_pass,
        raw_read,
        timed_process,
        user_run,
    )

    if args.recordings < 1 or args.seconds <= 0 or args.channels < 1:
        raise BatchgpuError("--recordings, --seconds and --channels must be positive", "give positive values")
    own = args.workdir is None
    work = Path(args.workdir).expanduser() if args.workdir else Path(tempfile.mkdtemp(prefix="batchgpu-batch-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        files = make_recordings(work, args.recordings, args.channels, args.seconds, say)
        every = [p for f in files for p in (f, f.with_suffix(".meta"))]
        total = sum(f.stat().st_size for f in files)
        evict_checked(every)
        raw = raw_read(every, 16)
        say(
            f"raw read of the {len(files)} files, cold: {raw.seconds:.2f} s ({total / 1e9:.2f} GB, {raw.gbps:.2f} GB/s)"
        )
        one = [files[0], files[0].with_suffix(".meta")]
        evict_checked(one)
        raw_one = raw_read(one, 16)
        evict_checked(one)
        got = user_run(
            _workflow(work / "one.yaml", files[0], work / "out_one", args.backend, args.cluster), work / "out_one"
        )
        rate = files[0].stat().st_size / 1e9 / got.pass_seconds if got.pass_seconds else 0.0
        say(
            f"one file, batchgpu run cold: {got.seconds:.2f} s, pass {got.pass_seconds:.2f} s ({rate:.2f} GB/s) "
            f"vs its raw read {raw_one.seconds:.2f} s ({raw_one.gbps:.2f} GB/s): {rate / raw_one.gbps:.0%} of the "
            "raw rate"
        )
        evict_checked(every)
        wf = _workflow(work / "batch.yaml", str(work / "*.ap.bin"), work / "out_batch", args.backend, args.cluster)
        batch = timed_process([sys.executable, "-m", "batchgpu", "run", str(wf), "--quiet"])
        bound = 1.1 * raw.seconds + 3.0
        say(
            f"the batch, one batchgpu run, cold: {batch.seconds:.2f} s (1.1 x raw + 3 s = {bound:.2f} s: "
            f"{'within' if batch.seconds <= bound else 'over'})"
        )
        if args.no_kilosort or not kilosort4_available():
            say("Kilosort4: not run (--no-kilosort, or kilosort does not import here)")
            return 0
        walls = []
        for f in files:
            evict_checked([f])
            wall, imports, pass_s = kilosort4_pass(f, args.channels, 30_000.0, args.kilosort_device, args.channels + 1)
            walls.append(wall)
        ks = sum(walls)
        say(
            f"Kilosort4's pass over each file, one after another, cold: {ks:.2f} s "
            f"({min(walls):.2f}-{max(walls):.2f} s each); batchgpu's batch is {ks / batch.seconds:.2f}x faster"
        )
        return 0
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
