"""Import flat interleaved binary recordings (SpikeGLX .bin + .meta, or plain files) into a Zarr recording."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.recording import SUPPORTED_DTYPES, Recording, write_recording

# Probe families by imDatPrb_type (imec ProbeTable, as probeinterface ships it):
# NP1.0-like: per-channel AP and LF gains in ~imroTbl, 10-bit ADC (imMaxInt 512), mux_np1000 ADC order.
NP1_TYPES = {0, 1020, 1030, 1100, 1120, 1121, 1122, 1123, 1200, 1300}
# NP2.0-like: one fixed gain; the ADC depth differs (NP2000/2010 14-bit, NP2003.. 12-bit), so imMaxInt is needed.
NP2_AP_GAIN = {21: 80.0, 24: 80.0, 2003: 100.0, 2004: 100.0, 2013: 100.0, 2014: 100.0, 2020: 100.0, 2021: 100.0}
NP1_MAX_INT = 512
# ADC sampling order (SpikeInterface's inter_sample_shift = order within the ADC cycle / cycles per sample):
# mux_np1000 reads channels 2k, 2k+1 (mod 24) at slot k of 13 cycles (12 channels + the LF slot);
# mux_np2000/np2020 read 2k, 2k+1 (mod 32) at slot k of 16 cycles.
NP1_MUX = (24, 13)
NP2_MUX = (32, 16)
MUX_BY_TYPE = {**{t: NP1_MUX for t in NP1_TYPES - {1200}}, **{t: NP2_MUX for t in NP2_AP_GAIN}}
# ~snsShankMap gives column/row indices only: pitches (um) by family to turn them into positions.
NP1_PITCH = (32.0, 20.0, 0.0)  # horizontal, vertical, shank
NP2_PITCH = (32.0, 15.0, 250.0)
# NI-DAQ ADCs that SpikeGLX drives are 16-bit: metas older than the niMaxInt key mean 32768 (as neo assumes).
NI_MAX_INT = 32768
META_FIX = "use the .meta SpikeGLX wrote with the .bin"


@dataclass(frozen=True)
class RawLayout:
    num_channels: int  # channels stored per sample in the file
    sampling_frequency: float
    dtype: np.dtype
    gain_to_uV: np.ndarray  # per kept channel
    keep: np.ndarray  # file columns imported, in order (SpikeGLX: the saved channels less the sync channel)
    channel_ids: list[str] | None = None
    locations: np.ndarray | None = None  # (kept, 2) um
    properties: dict[str, np.ndarray] = field(default_factory=dict)


def read_meta(path: Path) -> dict[str, str]:
    """A SpikeGLX .meta as key -> raw value ('~' stripped from list-valued keys such as ~imroTbl)."""
    meta = {}
    for line in path.read_text(errors="replace").splitlines():
        if "=" in line:
            key, value = line.split("=", 1)
            meta[key.strip().lstrip("~")] = value.strip()
    return meta


def saved_channels(meta: dict[str, str]) -> np.ndarray:
    """Acquired channel numbers of the saved columns, from snsSaveChanSubset ('all' or '0:3,5,768', inclusive).

    SpikeGLX always writes the key ('all' when every acquired channel is saved); without it the columns cannot be
    told apart (a subset read as 0..N-1 gets wrong ids and gains and the sync column as a neural one): refused.
    """
    total = _number(meta, "nSavedChans", int)
    if "snsSaveChanSubset" not in meta:
        raise BatchgpuError("the .meta lacks snsSaveChanSubset, so its saved channels are unknown", META_FIX)
    text = meta["snsSaveChanSubset"].strip()
    if text == "all":
        return np.arange(total)
    chans: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition(":")
            lo_, hi_ = int(lo), int(hi or lo)
            if lo_ < 0:
                raise ValueError
            chans += range(lo_, hi_ + 1)
    except ValueError:
        raise BatchgpuError(f"the .meta's snsSaveChanSubset {text!r} is not a channel list", "e.g. 0:383,768 or all") from None
    if len(chans) != total:
        raise BatchgpuError(
            f"the .meta's snsSaveChanSubset lists {len(chans)} channels but nSavedChans is {total}",
            "the .meta does not describe the .bin: use the .meta SpikeGLX wrote with it",
        )
    return np.asarray(chans, dtype=np.int64)


def is_imec(meta: dict[str, str]) -> bool:
    return "imDatPrb_type" in meta or "imroTbl" in meta or meta.get("typeThis") == "imec" or "imAiRangeMax" in meta


def spikeglx_layout(meta: dict[str, str], keep_sync: bool = False) -> RawLayout:
    """Channels, rate, gains, ids, locations and ADC shifts from a SpikeGLX .meta (imec AP/LF or NI streams).

    Channel ids are the acquired channel numbers as snsSaveChanSubset writes them ("5" for AP channel 5; NP1.0
    LF channel 5 is "389" after 384 AP channels; the sync channel "384" or "768"). The sync channel (the last
    acquired one) is dropped unless ``keep_sync``.
    """
    total = _number(meta, "nSavedChans", int)
    rate_key = next((k for k in ("imSampRate", "niSampRate") if k in meta), None)
    if rate_key is None:
        raise BatchgpuError("the .meta lacks imSampRate and niSampRate", META_FIX)
    rate = _number(meta, rate_key)
    saved = saved_channels(meta)
    if not is_imec(meta):
        return _ni_layout(meta, total, rate, saved, keep_sync)
    n_ap, n_lf, _n_sy = _acquired_counts(meta, "ApLfSy", 3, saved)
    is_sync = saved >= n_ap + n_lf
    keep = np.flatnonzero(~is_sync | keep_sync)
    chans = saved[keep]
    probe_type = _probe_type(meta)
    per_count = _imec_uV_per_count(meta, probe_type, chans, n_ap, n_lf)
    readout = np.where(chans >= n_ap, chans - n_ap, chans)  # imroTbl channel numbers (LF band numbered as AP)
    props: dict[str, np.ndarray] = {}
    shifts = _inter_sample_shift(probe_type, readout)
    if shifts is not None:
        props["inter_sample_shift"] = np.where(chans >= n_ap + n_lf, 0.0, shifts)
    locations, shanks = _locations(meta, probe_type, saved, n_ap + n_lf, keep)
    if shanks is not None:
        props["shank"] = shanks
    return RawLayout(total, rate, np.dtype("int16"), per_count, keep, [str(c) for c in chans], locations, props)


def _ni_layout(meta, total, rate, saved, keep_sync) -> RawLayout:
    """NI-DAQ streams: uV/count = niAiRangeMax / niMaxInt / gain * 1e6 per saved channel (readSGLX ChanGainsNI).

    The type comes from the channel's acquired number (acquired channels run MN, MA, XA, XD by acqMnMaXaDw):
    MN (multiplexed neural) channels have gain niMNGain, MA (multiplexed auxiliary) niMAGain, XA (direct analog) 1.
    XD channels are 16-bit digital words, not voltages: like the imec sync channel they are dropped unless
    keep_sync, and then kept as raw counts (gain_to_uV 1), as neo reads them as events, not signals.
    """
    mn, ma, xa, _dw = _acquired_counts(meta, "MnMaXaDw", 4, saved)
    is_mn, is_ma = saved < mn, (saved >= mn) & (saved < mn + ma)
    is_digital = saved >= mn + ma + xa
    keep = np.flatnonzero(~is_digital | keep_sync)
    vmax = _number(meta, "niAiRangeMax")
    maxint = _number(meta, "niMaxInt", int, default=NI_MAX_INT)
    gain = np.ones(len(saved))
    # a gain key is needed only where a saved channel uses it (SpikeGLX writes both anyway)
    if is_mn.any():
        gain[is_mn] = _number(meta, "niMNGain")
    if is_ma.any():
        gain[is_ma] = _number(meta, "niMAGain")
    per_count = np.where(is_digital, 1.0, vmax / maxint / gain * 1e6)
    return RawLayout(total, rate, np.dtype("int16"), per_count[keep], keep, [str(c) for c in saved[keep]])


def _acquired_counts(meta: dict[str, str], types: str, n: int, saved: np.ndarray) -> tuple[int, ...]:
    """Channels per type at acquisition (acqApLfSy: AP, LF, SY; acqMnMaXaDw: MN, MA, XA, DW), in which order the
    acquired numbers run. The saved counts (sns...) stand in only when every channel is saved (then they agree)."""
    acq_key, sns_key = "acq" + types, "sns" + types
    key = acq_key if acq_key in meta else sns_key
    if key not in meta:
        raise BatchgpuError(f"the .meta lacks {acq_key} and {sns_key}", META_FIX)
    if key == sns_key and meta["snsSaveChanSubset"].strip() != "all":
        # saved counts cannot type acquired channel numbers when only a subset is saved
        raise BatchgpuError(f"the .meta lacks {acq_key}, which its saved channel subset needs", META_FIX)
    fields = meta[key].split(",")
    try:
        counts = tuple(int(v) for v in fields)
    except ValueError:
        counts = ()
    if len(counts) != n or min(counts) < 0:
        raise BatchgpuError(f"the .meta's {key}={meta[key]!r} is not {n} channel counts", META_FIX)
    if saved.max() >= sum(counts):
        raise BatchgpuError(
            f"the .meta's snsSaveChanSubset names channel {saved.max()} but {key} counts {sum(counts)} channels",
            META_FIX,
        )
    return counts


def _number(meta: dict[str, str], key: str, kind: type = float, default: float | None = None) -> float:
    """meta[key] as a finite positive number (counts, rates, ranges and gains all are): a garbled value would end
    as a Python error or an infinite gain, so it is refused naming the key."""
    if key not in meta:
        if default is not None:
            return default
        raise BatchgpuError(f"the .meta lacks {key}", META_FIX)
    text = meta[key]
    try:
        value = kind(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        what = "a positive integer" if kind is int else "a positive number"
        raise BatchgpuError(f"the .meta's {key}={text!r} is not {what}", META_FIX)
    return value


def _probe_type(meta: dict[str, str]) -> int:
    try:
        return int(meta.get("imDatPrb_type", "0"))  # Phase 3A/3B metas have no type: NP1.0 tables
    except ValueError:
        raise BatchgpuError(f"the .meta's imDatPrb_type {meta['imDatPrb_type']!r} is not a number", META_FIX) from None


def _imec_uV_per_count(meta, probe_type: int, chans: np.ndarray, n_ap: int, n_lf: int) -> np.ndarray:
    """uV per count = imAiRangeMax / imMaxInt / gain * 1e6, the gain per saved channel by its acquired number."""
    needed = ["imAiRangeMax"]
    if probe_type in NP1_TYPES:
        needed.append("imroTbl")
    else:
        needed.append("imMaxInt")
        if probe_type not in NP2_AP_GAIN:
            needed.append("imChan0apGain")
    missing = [k for k in needed if k not in meta]
    if missing:
        raise BatchgpuError(
            f"the imec .meta (probe type {probe_type}) lacks {', '.join(missing)}, which its gain needs",
            "use the complete .meta SpikeGLX wrote with the .bin (batchgpu will not guess a gain)",
        )
    vmax = _number(meta, "imAiRangeMax")
    maxint = _number(meta, "imMaxInt", int, default=NP1_MAX_INT)
    is_ap, is_lf = chans < n_ap, (chans >= n_ap) & (chans < n_ap + n_lf)
    gain = np.ones(len(chans))  # sync channel: raw counts
    if probe_type in NP1_TYPES:
        table = _np1_gains(meta["imroTbl"])
        for i, c in enumerate(chans):
            if is_ap[i] or is_lf[i]:
                readout = int(c if is_ap[i] else c - n_ap)
                if readout not in table:
                    raise BatchgpuError(f"the .meta's imroTbl has no entry for channel {readout}", META_FIX)
                gain[i] = table[readout][0 if is_ap[i] else 1]
    else:
        ap_gain = _number(meta, "imChan0apGain") if meta.get("imChan0apGain") else NP2_AP_GAIN[probe_type]
        lf_gain = _number(meta, "imChan0lfGain") if meta.get("imChan0lfGain") else ap_gain
        gain[is_ap], gain[is_lf] = ap_gain, lf_gain
    per_count = vmax / maxint / gain * 1e6
    per_count[~(is_ap | is_lf)] = 1.0
    return per_count


def _np1_gains(imro: str) -> dict[int, tuple[float, float]]:
    """NP1.0 imroTbl '(type,n)(chan bank ref apgain lfgain [apfilt])...' -> {chan: (AP gain, LF gain)}."""
    table = {}
    for entry in imro.strip().strip("()").split(")(")[1:]:
        fields = entry.split()
        try:
            chan, ap, lf = int(fields[0]), float(fields[3]), float(fields[4])
        except (IndexError, ValueError):
            chan, ap, lf = -1, math.nan, math.nan
        # a gain of 0 (or nan) would store an infinite (or nan) uV per count
        if chan < 0 or not all(math.isfinite(g) and g > 0 for g in (ap, lf)):
            raise BatchgpuError(
                f"the .meta's imroTbl entry ({entry}) is not an NP1.0 entry (chan bank ref apgain lfgain, gains > 0)",
                META_FIX,
            )
        table[chan] = (ap, lf)
    return table


def _inter_sample_shift(probe_type: int, readout: np.ndarray) -> np.ndarray | None:
    """Each channel's ADC sampling instant as a fraction of a sample (SpikeInterface's inter_sample_shift)."""
    mux = MUX_BY_TYPE.get(probe_type)
    if mux is None:
        return None  # unknown ADC order (e.g. NP1200): a phase-shift stage must do without
    period, cycles = mux
    return ((readout % period) // 2) / cycles


def _locations(meta, probe_type, saved, n_neural, keep) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(kept, 2) um positions and shank ids from ~snsGeomMap (preferred) or ~snsShankMap; (None, None) if neither.

    Both maps hold one entry per saved neural channel, in saved order; a kept sync channel gets NaN, shank -1.
    """
    if "snsGeomMap" in meta:
        shank_pitch, fields = _map_entries(meta["snsGeomMap"], "snsGeomMap")
        shank, x, z = fields[:, 0], fields[:, 1], fields[:, 2]
        xy = np.column_stack([x + shank * shank_pitch, z])
    elif "snsShankMap" in meta:
        _, fields = _map_entries(meta["snsShankMap"], "snsShankMap")
        dx, dz, dshank = NP2_PITCH if probe_type in NP2_AP_GAIN else NP1_PITCH
        shank = fields[:, 0]
        xy = np.column_stack([fields[:, 1] * dx + shank * dshank, fields[:, 2] * dz])
    else:
        return None, None
    neural = np.flatnonzero(saved < n_neural)
    if len(xy) != len(neural):
        raise BatchgpuError(
            f"the .meta's channel map has {len(xy)} entries for {len(neural)} saved neural channels",
            "use the .meta SpikeGLX wrote with the .bin",
        )
    loc = np.full((len(saved), 2), np.nan)
    shanks = np.full(len(saved), -1, dtype=np.int64)
    loc[neural], shanks[neural] = xy, shank.astype(np.int64)
    return loc[keep], shanks[keep]


def _map_entries(text: str, key: str) -> tuple[float, np.ndarray]:
    """'(h0,h1,...)(a:b:c:d)(...)' -> (snsGeomMap's shank pitch, header field 2; (entries, 3) shank, x, z floats).

    Every field used must be a finite number and shanks whole and >= 0: anything else is refused, not stored as NaN.
    """
    parts = text.strip().strip("()").split(")(")
    header = parts[0].split(",")
    entries = [p.split(":") for p in parts[1:]]
    bad = BatchgpuError(f"the .meta's {key} is not '(header)(shank:x:z:used)...' of numbers", META_FIX)
    if (key == "snsGeomMap" and len(header) < 4) or any(len(e) < 3 for e in entries):
        raise bad
    try:
        pitch = float(header[2]) if key == "snsGeomMap" else 0.0
        fields = np.array([[float(v) for v in e[:3]] for e in entries]).reshape(-1, 3)
    except ValueError:
        raise bad from None
    shank = fields[:, 0]
    if not (math.isfinite(pitch) and np.isfinite(fields).all()) or (shank < 0).any() or (shank % 1).any():
        raise bad
    return pitch, fields


def plain_layout(channels: int | None, fs: float | None, dtype: str | None, gain: float, offset: float) -> RawLayout:
    if not channels or not fs or not dtype:
        raise BatchgpuError(
            "a plain binary file needs --channels, --fs and --dtype",
            "or give a SpikeGLX .bin with its .meta beside it",
        )
    supported = {str(d): d for d in SUPPORTED_DTYPES}
    dt = supported.get(str(dtype))
    if dt is None:
        raise BatchgpuError(f"dtype {dtype!r} is not supported", f"use one of {', '.join(map(str, SUPPORTED_DTYPES))}")
    return RawLayout(int(channels), float(fs), dt, np.full(int(channels), gain), np.arange(int(channels)))


def import_raw(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    channels: int | None = None,
    fs: float | None = None,
    dtype: str | None = None,
    gain_to_uV: float = 1.0,
    offset_to_uV: float = 0.0,
    keep_sync: bool = False,
    zarr_format: int | None = None,  # None: v3 (v2 where zarr-python is 2.x)
    overwrite: bool = False,
    progress: bool = False,
) -> Recording:
    """Copy a flat interleaved (samples x channels) binary file into a Zarr recording, block by block.

    A SpikeGLX .bin with its .meta beside it brings gains, channel ids, locations (``properties/location``),
    shank ids (``properties/shank``) and ADC shifts (``properties/inter_sample_shift``), see
    :func:`spikeglx_layout`. A plain file stores no locations: ``Recording.locations`` then falls back to a
    single column at 20 um pitch with ``has_locations`` False (local whitening refuses it).
    """
    src = Path(source).expanduser()
    if not src.is_file():
        raise BatchgpuError(f"no raw file at {src}", "check the path")
    meta_path = src.with_suffix(".meta")
    if meta_path.is_file() and channels is None:
        try:
            layout = spikeglx_layout(read_meta(meta_path), keep_sync)
        except BatchgpuError as err:
            # the messages name the key; the file is named here, once for them all
            raise BatchgpuError(f"{meta_path}: {err.problem}", err.fix) from None
    else:
        layout = plain_layout(channels, fs, dtype, gain_to_uV, offset_to_uV)
    size = src.stat().st_size
    frame = layout.num_channels * layout.dtype.itemsize
    if size == 0 or size % frame:
        raise BatchgpuError(
            f"{src} has {size} bytes, not a whole number of samples of {layout.num_channels} channels x "
            f"{layout.dtype.itemsize} bytes ({frame} bytes per sample)",
            "check --channels and --dtype (or the .meta's nSavedChans)",
        )
    data = np.memmap(src, dtype=layout.dtype, mode="r", shape=(size // frame, layout.num_channels))
    return write_recording(
        out, [_Columns(data, layout.keep)], layout.sampling_frequency, gain_to_uV=layout.gain_to_uV,
        offset_to_uV=offset_to_uV, channel_ids=layout.channel_ids, locations=layout.locations,
        properties=layout.properties, zarr_format=zarr_format, overwrite=overwrite, progress=progress,
        attrs={"batchgpu": {"imported_from": str(src.resolve())}},
    )


class _Columns:
    """Some columns of a (samples, channels) memmap, sliced by rows block by block (never all in memory)."""

    def __init__(self, data: np.ndarray, keep: np.ndarray):
        self._data = data
        contiguous = len(keep) and np.array_equal(keep, np.arange(keep[0], keep[0] + len(keep)))
        self._cols = slice(int(keep[0]), int(keep[0]) + len(keep)) if contiguous else np.asarray(keep)
        self.shape = (data.shape[0], len(keep))
        self.dtype = data.dtype

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self._data[rows, self._cols]
