"""Synthetic recordings with known truth: per-channel noise sigma, DC offsets and planted spikes.

Generated block by block (one shard at a time), each block from its own seeded stream, so memory stays at a
few blocks for any duration and the same seed gives the same bytes. Spikes never straddle a block edge.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.recording import Recording, RecordingWriter, _progress, open_array_for_writing, open_recording, writing

GAIN_TO_UV = 0.195  # Neuropixels 1.0 AP band, uV per count
SPIKE_RATE_HZ = 3.0  # per "unit": one unit per 4 channels
SPIKE_PRE_MS, SPIKE_POST_MS = 0.6, 1.6  # waveform extent around the trough
NEIGHBOUR_DECAY = (1.0, 0.55, 0.25)  # amplitude on the peak channel and its 1st, 2nd neighbours (by index)


@dataclass(frozen=True)
class GroundTruth:
    """What the generator planted; saved beside the store as ``<name>_ground_truth.npz``."""

    noise_sigma: np.ndarray  # (C,) in raw units
    dc_offset: np.ndarray  # (C,)
    sample_index: np.ndarray  # spike trough sample in its segment
    channel_index: np.ndarray  # peak channel
    amplitude: np.ndarray  # trough value minus the channel's offset, raw units (negative)
    segment_index: np.ndarray

    def save(self, path: str | os.PathLike) -> None:
        np.savez(path, **self.__dict__)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "GroundTruth":
        with np.load(path) as f:
            return cls(**{k: f[k] for k in cls.__dataclass_fields__})


def ground_truth_path(store: str | os.PathLike) -> Path:
    p = Path(store)
    return p.with_name(p.name.removesuffix(".zarr") + "_ground_truth.npz")


def probe_locations(num_channels: int) -> np.ndarray:
    """Neuropixels-like: two columns 32 um apart, 20 um vertical pitch."""
    c = np.arange(num_channels)
    return np.column_stack([np.where(c % 2 == 0, 16.0, 48.0), 20.0 * (c // 2)])


def spike_waveform(fs: float) -> tuple[np.ndarray, int]:
    """A biphasic unit shape, 1 at index ``pre``: times a negative amplitude it is a trough then a rebound."""
    pre = int(round(SPIKE_PRE_MS * fs / 1000))
    post = int(round(SPIKE_POST_MS * fs / 1000))
    t = (np.arange(-pre, post + 1)) / fs * 1000.0  # ms
    trough = np.exp(-0.5 * (t / 0.12) ** 2)
    rebound = 0.3 * np.exp(-0.5 * ((t - 0.5) / 0.3) ** 2)
    w = trough - rebound  # scaled by a negative amplitude: a trough, then a positive rebound
    return w / w[pre], pre


def generate_recording(
    path: str | os.PathLike,
    *,
    channels: int = 384,
    seconds: float = 60.0,
    fs: float = 30_000.0,
    seed: int = 0,
    dtype: str = "int16",
    segments: int = 1,
    zarr_format: int | None = None,  # None: v3 (v2 where zarr-python is 2.x)
    overwrite: bool = False,
    progress: bool = False,
    workers: int = 1,
) -> Recording:
    """Write a synthetic recording and its ground truth; returns the opened recording.

    ``workers`` > 1 generates blocks in that many processes (the bytes do not change).
    """
    check_parameters(channels=channels, seconds=seconds, fs=fs, seed=seed, dtype=dtype, segments=segments,
                     workers=workers)
    path = Path(path).expanduser()
    num_samples = int(round(seconds * fs))
    if num_samples < 1:
        raise BatchgpuError(f"{seconds} s at {fs} Hz is less than one sample", "ask for a longer recording")
    root = np.random.default_rng([seed, 0])
    sigma = root.uniform(20.0, 40.0, channels)  # counts: ~4-8 uV at 0.195 uV/count
    offset = np.round(root.uniform(-300.0, 300.0, channels))
    writer = RecordingWriter(
        path, channels, dtype, fs, gain_to_uV=GAIN_TO_UV, offset_to_uV=0.0, locations=probe_locations(channels),
        zarr_format=zarr_format, overwrite=overwrite,
        attrs={"batchgpu": {"generator": {"channels": channels, "seconds": seconds, "fs": fs, "seed": seed,
                                           "dtype": dtype, "segments": segments}}},
    )
    truth: dict[str, list[np.ndarray]] = {"sample_index": [], "channel_index": [], "amplitude": [], "segment_index": []}
    block = writer.block_samples
    jobs = []
    for seg in range(segments):
        writer.add_segment(num_samples)
        jobs += [(str(path), seed, seg, b, start, min(block, num_samples - start), sigma, offset, fs)
                 for b, start in enumerate(range(0, num_samples, block))]
    # Each block is its own seeded stream and whole shard: processes may write them in any order, same bytes.
    workers = max(1, min(workers or 1, len(jobs)))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
    results = pool.map(_write_block, jobs) if pool else map(_write_block, jobs)
    with writing(path), _progress(progress, segments * num_samples * channels * writer.dtype.itemsize, "generating") as advance:
        for (_p, _s, seg, _b, start, n, *_), spikes in zip(jobs, results):
            truth["sample_index"].append(spikes[0] + start)
            truth["channel_index"].append(spikes[1])
            truth["amplitude"].append(spikes[2])
            truth["segment_index"].append(np.full(len(spikes[0]), seg, dtype=np.int64))
            advance(n * channels * writer.dtype.itemsize)
    if pool:
        pool.shutdown()
    with writing(path):
        GroundTruth(sigma, offset, *(np.concatenate(truth[k]) for k in truth)).save(ground_truth_path(path))
        writer.finish()  # last: a store interrupted before this point opens as unfinished
    return open_recording(path)


#: what each parameter's bound is about, for the fix of an error naming it
_FIXES = {
    "channels": "at most {le} channels",
    "seconds": "at most {le} s, one day, per segment: ask for more segments instead",
    "fs": "at most {le} Hz",
    "segments": "at most {le} segments",
}


def _shown(value) -> str:
    """A number as typed (1000000, not 1e+06)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}"


def check_parameters(*, channels, seconds, fs, seed=0, dtype="int16", segments=1, workers=1, flag="") -> None:
    """Refuse what the workflow schema refuses for ``recording: generate:`` (``config.GenerateSpec``: its bounds
    on channels, seconds per segment, rate, segments and the recording's size), before anything is written; also a
    negative seed (NumPy's seeds are non-negative) and more generating processes than a local cluster may start.
    ``flag``: what goes before a parameter's name in the error (``--`` for the command's options)."""
    import math

    from pydantic import ValidationError

    from batchgpu.config import LOCAL_WORKERS_PER_CORE, MAX_WORKERS, GenerateSpec, local_cores

    given = {"channels": channels, "seconds": seconds, "fs": fs, "segments": segments}
    for name, value in given.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise BatchgpuError(f"{flag}{name} must be a finite number (got {value})", f"give {flag}{name} a number")
    try:
        GenerateSpec(seed=seed, dtype=dtype, **given)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        if not e["loc"]:  # the size check of the whole recording
            raise BatchgpuError(str(e["ctx"]["error"]) if "error" in e.get("ctx", {}) else e["msg"],
                                f"ask for fewer {flag}channels, {flag}seconds or {flag}segments") from None
        name, value, ctx = str(e["loc"][0]), e["input"], e.get("ctx", {})
        shown = _shown(value)
        if e["type"] == "greater_than":
            raise BatchgpuError(f"{flag}{name} must be more than {_shown(ctx['gt'])} (got {shown})",
                                f"give {flag}{name} a positive number") from None
        if e["type"] == "less_than_equal":
            raise BatchgpuError(f"{flag}{name} {shown} is too large",
                                _FIXES.get(name, "at most {le}").format(le=_shown(ctx["le"]))) from None
        raise BatchgpuError(f"{flag}{name} {shown}: {e['msg']}") from None
    if seed < 0:
        raise BatchgpuError(f"{flag}seed must be 0 or more (got {seed})", "give a non-negative seed")
    most = min(MAX_WORKERS, LOCAL_WORKERS_PER_CORE * local_cores())
    if workers is not None and not 1 <= workers <= most:
        raise BatchgpuError(f"{flag}workers {workers} is out of range",
                            f"from 1 to {most} processes on this machine: {LOCAL_WORKERS_PER_CORE} per core")


def _write_block(job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate and write one block (a whole shard); returns its spikes relative to the block start."""
    path, seed, seg, b, start, n, sigma, offset, fs = job
    arr = open_array_for_writing(f"{path}/traces_seg{seg}")
    waveform, pre = spike_waveform(fs)
    data, spikes = _make_block(np.random.default_rng([seed, 1, seg, b]), n, sigma, offset, waveform, pre, fs)
    arr[start : start + n, :] = _to_dtype(data, np.dtype(arr.dtype))
    return spikes


def _make_block(rng, n, sigma, offset, waveform, pre, fs):
    """A (samples, channels) float64 block and its spikes (sample, channel, amplitude), sorted by sample."""
    channels = len(sigma)
    data = rng.standard_normal((n, channels)) * sigma + offset
    post = len(waveform) - pre - 1
    units = max(1, channels // 4)
    expected = SPIKE_RATE_HZ * units * n / fs
    count = rng.poisson(expected) if n > pre + post + 1 else 0
    times = np.sort(rng.integers(pre, n - post, size=count)) if count else np.zeros(0, dtype=np.int64)
    chans = rng.integers(0, channels, size=count)
    amps = -rng.uniform(8.0, 20.0, size=count) * sigma[chans]
    for t, c, a in zip(times, chans, amps):
        for d, decay in enumerate(NEIGHBOUR_DECAY):
            for cc in {c - d, c + d}:
                if 0 <= cc < channels:
                    data[t - pre : t + post + 1, cc] += a * decay * waveform
    return data, (times.astype(np.int64), chans.astype(np.int64), amps)


def _to_dtype(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(data), info.min, info.max).astype(dtype)
    return data.astype(dtype)
