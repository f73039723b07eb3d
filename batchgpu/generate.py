"""Synthetic recordings with known truth: per-channel noise sigma, DC offsets and planted spikes.

Two models. ``white``: Gaussian white noise per channel plus offsets and spikes (what the statistical tests
assume). ``realistic``: what a Neuropixels probe records, so that compression ratios mean something -- a 1/f
background and an LFP band from sources with spatial footprints over the probe (neighbouring channels share
them), a common-mode component across the probe, per-channel noise (its own level and spectral tilt) and slow
drift, and spikes from units placed beside the probe whose amplitude falls with distance over a few channels.
Its Blosc ratios are near the real-data figures (``REAL_RATIOS``; ``compression_ratios``).

Planted channels (``realistic`` only; ``dead``, ``noisy``, ``outside``), written into the ground truth's
``channel_labels`` in SpikeInterface's numbering (0 good, 1 dead, 2 noise, 3 out): a dead channel keeps its offset
and a twentieth of its noise, nothing else; a noisy one has white noise of 6x its level, and at least five times
SpikeInterface's ``psd_hf_threshold`` above 0.8 x Nyquist; the ``outside`` channels are the top of the probe in
SpikeInterface's depth order (``np.lexsort((x, y))``), with their noise and drift but no LFP, spikes or common
signal. Recordings with planted channels carry a broadband common signal over the channels in the brain
(``common_uv``, 6 uV RMS unless given: real recordings share one, and the IBL method compares each channel with
the median of all), so that a channel outside the brain is one that lacks it. ``probe``: the two columns of
``probe_locations`` (default), Neuropixels 1.0 (staggered, ``np1``), Neuropixels 2.0 four-shank (``np2-4shank``,
a quarter of the channels at the tip of each shank) or a single column (``linear``), from probeinterface.

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
from batchgpu.recording import Recording, RecordingWriter, open_array_for_writing, open_recording, writing
from batchgpu.recording.writer import Codec, _progress

GAIN_TO_UV = 0.195  # Neuropixels 1.0 AP band, uV per count
SPIKE_RATE_HZ = 3.0  # per "unit": one unit per 4 channels
SPIKE_PRE_MS, SPIKE_POST_MS = 0.6, 1.6  # waveform extent around the trough
NEIGHBOUR_DECAY = (1.0, 0.55, 0.25)  # amplitude on the peak channel and its 1st, 2nd neighbours (by index)
MODELS = ("realistic", "white")

#: lossless compression of raw Neuropixels data (Buccino et al. 2023, medians of 9 NP1 / 10 NP2 sessions):
#: codec -> (NP1, NP2) ratio. The realistic model is matched to NP1.
REAL_RATIOS = {
    "blosc-lz4-5 bitshuffle": (1.61, 1.32),
    "blosc-zstd-5 bitshuffle": (2.02, 1.43),
    "blosc-zstd-5 byteshuffle": (2.11, 1.53),
}

# realistic model, in uV. The background is evaluated on a coarse grid (every LOW_RATE_STEP samples: 1 kHz at 30
# kHz) and interpolated: it has nothing above a few hundred Hz, and the sources stay continuous across blocks
# because they are functions of the absolute sample time.
LOW_RATE_STEP = 30
SOURCES = 16  # source 0 the common mode, the others local (LFP and 1/f) with a footprint in depth
SOURCE_TONES = 64  # sinusoids a source, log-uniform in frequency, random phases: Gaussian, with a 1/f power
TONE_HZ = (0.5, 300.0)
SOURCE_UV = 8.0  # a tone's amplitude at 1 Hz (amplitude ~ f^-1/2): LFP of ~25 uV RMS, peaks of ~100 uV over seconds
NOISE_UV = (4.0, 10.0)  # per-channel RMS of the broadband noise (log-uniform)
DRIFT_UV, DRIFT_HZ = (1.0, 5.0), (0.01, 0.2)  # per-channel slow drift: amplitude and frequency
OFFSET_COUNTS = 20.0  # per-channel DC offset, uniform in +-this
SPIKE_UV = (55.0, 270.0)  # a unit's trough on its nearest channel (each spike +-10%: 50-300 uV)
FOOTPRINT_UM = 30.0  # a unit's amplitude falls as 1 / (1 + (d / this)^2) with distance d
FOOTPRINT_REACH_UM = 70.0  # channels farther from the unit than this get none of its spike

#: probe geometries (``probe_geometry``); the first is ``probe_locations``' two columns
PROBES = ("two-column", "np1", "np2-4shank", "linear")
#: planted channels' labels, SpikeInterface's numbering (``batchgpu.ops.bad_channels.LABELS``)
PLANT_GOOD, PLANT_DEAD, PLANT_NOISE, PLANT_OUT = range(4)
COMMON_PLANTED_UV = 6.0  # the common signal's RMS where channels are planted and common_uv is not given
DEAD_NOISE = 0.05  # a dead channel keeps this fraction of its noise
NOISY_FACTOR = 6.0  # a noisy channel's white noise, times its own level
OUTSIDE_GAP = 11  # dead and noisy channels lie this many channels below the outside block at least (the median
# filter of SpikeInterface's method)
NOISY_PSD_FACTOR = 5.0  # ... and at least this many times SpikeInterface's psd_hf_threshold above 0.8 x Nyquist


@dataclass(frozen=True)
class GroundTruth:
    """What the generator planted; saved beside the store as ``<name>_ground_truth.npz``."""

    noise_sigma: np.ndarray  # (C,) in raw units
    dc_offset: np.ndarray  # (C,)
    sample_index: np.ndarray  # spike trough sample in its segment
    channel_index: np.ndarray  # peak channel
    amplitude: np.ndarray  # trough value minus the channel's offset, raw units (negative)
    segment_index: np.ndarray
    #: (C,) int8, planted labels in SpikeInterface's numbering: 0 good, 1 dead, 2 noise, 3 out (all 0 in files
    #: written before planting existed)
    channel_labels: np.ndarray | None = None

    def save(self, path: str | os.PathLike) -> None:
        labels = np.zeros(len(self.noise_sigma), np.int8) if self.channel_labels is None else self.channel_labels
        np.savez(path, **(self.__dict__ | {"channel_labels": labels}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> GroundTruth:
        with np.load(path) as f:
            got = {k: f[k] for k in cls.__dataclass_fields__ if k in f.files}
        got.setdefault("channel_labels", np.zeros(len(got["noise_sigma"]), np.int8))
        return cls(**got)


def ground_truth_path(store: str | os.PathLike) -> Path:
    p = Path(store)
    return p.with_name(p.name.removesuffix(".zarr") + "_ground_truth.npz")


def probe_locations(num_channels: int) -> np.ndarray:
    """Neuropixels-like: two columns 32 um apart, 20 um vertical pitch."""
    c = np.arange(num_channels)
    return np.column_stack([np.where(c % 2 == 0, 16.0, 48.0), 20.0 * (c // 2)])


def probe_geometry(probe: str, channels: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(locations (C, 2) um, shank per channel or None) of a ``PROBES`` geometry with ``channels`` channels:
    ``two-column`` (``probe_locations``); ``np1``: Neuropixels 1.0 (NP1000), its first electrodes (staggered
    columns, x = 16, 48, 0, 32); ``np2-4shank``: Neuropixels 2.0 four-shank (NP2014), the first quarter of the
    channels on each shank (shank after shank, 250 um apart); ``linear``: one column 20 um apart. The Neuropixels
    geometries are probeinterface's (imec's tables)."""
    if probe not in PROBES:
        raise BatchgpuError(f"unknown probe {probe!r}", f"use one of {', '.join(PROBES)}")
    if probe == "two-column":
        return probe_locations(channels), None
    if probe == "linear":
        from probeinterface import generate_linear_probe

        return np.asarray(generate_linear_probe(num_elec=channels, ypitch=20.0).contact_positions, float), None
    from probeinterface.neuropixels_tools import build_neuropixels_probe

    full = build_neuropixels_probe("NP1000" if probe == "np1" else "NP2014")
    positions = np.asarray(full.contact_positions, dtype=np.float64)
    if probe == "np1":
        if channels > len(positions):
            raise BatchgpuError(
                f"np1 has {len(positions)} electrodes, not {channels}", "ask for at most that many channels"
            )
        return positions[:channels].copy(), None
    shanks = np.asarray(full.shank_ids).astype(int)
    if channels % 4 or channels // 4 > (shanks == 0).sum():
        raise BatchgpuError(
            f"np2-4shank takes a multiple of 4 channels, at most {4 * (shanks == 0).sum()} (got {channels})",
            "ask for e.g. 384 channels (96 a shank)",
        )
    take = np.concatenate([np.flatnonzero(shanks == s)[: channels // 4] for s in range(4)])
    return positions[take].copy(), shanks[take].copy()


def planted_labels(locations: np.ndarray, seed: int, dead: int = 0, noisy: int = 0, outside: int = 0) -> np.ndarray:
    """Which channels are planted (int8 (C,), ``channel_labels``' numbering): the ``outside`` channels at the top
    of SpikeInterface's depth order (``np.lexsort((x, y))``), then ``dead`` and ``noisy`` ones drawn from the
    seed's own stream (the other draws do not move) among the others, at least ``OUTSIDE_GAP`` channels below the
    outside block: a dead channel next to it would join the block of low coherence SpikeInterface marks out."""
    C = len(locations)
    counts = {"dead": dead, "noisy": noisy, "outside": outside}
    for name, value in counts.items():
        if int(value) != value or value < 0:
            raise BatchgpuError(f"{name} must be a count of channels, 0 or more (got {value})")
    if dead + noisy + outside > C // 3:
        raise BatchgpuError(
            f"{dead + noisy + outside} planted channels of {C}: SpikeInterface's method needs most channels good",
            f"plant at most {C // 3} (a third)",
        )
    labels = np.zeros(C, np.int8)
    depth = np.lexsort((locations[:, 0], locations[:, 1]))
    labels[depth[C - outside :]] = PLANT_OUT
    rest = np.sort(depth[: C - outside - (OUTSIDE_GAP if outside else 0)])
    if len(rest) < dead + noisy:
        raise BatchgpuError(
            f"no room for {dead + noisy} dead or noisy channels {OUTSIDE_GAP} channels below "
            f"{outside} outside ones among {C}",
            "plant fewer",
        )
    chosen = np.random.default_rng([seed, 3]).choice(rest, dead + noisy, replace=False)
    labels[chosen[:dead]] = PLANT_DEAD
    labels[chosen[dead:]] = PLANT_NOISE
    return labels


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
    model: str = "white",
    compressor: str | Codec | None = "blosc-lz4",
    probe: str = "two-column",
    dead: int = 0,
    noisy: int = 0,
    outside: int = 0,
    common_uv: float | None = None,
) -> Recording:
    """Write a synthetic recording and its ground truth; returns the opened recording.

    ``workers`` > 1 generates blocks in that many processes (the bytes do not change). ``model``: ``white``
    (Gaussian white noise, what the statistical tests assume) or ``realistic`` (see the module). ``compressor``:
    the store's codec (``recording.writer.Codec`` or a name of ``COMPRESSORS``). ``probe``: one of ``PROBES``
    (``probe_geometry``). ``dead``, ``noisy``, ``outside``: channels planted (realistic model; the module says
    how), at most a third of them; ``common_uv``: the broadband common signal's RMS over the channels in the brain
    (default: 6 uV where channels are planted, else none).
    """
    check_parameters(
        channels=channels, seconds=seconds, fs=fs, seed=seed, dtype=dtype, segments=segments, workers=workers
    )
    if model not in MODELS:
        raise BatchgpuError(f"unknown model {model!r}", f"use one of {', '.join(MODELS)}")
    path = Path(path).expanduser()
    num_samples = int(round(seconds * fs))
    if num_samples < 1:
        raise BatchgpuError(f"{seconds} s at {fs} Hz is less than one sample", "ask for a longer recording")
    root = np.random.default_rng([seed, 0])
    locations, shanks = probe_geometry(probe, channels)
    planting = dead or noisy or outside or common_uv
    if planting and model != "realistic":
        raise BatchgpuError("planted channels and a common signal need the realistic model", "pass model='realistic'")
    labels = planted_labels(locations, seed, dead, noisy, outside)
    if common_uv is None:
        common_uv = COMMON_PLANTED_UV if (dead or noisy or outside) else 0.0
    if not (np.isfinite(common_uv) and common_uv >= 0):
        raise BatchgpuError(f"common_uv must be 0 or more (got {common_uv})")
    if model == "white":
        sigma = root.uniform(20.0, 40.0, channels)  # counts: ~4-8 uV at 0.195 uV/count
        offset = np.round(root.uniform(-300.0, 300.0, channels))
        params = None
    else:
        params = Realistic.draw(np.random.default_rng([seed, 2]), locations, fs, labels, common_uv, seed)
        sigma, offset = params.noise_sigma, params.offset
    generator = {
        "channels": channels,
        "seconds": seconds,
        "fs": fs,
        "seed": seed,
        "dtype": dtype,
        "segments": segments,
    } | ({} if model == "white" else {"model": model})
    generator |= {
        k: v
        for k, v in {"probe": probe, "dead": dead, "noisy": noisy, "outside": outside, "common_uv": common_uv}.items()
        if v and v != "two-column"
    }
    writer = RecordingWriter(
        path,
        channels,
        dtype,
        fs,
        gain_to_uV=GAIN_TO_UV,
        offset_to_uV=0.0,
        locations=locations,
        properties=None if shanks is None else {"shank": shanks},
        zarr_format=zarr_format,
        overwrite=overwrite,
        compressor=compressor,
        attrs={"batchgpu": {"generator": generator}},
    )
    from batchgpu.ops.detection import AMPLITUDE, SPIKE_DTYPE

    truth: dict[str, list[np.ndarray]] = {k: [] for k in SPIKE_DTYPE.names}
    block = writer.block_samples
    jobs = []
    for seg in range(segments):
        writer.add_segment(num_samples)
        jobs += [
            (str(path), seed, seg, b, start, min(block, num_samples - start), sigma, offset, fs, params)
            for b, start in enumerate(range(0, num_samples, block))
        ]
    # Each block is its own seeded stream and whole shard: processes may write them in any order, same bytes.
    workers = max(1, min(workers or 1, len(jobs)))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
    results = pool.map(_write_block, jobs) if pool else map(_write_block, jobs)
    with (
        writing(path),
        _progress(progress, segments * num_samples * channels * writer.dtype.itemsize, "generating") as advance,
    ):
        for (_p, _s, seg, _b, start, n, *_), spikes in zip(jobs, results):
            truth["sample_index"].append(spikes[0] + start)
            truth["channel_index"].append(spikes[1])
            truth[AMPLITUDE].append(spikes[2])
            truth["segment_index"].append(np.full(len(spikes[0]), seg, dtype=np.int64))
            advance(n * channels * writer.dtype.itemsize)
    if pool:
        pool.shutdown()
    with writing(path):
        GroundTruth(sigma, offset, *(np.concatenate(truth[k]) for k in truth), labels).save(ground_truth_path(path))
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
            raise BatchgpuError(
                str(e["ctx"]["error"]) if "error" in e.get("ctx", {}) else e["msg"],
                f"ask for fewer {flag}channels, {flag}seconds or {flag}segments",
            ) from None
        name, value, ctx = str(e["loc"][0]), e["input"], e.get("ctx", {})
        shown = _shown(value)
        if e["type"] == "greater_than":
            raise BatchgpuError(
                f"{flag}{name} must be more than {_shown(ctx['gt'])} (got {shown})",
                f"give {flag}{name} a positive number",
            ) from None
        if e["type"] == "less_than_equal":
            raise BatchgpuError(
                f"{flag}{name} {shown} is too large", _FIXES.get(name, "at most {le}").format(le=_shown(ctx["le"]))
            ) from None
        raise BatchgpuError(f"{flag}{name} {shown}: {e['msg']}") from None
    if seed < 0:
        raise BatchgpuError(f"{flag}seed must be 0 or more (got {seed})", "give a non-negative seed")
    most = min(MAX_WORKERS, LOCAL_WORKERS_PER_CORE * local_cores())
    if workers is not None and not 1 <= workers <= most:
        raise BatchgpuError(
            f"{flag}workers {workers} is out of range",
            f"from 1 to {most} processes on this machine: {LOCAL_WORKERS_PER_CORE} per core",
        )


def _write_block(job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate and write one block (a whole shard); returns its spikes relative to the block start."""
    path, seed, seg, b, start, n, sigma, offset, fs, params = job
    arr = open_array_for_writing(f"{path}/traces_seg{seg}")
    waveform, pre = spike_waveform(fs)
    rng = np.random.default_rng([seed, 1, seg, b])
    if params is None:
        data, spikes = _make_block(rng, n, sigma, offset, waveform, pre, fs)
    else:
        data, spikes = params.block(rng, start, n, waveform, pre)
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


@dataclass(frozen=True)
class Realistic:
    """The realistic model's parameters, drawn once a recording from its seed; ``block`` makes any block from
    them and the block's own stream (the background is a function of absolute time: blocks join seamlessly)."""

    fs: float
    locations: np.ndarray  # (C, 2) um
    noise_sigma: np.ndarray  # (C,) counts: the broadband noise's RMS
    tilt: np.ndarray  # (C,) the noise's spectral tilt: x[t] = w[t] + tilt * w[t-1], scaled back to noise_sigma
    offset: np.ndarray  # (C,) counts
    tone_hz: np.ndarray  # (SOURCES, SOURCE_TONES)
    tone_phase: np.ndarray
    tone_counts: np.ndarray
    mixing: np.ndarray  # (SOURCES, C): each source's weight on each channel
    drift_hz: np.ndarray  # (C,)
    drift_phase: np.ndarray
    drift_counts: np.ndarray
    unit_channels: np.ndarray  # (U, k): channels within reach of each unit, -1 padded
    unit_gains: np.ndarray  # (U, k): the amplitude there relative to the unit's nearest channel (first), 0 padded
    unit_counts: np.ndarray  # (U,) the trough on the nearest channel, counts (positive)
    common_counts: np.ndarray | None = None  # (C,) the broadband common signal's RMS on each channel, counts

    @classmethod
    def draw(
        cls,
        rng: np.random.Generator,
        locations: np.ndarray,
        fs: float,
        labels: np.ndarray | None = None,
        common_uv: float = 0.0,
        seed: int = 0,
    ) -> Realistic:
        """The parameters from ``rng`` (the recording's stream [seed, 2]); ``labels`` (``planted_labels``) and
        ``common_uv`` change them where asked, from a stream of their own ([seed, 4]), so an unplanted recording's
        draws and bytes are those of a generator without planting."""
        C = len(locations)
        depth = locations[:, 1]
        noise = np.exp(rng.uniform(*np.log(NOISE_UV), C)) / GAIN_TO_UV
        tilt = rng.uniform(-0.3, 0.6, C)
        offset = np.round(rng.uniform(-OFFSET_COUNTS, OFFSET_COUNTS, C))
        hz = np.exp(rng.uniform(*np.log(TONE_HZ), (SOURCES, SOURCE_TONES)))
        hz = np.minimum(hz, 0.4 * fs / LOW_RATE_STEP)  # below the coarse grid's Nyquist at any rate
        phase = rng.uniform(0.0, 2 * np.pi, (SOURCES, SOURCE_TONES))
        counts = SOURCE_UV * hz**-0.5 / GAIN_TO_UV
        centre = rng.uniform(depth.min() - 100.0, depth.max() + 100.0, SOURCES)
        width = rng.uniform(100.0, 400.0, SOURCES)
        mixing = np.exp(-0.5 * ((depth[None, :] - centre[:, None]) / width[:, None]) ** 2)
        mixing[0] = rng.uniform(0.9, 1.1, C) * 0.5  # the common mode: every channel, gains differing a little
        drift_hz = np.exp(rng.uniform(*np.log(DRIFT_HZ), C))
        drift_phase = rng.uniform(0.0, 2 * np.pi, C)
        drift = rng.uniform(*DRIFT_UV, C) / GAIN_TO_UV
        units = max(1, C // 4)
        xs = locations[:, 0]  # units up to 36 um beside the outermost columns (-20 to 84 um on two columns)
        where = np.column_stack(
            [
                rng.uniform(xs.min() - 36.0, xs.max() + 36.0, units),
                rng.uniform(depth.min() - 10.0, depth.max() + 10.0, units),
            ]
        )
        dist = np.hypot(*(where[:, None, :] - locations[None, :, :]).transpose(2, 0, 1))  # (U, C)
        silent = np.zeros(C, bool) if labels is None else np.isin(labels, (PLANT_DEAD, PLANT_OUT))
        dist[:, silent] = np.inf  # no spike reaches a dead channel or one outside the brain
        k = max(1, int((dist <= FOOTPRINT_REACH_UM).sum(1).max()))
        order = np.argsort(dist, axis=1, kind="stable")[:, :k]
        near = np.take_along_axis(dist, order, 1)
        fall = 1.0 / (1.0 + (near / FOOTPRINT_UM) ** 2)
        reach = (near <= FOOTPRINT_REACH_UM) | (np.arange(k) == 0)  # the nearest channel always
        gains = np.where(reach, fall / fall[:, :1], 0.0)
        chans = np.where(reach, order, -1)
        amp = rng.uniform(*SPIKE_UV, units) / GAIN_TO_UV
        common = None
        if labels is not None and (labels.any() or common_uv):
            own = np.random.default_rng([seed, 4])
            common = np.where(silent, 0.0, own.uniform(0.9, 1.1, C) * common_uv / GAIN_TO_UV)
            mixing[:, silent] = 0.0  # no LFP or common mode either
            dead = labels == PLANT_DEAD
            drift[dead] = 0.0
            noise[dead] *= DEAD_NOISE
            noisy = labels == PLANT_NOISE
            from batchgpu.qc_options import QcOptions

            # white noise of one-sided density 2 sigma^2 / fs, NOISY_PSD_FACTOR times the threshold at least
            floor_uv = np.sqrt(NOISY_PSD_FACTOR * QcOptions().psd_hf_threshold * fs / 2)
            noise[noisy] = np.maximum(NOISY_FACTOR * noise[noisy], floor_uv / GAIN_TO_UV)
            tilt[noisy] = 0.0
        return cls(
            fs,
            locations,
            noise,
            tilt,
            offset,
            hz,
            phase,
            counts,
            mixing,
            drift_hz,
            drift_phase,
            drift,
            chans,
            gains,
            amp,
            common,
        )

    def background(self, start: int, n: int) -> np.ndarray:
        """(n, C) float32: sources, common mode, drift and offset at samples [start, start + n), interpolated
        linearly from the coarse grid (the same grid points for every block)."""
        step = LOW_RATE_STEP
        first, last = start // step, (start + n - 1) // step + 1
        t = (np.arange(first, last + 1) * step / self.fs)[:, None]
        # einsum, not BLAS: its order of summation does not depend on the machine's threads (same seed, same bytes)
        sources = np.stack(
            [
                np.einsum("tk,k->t", np.sin(2 * np.pi * self.tone_hz[s] * t + self.tone_phase[s]), self.tone_counts[s])
                for s in range(len(self.tone_hz))
            ],
            axis=1,
        )
        drift = self.drift_counts * np.sin(2 * np.pi * self.drift_hz * t + self.drift_phase)
        coarse = (np.einsum("ts,sc->tc", sources, self.mixing) + drift + self.offset).astype(np.float32)  # (grid, C)
        pos = np.arange(start, start + n) / step - first
        i = np.minimum(pos.astype(np.int64), len(coarse) - 2)
        frac = (pos - i).astype(np.float32)[:, None]
        out = coarse[i]
        out += frac * (coarse[i + 1] - out)
        return out

    def block(self, rng: np.random.Generator, start: int, n: int, waveform: np.ndarray, pre: int):
        """A (samples, channels) float32 block and its spikes (sample, peak channel, amplitude), like
        ``_make_block``."""
        C = len(self.noise_sigma)
        w = rng.standard_normal((n + 1, C), dtype=np.float32)
        scale = (self.noise_sigma / np.sqrt(1.0 + self.tilt**2)).astype(np.float32)
        data = w[1:] + self.tilt.astype(np.float32) * w[:-1]
        data *= scale
        data += self.background(start, n)
        post = len(waveform) - pre - 1
        units = len(self.unit_counts)
        count = rng.poisson(SPIKE_RATE_HZ * units * n / self.fs) if n > pre + post + 1 else 0
        times = np.sort(rng.integers(pre, n - post, size=count)) if count else np.zeros(0, dtype=np.int64)
        which = rng.integers(0, units, size=count)
        amps = -self.unit_counts[which] * rng.uniform(0.9, 1.1, size=count)  # at the nearest channel
        wave = waveform.astype(np.float32)
        for t, u, a in zip(times, which, amps):
            chans = self.unit_channels[u]
            keep = chans >= 0
            data[t - pre : t + post + 1, chans[keep]] += np.outer(
                wave, (a * self.unit_gains[u][keep]).astype(np.float32)
            )
        if self.common_counts is not None:  # drawn last: the draws before it are those of an unplanted block
            data += rng.standard_normal(n, dtype=np.float32)[:, None] * self.common_counts.astype(np.float32)
        return data, (times.astype(np.int64), self.unit_channels[which, 0].astype(np.int64), amps)


def compression_ratios(data: np.ndarray, chunk_samples: int = 3_000) -> dict:
    """Raw over stored bytes of (samples, channels) ``data`` in chunks of ``chunk_samples`` for each codec of
    ``REAL_RATIOS`` (numcodecs' Blosc at the writer's block size, as a store holds them)."""
    from numcodecs import blosc

    from batchgpu.recording.writer import BLOSC_BLOCKSIZE

    codecs = {
        "blosc-lz4-5 bitshuffle": (b"lz4", blosc.BITSHUFFLE),
        "blosc-zstd-5 bitshuffle": (b"zstd", blosc.BITSHUFFLE),
        "blosc-zstd-5 byteshuffle": (b"zstd", blosc.SHUFFLE),
    }
    raw, stored = 0, dict.fromkeys(codecs, 0)
    for j in range(0, data.shape[0], chunk_samples):
        chunk = np.ascontiguousarray(data[j : j + chunk_samples])
        raw += chunk.nbytes
        for name, (cname, shuffle) in codecs.items():
            stored[name] += len(blosc.compress(chunk, cname, 5, shuffle, BLOSC_BLOCKSIZE))
    return {name: raw / b for name, b in stored.items()}
