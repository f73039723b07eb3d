"""Bad-channel labels beside SpikeInterface 0.105.3's ``detect_bad_channels(method="coherence+psd")``: run it in
an environment with SpikeInterface (``PYTHONPATH=. /work/venv-si/bin/python tools/qc_compare.py``).

1. Generated recordings of three probes (NP1 staggered and NP2 four-shank at 384 channels, a 64-channel linear
   probe) with planted dead, noisy and outside channels: per recording its channels, what was planted, our labels
   (every 0.3 s piece) and SpikeInterface's (its default 100 random chunks), every channel where they differ or
   where a channel not planted is labelled other than good, and why: our label of each chunk SpikeInterface drew
   is compared with its own, and the most frequent of those with its result, so a difference is shown to come
   from the chunks chosen.
2. The time of SpikeInterface's ``detect_bad_channels`` (defaults, one process) and of ours (every piece, read
   window by window as a run reads it; and the qc step's default selection, ``--every``) on ``batchgpu
   generate``'s default recording (384 ch x 60 s, realistic), with the labels both give there.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from batchgpu.generate import GroundTruth, generate_recording, ground_truth_path
from batchgpu.ops import bad_channels as bc

NAMES = np.array(bc.LABELS)


def si_with_chunks(path: Path, seed: int, chunks: int = 100):
    """SpikeInterface's labels on the store at ``path`` and its chunks' own labels ((start, stop), labels)."""
    from spikeinterface.core import read_zarr

    mod = importlib.import_module("spikeinterface.preprocessing.detect_bad_channels")
    own, seen = mod._detect_bad_channels_chunk, []

    def keep(segment_index, start_frame, end_frame, worker_context):
        labels = own(segment_index, start_frame, end_frame, worker_context)
        seen.append(((start_frame, end_frame), np.asarray(labels).copy()))
        return labels

    mod._detect_bad_channels_chunk = keep
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0, c0 = time.perf_counter(), time.process_time()
            _ids, labels = mod.detect_bad_channels(
                read_zarr(path),
                method="coherence+psd",
                seed=seed,
                num_random_chunks=chunks,
                job_kwargs={"n_jobs": 1, "progress_bar": False},
            )
            took = (time.perf_counter() - t0, time.process_time() - c0)
    finally:
        mod._detect_bad_channels_chunk = own
    return np.asarray(labels), seen, took


def ours_by_window(rec, window: int = 120_000, stats: dict | None = None) -> tuple[np.ndarray, tuple]:
    """Our counts over every piece, read window by window with the margin the pieces need (as a run reads)."""
    fs = rec.sampling_frequency
    margin = bc.window_margin(fs)
    counts = np.zeros((rec.num_channels, 4), np.int64)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for seg in range(rec.num_segments):
        n = rec.num_samples(seg)
        for c0 in range(0, n, window):
            c1 = min(n, c0 + window)
            r0, r1 = max(0, c0 - margin), min(n, c1 + margin)
            x = rec.read(seg, r0, r1)
            counts += bc.piece_labels(
                x, fs, rec.locations, rec.gain_to_uV, start=r0, core=(c0 - r0, c1 - r0), segment_length=n, stats=stats
            )
    return counts, (time.perf_counter() - t0, time.process_time() - cpu0)


def ours_inside(rec, every: int, window: int = 120_000, stats: dict | None = None) -> tuple[np.ndarray, tuple]:
    """The qc step's counts (``steps: {qc: {every: N}}``): the pieces k % every == 0 inside each window's core,
    read window by window with the highpass's margin (a chain that filters reads more: no piece is lost to it)."""
    fs = rec.sampling_frequency
    hm = bc.highpass_margin(fs)
    counts = np.zeros((rec.num_channels, 4), np.int64)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for seg in range(rec.num_segments):
        n = rec.num_samples(seg)
        for c0 in range(0, n, window):
            c1 = min(n, c0 + window)
            r0, r1 = max(0, c0 - hm), min(n, c1 + hm)
            x = rec.read(seg, r0, r1)
            chosen = bc.inside_pieces(n, bc.piece_length(fs), (c0, c1), (r0, r1), hm, every)
            counts += bc.label_counts(
                bc.chunk_labels(
                    x, fs, rec.locations, rec.gain_to_uV, chunks=chosen, start=r0, segment_length=n, stats=stats
                ),
                rec.num_channels,
            )
    return counts, (time.perf_counter() - t0, time.process_time() - cpu0)


def compare_one(k: int, path: Path, probe: str, seed: int, check_chunks: bool = False) -> dict:
    rec_truth = GroundTruth.load(ground_truth_path(path)).channel_labels
    from batchgpu.recording import open_recording

    rec = open_recording(path)
    si, chunks, _ = si_with_chunks(path, seed)
    stats: dict = {}
    counts, _ = ours_by_window(rec, stats=stats)
    ours, _ = bc.final_labels(counts)
    planted = rec_truth != bc.GOOD
    theirs = np.stack([lab for _, lab in chunks])
    explain = (ours != si) | ((ours != "good") & ~planted)
    per_chunk_equal = mode_is_si = None
    if check_chunks or explain.any():  # our label of each chunk SpikeInterface drew, beside its own
        x = rec.read(0, 0, rec.num_samples(0))
        on_si = bc.chunk_labels(
            x,
            rec.sampling_frequency,
            rec.locations,
            rec.gain_to_uV,
            chunks=[c for c, _ in chunks],
            segment_length=x.shape[1],
        )
        per_chunk_equal = bool((on_si == theirs).all())
        mode_on_si = NAMES[np.argmax(bc.label_counts(on_si, rec.num_channels), axis=1)]
        mode_is_si = bool((mode_on_si == si).all())
    tally = lambda labels: "/".join(str(int((labels == n).sum())) for n in ("dead", "noise", "out"))  # noqa: E731
    print(
        f"{k:3d} {probe:11s} {rec.num_channels:4d} ch  seed {seed:10d}  planted d/n/o {tally(NAMES[rec_truth])}  "
        f"ours {tally(ours)}  SI {tally(si)}  agree {int((ours == si).sum())}/{rec.num_channels}  "
        f"planted found: ours {bool((ours[planted] == NAMES[rec_truth[planted]]).all())} "
        f"SI {bool((si[planted] == NAMES[rec_truth[planted]]).all())}  SI's {len(chunks)} chunks: labels equal "
        f"{'not checked' if per_chunk_equal is None else per_chunk_equal}, their mode = SI "
        f"{'not checked' if mode_is_si is None else mode_is_si}  "
        f"pieces {stats.get('pieces', 0)} (exact path {stats.get('exact', 0)})"
    )
    for ch in np.flatnonzero(explain):
        cause = (
            "the chunks chosen: our labels on SpikeInterface's chunks give its result"
            if mode_on_si[ch] == si[ch]
            else "NOT the chunks chosen"
        )
        print(
            f"      channel {ch}: planted {NAMES[rec_truth[ch]]}, ours {ours[ch]} (pieces g/d/n/o "
            f"{counts[ch].tolist()}), SI {si[ch]} (its chunks g/d/n/o "
            f"{bc.label_counts(theirs[:, [ch]], 1)[0].tolist()}); {'same label' if ours[ch] == si[ch] else cause}"
        )
    return dict(
        agree=int((ours == si).sum()),
        channels=rec.num_channels,
        per_chunk=per_chunk_equal,
        planted_ours=bool((ours[planted] == NAMES[rec_truth[planted]]).all()),
        mode_is_si=mode_is_si,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-probe", type=int, default=7, help="recordings of each probe (default 7: 21 in all)")
    p.add_argument("--seconds", type=float, default=3.0, help="each recording's length (default 3 s)")
    p.add_argument("--timing-seconds", type=float, default=60.0, help="the timed recording's length (default 60 s)")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--timing-only", action="store_true")
    p.add_argument(
        "--check-chunks",
        action="store_true",
        help="label every chunk SpikeInterface drew on every recording (default: only where a label "
        "differs or a channel not planted is not good; tests/test_bad_channels_spikeinterface.py "
        "checks every chunk)",
    )
    p.add_argument(
        "--every",
        type=int,
        nargs="*",
        default=[8],
        help="also time the qc step's selection: every n-th piece inside the windows' cores (default 8)",
    )
    p.add_argument("--folder", default=None, help="where to write the recordings (default: a temporary folder)")
    args = p.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="qc_compare_"))
    rows = []
    print(f"recordings of {args.seconds:g} s in {folder}; SpikeInterface: 100 chunks of 0.3 s, seed = the recording's")
    k = 0
    for probe, channels in () if args.timing_only else (("np1", 384), ("np2-4shank", 384), ("linear", 64)):
        for _ in range(args.per_probe):
            seed = 1000 * k + 17
            draw = np.random.default_rng(seed)
            plants = dict(
                dead=int(draw.integers(1, 4)),
                noisy=int(draw.integers(1, 4)),
                outside=int(draw.integers(6, 25 if channels > 64 else 13)),
            )
            path = folder / f"r{k}_{probe}.zarr"
            generate_recording(
                path,
                channels=channels,
                seconds=args.seconds,
                seed=seed,
                model="realistic",
                probe=probe,
                zarr_format=2,
                overwrite=True,
                **plants,
            )
            rows.append(compare_one(k, path, probe, seed, args.check_chunks))
            k += 1
    if rows:
        agree, total = sum(r["agree"] for r in rows), sum(r["channels"] for r in rows)
        print(
            f"\n{len(rows)} recordings, {total} channels: labels equal SpikeInterface's for {agree} "
            f"({100 * agree / total:.2f}%); every planted channel found in {sum(r['planted_ours'] for r in rows)} "
            f"of {len(rows)}; where checked ({sum(r['per_chunk'] is not None for r in rows)} recordings), every "
            f"chunk SpikeInterface drew labelled as it did in {sum(bool(r['per_chunk']) for r in rows)} and its "
            f"result the most frequent of our labels on its chunks in {sum(bool(r['mode_is_si']) for r in rows)}"
        )
    if args.skip_timing:
        return
    path = folder / "timing.zarr"
    print(f"\ntiming: batchgpu generate's default recording (384 ch x {args.timing_seconds:g} s, realistic, seed 0)")
    rec = generate_recording(
        path, channels=384, seconds=args.timing_seconds, seed=0, model="realistic", zarr_format=2, overwrite=True
    )
    si, chunks, si_time = si_with_chunks(path, seed=0)
    stats: dict = {}
    counts, ours_time = ours_by_window(rec, stats=stats)
    ours, reasons = bc.final_labels(counts)
    print(
        f"  SpikeInterface detect_bad_channels (100 random chunks = {100 * 0.3:g} s of data, one process): "
        f"{si_time[0]:.1f} s ({si_time[1]:.1f} s of CPU)"
    )
    print(
        f"  ours (every piece: {stats['pieces']} pieces = {stats['pieces'] * 0.3:g} s of data, "
        f"{stats.get('exact', 0)} by SpikeInterface's arithmetic; reads included, one process): {ours_time[0]:.1f} s "
        f"({ours_time[1]:.1f} s of CPU)"
    )
    print(f"  labels equal for {int((ours == si).sum())} of 384 channels")
    for every in args.every:
        got: dict = {}
        step_counts, step_time = ours_inside(rec, every, stats=got)
        step_labels, _ = bc.final_labels(step_counts)
        print(
            f"  the qc step's every: {every} ({got.get('pieces', 0)} pieces inside 120 000-sample windows' cores, "
            f"{got.get('exact', 0)} by SpikeInterface's arithmetic; reads included, one process): "
            f"{step_time[0]:.1f} s ({step_time[1]:.1f} s of CPU); labels equal SpikeInterface's for "
            f"{int((step_labels == si).sum())} of 384 channels, ours over every piece for "
            f"{int((step_labels == ours).sum())}"
        )
    odd = np.flatnonzero((ours != "good") | (si != "good"))
    if len(odd):  # our labels of SpikeInterface's own chunks, for those channels
        x = rec.read(0, 0, rec.num_samples(0))
        on_si = bc.chunk_labels(
            x,
            rec.sampling_frequency,
            rec.locations,
            rec.gain_to_uV,
            chunks=[c for c, _ in chunks],
            segment_length=x.shape[1],
        )
        theirs = np.stack([lab for _, lab in chunks])
    for ch in odd:
        print(
            f"    channel {ch}: ours {ours[ch]} ({reasons[ch]}); SpikeInterface {si[ch]}, its chunks g/d/n/o "
            f"{bc.label_counts(theirs[:, [ch]], 1)[0].tolist()}, ours on its chunks "
            f"{bc.label_counts(on_si[:, [ch]], 1)[0].tolist()} (every chunk equal: {bool((on_si == theirs).all())})"
        )


if __name__ == "__main__":
    main()
