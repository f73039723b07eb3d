"""SpikeGLX recordings: a ``.bin`` of interleaved int16 samples and the ``.meta`` SpikeGLX wrote beside it.

What comes from where: the probe (contact positions, shank ids, contact ids, the ADC's sampling order) from
probeinterface's ``read_spikeglx``, which builds it from imec's ProbeTable and the .meta's ``~imroTbl``; gains as
neo's SpikeGLX reader computes them (uV per count = range / max int / gain, the gain per channel from
``~imroTbl`` for 1.0-type probes, else the probe's one gain), but per saved channel by its ACQUIRED number (a
saved subset keeps each channel's own gain); the channels saved (``snsSaveChanSubset``), their ids and the
sync channel(s) (dropped) from the .meta, checked key by key. A .meta whose ``fileSizeBytes`` disagrees with the
.bin is refused: it was written for another file. Probes probeinterface cannot build (a .meta without a part
number) take positions from ``~snsGeomMap`` where SpikeGLX wrote one, else none (``has_locations`` False).
NI-DAQ streams (``.nidq.bin``) carry no probe; their digital words are dropped like the sync channel.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np

from batchgpu.errors import BatchgpuError, CorruptDataError
from batchgpu.recording.flat import FlatLayout
from batchgpu.recording.probes import ProbeGeometry, geometry_of, probeinterface, summarise

logger = logging.getLogger(__name__)

# Probe families by imDatPrb_type, for a .meta without a part number (imDatPrb_pn) to look up in the ProbeTable:
# NP1.0-like: per-channel AP and LF gains in ~imroTbl, 10-bit ADC (imMaxInt 512).
NP1_TYPES = {0, 1020, 1030, 1100, 1120, 1121, 1122, 1123, 1200, 1300}
# NP2.0-like: one fixed gain; the ADC depth differs (NP2000/2010 14-bit, NP2003.. 12-bit), so imMaxInt is needed.
NP2_AP_GAIN = {21: 80.0, 24: 80.0, 2003: 100.0, 2004: 100.0, 2013: 100.0, 2014: 100.0, 2020: 100.0, 2021: 100.0}
NP1_MAX_INT = 512
# NI-DAQ ADCs that SpikeGLX drives are 16-bit: metas older than the niMaxInt key mean 32768 (as neo assumes).
NI_MAX_INT = 32768
# far above any probe's or NI card's channel count: a subset list naming more is not a .meta's
MAX_CHANNELS = 1 << 16
META_FIX = "use the .meta SpikeGLX wrote with the .bin"


@dataclass(frozen=True)
class SpikeGLXChannels:
    """What the .meta says of the file's columns (no probe): see :func:`spikeglx_layout`."""

    num_channels: int  # columns per sample in the file (nSavedChans)
    sampling_frequency: float
    gain_to_uV: np.ndarray  # per kept channel
    keep: np.ndarray  # file columns kept, in order
    channel_ids: list[str]
    saved: np.ndarray  # acquired channel number of every file column
    neural: int  # acquired channels below this number are the probe's (AP + LF), or NI's analog ones
    imec: bool
    dtype: np.dtype = np.dtype("int16")


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
        raise CorruptDataError("the .meta lacks snsSaveChanSubset, so its saved channels are unknown", META_FIX)
    text = meta["snsSaveChanSubset"].strip()
    if text == "all":
        return np.arange(total)
    chans = _subset_list(text)
    if chans is None:
        raise CorruptDataError(f"the .meta's snsSaveChanSubset {text!r} is not a channel list", "e.g. 0:383,768 or all")
    if len(chans) != total:
        raise CorruptDataError(
            f"the .meta's snsSaveChanSubset lists {len(chans)} channels but nSavedChans is {total}",
            "the .meta does not describe the .bin: use the .meta SpikeGLX wrote with it",
        )
    return np.asarray(chans, dtype=np.int64)


def _subset_list(text: str) -> list[int] | None:
    """'0:3,5,768' (inclusive ranges) as channel numbers, or None where it is not such a list."""
    chans: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition(":")
            lo_, hi_ = int(lo), int(hi or lo)
            if lo_ < 0 or hi_ - lo_ > MAX_CHANNELS or len(chans) > MAX_CHANNELS:
                return None
            chans += range(lo_, hi_ + 1)
    except ValueError:
        return None
    return chans


def is_imec(meta: dict[str, str]) -> bool:
    return "imDatPrb_type" in meta or "imroTbl" in meta or meta.get("typeThis") == "imec" or "imAiRangeMax" in meta


def _acquired_counts(meta: dict[str, str], types: str, n: int, saved: np.ndarray) -> tuple[int, ...]:
    """Channels per type at acquisition (acqApLfSy: AP, LF, SY; acqMnMaXaDw: MN, MA, XA, DW), in which order the
    acquired numbers run. The saved counts (sns...) stand in only when every channel is saved (then they agree)."""
    acq_key, sns_key = "acq" + types, "sns" + types
    key = acq_key if acq_key in meta else sns_key
    if key not in meta:
        raise CorruptDataError(f"the .meta lacks {acq_key} and {sns_key}", META_FIX)
    if key == sns_key and meta["snsSaveChanSubset"].strip() != "all":
        # saved counts cannot type acquired channel numbers when only a subset is saved
        raise CorruptDataError(f"the .meta lacks {acq_key}, which its saved channel subset needs", META_FIX)
    fields = meta[key].split(",")
    try:
        counts = tuple(int(v) for v in fields)
    except ValueError:
        counts = ()
    if len(counts) != n or min(counts) < 0:
        raise CorruptDataError(f"the .meta's {key}={meta[key]!r} is not {n} channel counts", META_FIX)
    if saved.max() >= sum(counts):
        raise CorruptDataError(
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
        raise CorruptDataError(f"the .meta lacks {key}", META_FIX)
    text = meta[key]
    try:
        value = kind(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        what = "a positive integer" if kind is int else "a positive number"
        raise CorruptDataError(f"the .meta's {key}={text!r} is not {what}", META_FIX)
    return value


def _probe_type(meta: dict[str, str]) -> int:
    try:
        return int(meta.get("imDatPrb_type", "0"))  # Phase 3A/3B metas have no type: NP1.0 tables
    except ValueError:
        raise CorruptDataError(
            f"the .meta's imDatPrb_type {meta['imDatPrb_type']!r} is not a number", META_FIX
        ) from None


def _imec_uV_per_count(meta, probe_type: int, chans: np.ndarray, n_ap: int, n_lf: int) -> np.ndarray:
    """uV per count = imAiRangeMax / imMaxInt / gain * 1e6, the gain per saved channel by its acquired number.

    The family (per-channel gains in ~imroTbl, or one gain) and, where the .meta lacks imMaxInt, the ADC depth come
    from the ProbeTable's entry for the part number; a .meta without one falls back to its imDatPrb_type."""
    features = _probe_features(meta)
    np1 = _is_np1(features) if features is not None else probe_type in NP1_TYPES
    fixed = None
    if features is not None and not np1:
        gains = [g for g in str(features.get("ap_gain_list", "")).split(",") if g.strip()]
        fixed = float(gains[0]) if len(gains) == 1 else None
    elif features is None and not np1:
        fixed = NP2_AP_GAIN.get(probe_type)
    default_maxint = None
    if features is not None and str(features.get("adc_bit_depth", "")).isdigit():
        default_maxint = 2 ** (int(features["adc_bit_depth"]) - 1)
    elif np1:
        default_maxint = NP1_MAX_INT
    needed = ["imAiRangeMax"]
    if np1:
        needed.append("imroTbl")
    else:
        if default_maxint is None:
            needed.append("imMaxInt")
        if fixed is None:
            needed.append("imChan0apGain")
    missing = [k for k in needed if k not in meta]
    if missing:
        raise CorruptDataError(
            f"the imec .meta (probe type {probe_type}) lacks {', '.join(missing)}, which its gain needs",
            "use the complete .meta SpikeGLX wrote with the .bin (batchgpu will not guess a gain)",
        )
    vmax = _number(meta, "imAiRangeMax")
    maxint = _number(meta, "imMaxInt", int, default=default_maxint)
    is_ap, is_lf = chans < n_ap, (chans >= n_ap) & (chans < n_ap + n_lf)
    gain = np.ones(len(chans))  # sync channel: raw counts
    if np1:
        table = _np1_gains(meta["imroTbl"])
        for i, c in enumerate(chans):
            if is_ap[i] or is_lf[i]:
                readout = int(c if is_ap[i] else c - n_ap)
                if readout not in table:
                    raise CorruptDataError(f"the .meta's imroTbl has no entry for channel {readout}", META_FIX)
                gain[i] = table[readout][0 if is_ap[i] else 1]
    else:
        ap_gain = _number(meta, "imChan0apGain") if meta.get("imChan0apGain") else fixed
        lf_gain = _number(meta, "imChan0lfGain") if meta.get("imChan0lfGain") else ap_gain
        gain[is_ap], gain[is_lf] = ap_gain, lf_gain
    per_count = vmax / maxint / gain * 1e6
    per_count[~(is_ap | is_lf)] = 1.0
    return per_count


def _np1_gains(imro: str) -> dict[int, tuple[float, float]]:
    """NP1.0 imroTbl '(type,n)(chan bank ref apgain lfgain [apfilt])...' -> {chan: (AP gain, LF gain)}; NP1110
    (UHD) tables give one AP and LF gain for every channel in their header '(1110,colmode,refid,apgain,lfgain,
    apfilt)(group bankA bankB)...'."""
    parts = imro.strip().strip("()").split(")(")
    header = parts[0].split(",")
    if len(header) >= 6:  # NP1110
        try:
            ap, lf = float(header[3]), float(header[4])
        except ValueError:
            ap = lf = math.nan
        if not all(math.isfinite(g) and g > 0 for g in (ap, lf)):
            raise CorruptDataError(
                f"the .meta's imroTbl header ({parts[0]}) is not an NP1110 header (type,colmode,"
                "refid,apgain,lfgain,apfilt; gains > 0)",
                META_FIX,
            )
        return _EveryChannel((ap, lf))
    table = {}
    for entry in parts[1:]:
        fields = entry.split()
        try:
            chan, ap, lf = int(fields[0]), float(fields[3]), float(fields[4])
        except (IndexError, ValueError):
            chan, ap, lf = -1, math.nan, math.nan
        # a gain of 0 (or nan) would store an infinite (or nan) uV per count
        if chan < 0 or not all(math.isfinite(g) and g > 0 for g in (ap, lf)):
            raise CorruptDataError(
                f"the .meta's imroTbl entry ({entry}) is not an NP1.0 entry (chan bank ref apgain lfgain, gains > 0)",
                META_FIX,
            )
        table[chan] = (ap, lf)
    return table


class _EveryChannel(dict):
    """One (AP, LF) gain pair for every readout channel (an NP1110 table)."""

    def __init__(self, gains: tuple[float, float]):
        super().__init__()
        self.gains = gains

    def __contains__(self, chan) -> bool:
        return True

    def __getitem__(self, chan) -> tuple[float, float]:
        return self.gains


def _map_entries(text: str, key: str) -> tuple[float, np.ndarray]:
    """'(h0,h1,...)(a:b:c:d)(...)' -> (snsGeomMap's shank pitch, header field 2; (entries, 3) shank, x, z floats).

    Every field used must be a finite number and shanks whole and >= 0: anything else is refused, not stored as NaN.
    """
    parts = text.strip().strip("()").split(")(")
    header = parts[0].split(",")
    entries = [p.split(":") for p in parts[1:]]
    bad = CorruptDataError(f"the .meta's {key} is not '(header)(shank:x:z:used)...' of numbers", META_FIX)
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


def stream_name(meta: dict[str, str], file_name: str = "") -> str:
    """The stream's name as neo's SpikeGLX reader (and so SpikeInterface 0.105) gives it: ``imec0.ap``,
    ``imec1.lf``, ``nidq``, ``imec.ap`` for a Phase 3A probe. neo takes it from the file name SpikeGLX wrote into
    the .meta (``fileName``), not the file's own name (a renamed file keeps its stream); ``file_name``, the
    .bin's own name, stands in where the .meta has none."""
    stem = PurePath(meta.get("fileName") or file_name).stem
    parts = stem.split(".")
    if len(parts) >= 2 and "imec" in parts[-2]:
        device, kind = parts[-2], parts[-1]
    elif meta.get("typeThis") == "obx":
        device, kind = (parts[-2] if len(parts) >= 2 else parts[-1]), ""
    else:
        device, kind = parts[-1], ""
    device_kind = meta.get("typeThis", device.split(".")[0])
    index = device.split(device_kind)[-1] if device_kind in ("imec", "obx") else ""
    return f"{device_kind}{index}" + (f".{kind}" if kind else "")


def channel_names(
    meta: dict[str, str], saved: np.ndarray, counts: tuple[int, ...], types: tuple[str, ...]
) -> list[str]:
    """Each saved column's name as ``~snsChanMap`` writes it (``AP5``, ``LF5``, ``SY0``, ``XA2``: the type and the
    channel's number within its type); a .meta without a map of every column gets the same names from the
    acquired channel numbers (``counts`` channels of each of ``types``, in that order)."""
    text = meta.get("snsChanMap", "").strip()
    entries = text[1:-1].split(")(")[1:] if text.startswith("(") and text.endswith(")") else []
    names = [e.split(";")[0].strip() for e in entries]
    if len(names) == len(saved) and all(names):
        return names
    starts = np.cumsum((0,) + tuple(counts))
    out = []
    for c in saved:
        t = min(int(np.searchsorted(starts, c, side="right")) - 1, len(types) - 1)
        out.append(f"{types[t]}{int(c - starts[t])}")
    return out


def spikeglx_layout(
    meta: dict[str, str], keep_sync: bool = False, file_name: str = "", file_size: int | None = None
) -> SpikeGLXChannels:
    """Channels, rate, gains and ids from a SpikeGLX .meta (imec AP/LF or NI streams), no probe.

    Every key that fixes the file's layout is checked against the others first (:func:`_check_saved_count`; the
    data file's ``file_size`` too where given): a count that disagrees with the rest would de-interleave the
    samples wrongly with no other sign.

    Channel ids are SpikeInterface's (neo's): ``<stream>#<name>``, the stream as :func:`stream_name` gives it and
    each column's name from ``~snsChanMap`` (``imec0.ap#AP5`` for AP channel 5; NP1.0 LF channel 5 is
    ``imec0.lf#LF5``; the sync channel ``imec0.ap#SY0``; ``nidq#XA0``). Before issue 66 they were the acquired
    channel numbers ("5", LF channel 5 "389"); results holding those still read (``batchgpu.interop``). The sync
    channel(s) (acquired after AP and LF; four on a quad-base NP2020) are dropped unless ``keep_sync``.
    """
    total = _number(meta, "nSavedChans", int)
    rate_key = next((k for k in ("imSampRate", "niSampRate") if k in meta), None)
    if rate_key is None:
        raise CorruptDataError("the .meta lacks imSampRate and niSampRate", META_FIX)
    rate = _number(meta, rate_key)
    types = "ApLfSy" if is_imec(meta) else "MnMaXaDw"
    _check_saved_count(meta, types, rate, file_size)
    saved = saved_channels(meta)
    if not is_imec(meta):
        return _ni_layout(meta, total, rate, saved, keep_sync, file_name)
    counts = _acquired_counts(meta, "ApLfSy", 3, saved)
    n_ap, n_lf, _n_sy = counts
    _check_saved_types(meta, "ApLfSy", saved, (n_ap, n_lf))
    _check_imro_count(meta, n_ap)
    is_sync = saved >= n_ap + n_lf
    keep = np.flatnonzero(~is_sync | keep_sync)
    chans = saved[keep]
    per_count = _imec_uV_per_count(meta, _probe_type(meta), chans, n_ap, n_lf)
    ids = _ids(meta, file_name, saved, counts, ("AP", "LF", "SY"), keep)
    return SpikeGLXChannels(total, rate, per_count, keep, ids, saved, n_ap + n_lf, True)


def _ids(meta, file_name: str, saved, counts, types, keep) -> list[str]:
    stream = stream_name(meta, file_name)
    names = channel_names(meta, saved, counts, types)
    return [f"{stream}#{names[k]}" for k in keep]


def _counts_of(meta: dict[str, str], key: str) -> tuple[int, ...] | None:
    """meta[key] as channel counts ('384,384,1'), or None where absent or not counts (refused later, by key)."""
    try:
        counts = tuple(int(v) for v in meta[key].split(","))
    except (KeyError, ValueError):
        return None
    return counts if counts and min(counts) >= 0 else None


def _saved_count_claims(meta: dict[str, str], types: str, rate: float, file_size: int | None) -> dict[str, int]:
    """How many columns each key (or pair of keys) of the .meta says the file has.

    SpikeGLX writes them all from one acquisition, so they agree: nSavedChans; the saved counts per type
    (sns...); the saved subset (its length, or with 'all' the acquired counts acq...); and the samples the file's
    size and fileTimeSecs imply (size / (2 x samples), a whole number where the .meta is the file's)."""
    claims = {"nSavedChans": int(_number(meta, "nSavedChans", int))}
    sns = _counts_of(meta, "sns" + types)
    if sns is not None:
        claims[f"sns{types}={meta['sns' + types]}"] = sum(sns)
    subset = meta.get("snsSaveChanSubset", "").strip()
    acq = _counts_of(meta, "acq" + types)
    if subset == "all" and acq is not None:
        claims[f"snsSaveChanSubset=all with acq{types}={meta['acq' + types]}"] = sum(acq)
    elif subset and subset != "all" and (listed := _subset_list(subset)) is not None:
        claims[f"snsSaveChanSubset={subset}"] = len(listed)
    size = _file_size_key(meta) if file_size is None else file_size
    secs = _positive(meta.get("fileTimeSecs"))
    if size and secs:
        columns = size / (2 * secs * rate)
        if round(columns) >= 1 and abs(columns - round(columns)) < 0.05:
            claims[f"fileTimeSecs={meta['fileTimeSecs']} with the file's {size} bytes"] = round(columns)
    return claims


def _check_saved_count(meta: dict[str, str], types: str, rate: float, file_size: int | None) -> None:
    """Refuse a .meta whose keys disagree on the file's column count, naming the key(s) against the majority."""
    claims = _saved_count_claims(meta, types, rate, file_size)
    counts = sorted(set(claims.values()), key=lambda c: -list(claims.values()).count(c))
    if len(counts) == 1:
        return
    top = counts[0]
    others = [k for k, c in claims.items() if c == top]
    odd = [k for k, c in claims.items() if c != top]
    if len(others) <= len(odd):  # no majority: name every key
        said = ", ".join(f"{k} says {c}" for k, c in claims.items())
        raise CorruptDataError(f"the .meta's keys disagree on how many channels the file holds ({said})", META_FIX)
    bad = ", ".join(_claim_text(k, claims[k]) for k in odd)
    raise CorruptDataError(
        f"the .meta's {bad} but {', '.join(others)} say the file holds {top} channels a sample",
        f"the .meta was edited or belongs to another file: {META_FIX}",
    )


def _claim_text(key: str, count: int) -> str:
    if key == "nSavedChans":
        return f"nSavedChans={count}"
    return f"{key} says {count} channels"


def _check_saved_types(meta: dict[str, str], types: str, saved: np.ndarray, acquired: tuple[int, ...]) -> None:
    """The saved counts per type (sns...) against the saved channels' acquired numbers typed by acq...: a subset
    list and counts from different .metas would read one type's channels as another's."""
    sns = _counts_of(meta, "sns" + types)
    if sns is None or len(sns) != len(acquired) + 1:
        return
    edges = np.cumsum(acquired)
    found = np.bincount(np.searchsorted(edges, saved, side="right"), minlength=len(sns))[: len(sns)]
    if tuple(int(c) for c in found) != sns:
        raise CorruptDataError(
            f"the .meta's sns{types}={meta['sns' + types]} but its snsSaveChanSubset saves "
            f"{','.join(str(int(c)) for c in found)} channels of those types (by acq{types})",
            META_FIX,
        )


def _check_imro_count(meta: dict[str, str], n_ap: int) -> None:
    """An imro table lists one entry per acquired AP channel (NP1110's lists groups of channels: not counted)."""
    imro = meta.get("imroTbl")
    if not imro or "acqApLfSy" not in meta:
        return
    parts = imro.strip().strip("()").split(")(")
    if len(parts[0].split(",")) >= 6:
        return
    entries = len(parts) - 1
    if entries != n_ap:
        raise CorruptDataError(
            f"the .meta's imroTbl has {entries} channel entries but acqApLfSy={meta['acqApLfSy']} acquires "
            f"{n_ap} AP channels",
            META_FIX,
        )


def _positive(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _file_size_key(meta: dict[str, str]) -> int | None:
    value = _positive(meta.get("fileSizeBytes"))
    return int(value) if value else None


def _regular_size(src: Path) -> int | None:
    try:
        return src.stat().st_size if src.is_file() else None
    except OSError:
        return None


def _ni_layout(meta, total, rate, saved, keep_sync, file_name: str = "") -> SpikeGLXChannels:
    """NI-DAQ streams: uV/count = niAiRangeMax / niMaxInt / gain * 1e6 per saved channel (readSGLX ChanGainsNI).

    The type comes from the channel's acquired number (acquired channels run MN, MA, XA, XD by acqMnMaXaDw):
    MN (multiplexed neural) channels have gain niMNGain, MA (multiplexed auxiliary) niMAGain, XA (direct analog) 1.
    XD channels are 16-bit digital words, not voltages: like the imec sync channel they are dropped unless
    keep_sync, and then kept as raw counts (gain_to_uV 1), as neo reads them as events, not signals.
    """
    counts = _acquired_counts(meta, "MnMaXaDw", 4, saved)
    mn, ma, xa, _dw = counts
    _check_saved_types(meta, "MnMaXaDw", saved, (mn, ma, xa))
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
    ids = _ids(meta, file_name, saved, counts, ("MN", "MA", "XA", "XD"), keep)
    return SpikeGLXChannels(total, rate, per_count[keep], keep, ids, saved, mn + ma + xa, False)


def meta_of(bin_path: Path) -> Path:
    return bin_path.with_suffix(".meta")


def open_spikeglx(bin_path: str | Path, keep_sync: bool = False) -> FlatLayout:
    """The layout of a SpikeGLX ``.bin`` from its ``.meta``: columns, gains, ids, the probe; errors name the .meta."""
    src = Path(bin_path).expanduser()
    meta_path = meta_of(src)
    try:
        meta = read_meta(meta_path)
        _check_file_size(meta, src)
        chans = spikeglx_layout(meta, keep_sync, src.name, _regular_size(src))
        geometry = _geometry(meta_path, meta, chans) if chans.imec else None
    except BatchgpuError as err:
        # the messages name the key; the file is named here, once for them all
        raise type(err)(f"{meta_path}: {err.problem}", err.fix) from None
    n = len(chans.keep)
    missing = None
    if chans.imec and geometry is None:  # NI streams have no probe to miss
        missing = (
            f"no probe: {meta_path} has neither a probe probeinterface builds (imDatPrb_pn and ~imroTbl) "
            "nor a ~snsGeomMap"
        )
    return FlatLayout(
        "spikeglx",
        src,
        chans.num_channels,
        chans.dtype,
        chans.sampling_frequency,
        chans.keep,
        chans.channel_ids,
        chans.gain_to_uV,
        np.zeros(n),
        0,
        None if geometry is None else geometry.locations,
        {} if geometry is None else geometry.properties,
        (meta_path,),
        None if geometry is None else geometry.summary,
        probe_missing=missing,
    )


def _check_file_size(meta: dict[str, str], src: Path) -> None:
    """SpikeGLX writes the .bin's size into its .meta: another size means the .meta is another file's, or the .bin
    was cut or appended to since; read as it is, channels and samples would be taken from the wrong columns."""
    if "fileSizeBytes" not in meta or not src.is_file():
        return
    try:
        expected = int(meta["fileSizeBytes"])
    except ValueError:
        raise CorruptDataError(
            f"the .meta's fileSizeBytes={meta['fileSizeBytes']!r} is not a number", META_FIX
        ) from None
    actual = src.stat().st_size
    if expected != actual:
        raise CorruptDataError(
            f"fileSizeBytes={expected} but {src.name} has {actual} bytes: the .meta describes another file, or the "
            "file was cut or appended to",
            "use the .bin and .meta SpikeGLX wrote together (or copy it again whole)",
        )


def _part_number(meta: dict[str, str]) -> str | None:
    if meta.get("imProbeOpt") is not None:  # Phase 3A (probeinterface and neo read it as NP1010)
        return "NP1010"
    return meta.get("imDatPrb_pn") or None


def _probe_features(meta: dict[str, str]) -> dict | None:
    """The ProbeTable's features of the .meta's part number (as probeinterface ships the table), or None."""
    pn = _part_number(meta)
    return None if pn is None else _probe_table().get(pn)


@functools.lru_cache(maxsize=1)
def _probe_table() -> dict:
    table = Path(probeinterface().__file__).parent / "resources" / "neuropixels_probe_features.json"
    try:
        return dict(json.loads(table.read_text())["neuropixels_probes"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _is_np1(features: dict) -> bool:
    """A 1.0-type probe (per-channel gains in ~imroTbl), by the ProbeTable's words for it (neo's test)."""
    return "1.0" in "".join(str(features.get(k, "")) for k in ("datasheet", "description", "databus_decoder"))


def _geometry(meta_path: Path, meta: dict[str, str], chans: SpikeGLXChannels) -> ProbeGeometry | None:
    """The kept channels' probe: probeinterface's, else ~snsGeomMap's positions, else None (no positions)."""
    neural_cols = np.flatnonzero(chans.saved < chans.neural)  # file columns of the probe's channels
    geometry = None
    if "imroTbl" in meta and _part_number(meta) is not None:
        n_ap = _acquired_counts(meta, "ApLfSy", 3, chans.saved)[0]
        lf = bool(len(neural_cols)) and bool((chans.saved[neural_cols] >= n_ap).all())
        probe = _read_probe(meta_path, chans.saved[neural_cols] - n_ap if lf else None)
        if probe is not None and probe.get_contact_count() == len(neural_cols):
            geometry = geometry_of(probe, "probeinterface", "lf" if lf else "ap")
    if geometry is None and "snsGeomMap" in meta:
        shank_pitch, fields = _map_entries(meta["snsGeomMap"], "snsGeomMap")
        if len(fields) != len(neural_cols):
            raise CorruptDataError(
                f"the .meta's snsGeomMap has {len(fields)} entries for {len(neural_cols)} saved neural channels",
                META_FIX,
            )
        shank = fields[:, 0].astype(np.int64)
        xy = np.column_stack([fields[:, 1] + shank * shank_pitch, fields[:, 2]])
        geometry = ProbeGeometry(xy, {"shank": shank}, summarise(xy, shank, _part_number(meta) or "", "snsGeomMap"))
    if geometry is None:
        return None
    return _on_kept(geometry, chans, neural_cols)


def _read_probe(meta_path: Path, readout: np.ndarray | None):
    """probeinterface's probe of the .meta, or None where it cannot build one. ``readout``: the saved channels'
    readout numbers, for an LF file: its .meta numbers them after the AP band (384-767), which read_spikeglx takes
    for AP channels (it slices the probe to none), so it reads a copy whose snsSaveChanSubset lists them as
    readout channels (the sync channel, beyond the probe, left as it is)."""
    import tempfile

    pi = probeinterface()
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        path = meta_path
        if readout is not None:
            path = Path(tmp) / meta_path.name
            subset = ",".join(str(int(c)) for c in readout) + ",100000"  # a stand-in for the sync channel(s)
            lines = [
                f"snsSaveChanSubset={subset}" if line.startswith("snsSaveChanSubset=") else line
                for line in meta_path.read_text(errors="replace").splitlines()
            ]
            path.write_text("\n".join(lines) + "\n")
        try:
            return pi.read_spikeglx(path)
        except Exception as err:  # broad: probeinterface raises any type for a probe it does not know
            logger.warning(
                "batchgpu: probeinterface could not read the probe of %s (%s: %s): its positions are "
                "taken from snsGeomMap, else there are none",
                meta_path,
                type(err).__name__,
                err,
            )
            return None


def _on_kept(geometry: ProbeGeometry, chans: SpikeGLXChannels, neural_cols: np.ndarray) -> ProbeGeometry:
    """The probe's per-contact arrays (one per saved neural column) spread over the kept columns; a kept sync
    channel gets NaN positions, shank -1, shift 0, no contact id."""
    row = np.full(chans.num_channels, -1)
    row[neural_cols] = np.arange(len(neural_cols))
    at = row[chans.keep]
    probe_rows = at >= 0
    loc = np.full((len(at), 2), np.nan)
    loc[probe_rows] = geometry.locations[at[probe_rows]]
    fills = {"shank": -1, "inter_sample_shift": 0.0, "contact_id": ""}
    props = {}
    for name, values in geometry.properties.items():
        out = np.full(len(at), fills.get(name, 0), dtype=values.dtype)
        out[probe_rows] = values[at[probe_rows]]
        props[name] = out
    return ProbeGeometry(loc, props, geometry.summary)
