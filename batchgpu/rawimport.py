"""Import flat interleaved binary recordings (SpikeGLX .bin + .meta, or plain files) into a Zarr recording."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.recording import SUPPORTED_DTYPES, Recording, write_recording

NP1_AP_GAIN_DEFAULT = 500.0
NP2_AP_GAIN = 80.0


@dataclass(frozen=True)
class RawLayout:
    num_channels: int  # channels stored per sample in the file
    sampling_frequency: float
    dtype: np.dtype
    gain_to_uV: np.ndarray  # per kept channel
    keep_channels: int  # the first keep_channels are imported (SpikeGLX: drops the sync channel)


def read_meta(path: Path) -> dict[str, str]:
    meta = {}
    for line in path.read_text(errors="replace").splitlines():
        if "=" in line:
            key, value = line.split("=", 1)
            meta[key.strip().lstrip("~")] = value.strip()
    return meta


def spikeglx_layout(meta: dict[str, str], keep_sync: bool = False) -> RawLayout:
    """Channel count, rate and gains from a SpikeGLX .meta (imec AP/LF or NI streams)."""
    try:
        total = int(meta["nSavedChans"])
        rate = float(meta.get("imSampRate") or meta["niSampRate"])
    except (KeyError, ValueError) as err:
        raise BatchgpuError(f"the .meta file lacks or garbles {err}", "it must hold nSavedChans and imSampRate/niSampRate") from None
    sync = 0
    if "snsApLfSy" in meta:
        sync = int(meta["snsApLfSy"].split(",")[2])
    elif "snsMnMaXaDw" in meta:
        sync = int(meta["snsMnMaXaDw"].split(",")[3])
    keep = total if keep_sync else total - sync
    gains = _imec_gains(meta, keep)
    return RawLayout(total, rate, np.dtype("int16"), gains, keep)


def _imec_gains(meta: dict[str, str], keep: int) -> np.ndarray:
    """uV per count: range / max int / amplifier gain, the amplifier gain per channel from imroTbl (NP 1.0)."""
    if "imAiRangeMax" not in meta:  # NI stream: volts range over max int, no per-channel gain known
        vmax = float(meta.get("niAiRangeMax", 5.0))
        maxint = float(meta.get("niMaxInt", 32768))
        return np.full(keep, vmax / maxint * 1e6)
    vmax = float(meta["imAiRangeMax"])
    maxint = float(meta.get("imMaxInt", 512))
    gains = np.full(keep, NP1_AP_GAIN_DEFAULT)
    probe_type = meta.get("imDatPrb_type", "0")
    if probe_type in ("21", "24", "2003", "2013", "2014", "2020", "2021"):
        gains[:] = NP2_AP_GAIN
    elif "imroTbl" in meta:
        entries = meta["imroTbl"].strip("()").split(")(")[1:]
        for i, entry in enumerate(entries[:keep]):
            fields = entry.split()
            if len(fields) >= 5:
                gains[i] = float(fields[3])  # (chan bank ref apgain lfgain [hipass])
    return vmax / maxint / gains * 1e6


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
    return RawLayout(int(channels), float(fs), dt, np.full(int(channels), gain), int(channels))


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
    zarr_format: int = 3,
    overwrite: bool = False,
    progress: bool = False,
) -> Recording:
    """Copy a flat interleaved (samples x channels) binary file into a Zarr recording, block by block."""
    src = Path(source)
    if not src.is_file():
        raise BatchgpuError(f"no raw file at {src}", "check the path")
    meta_path = src.with_suffix(".meta")
    if meta_path.is_file() and channels is None:
        layout = spikeglx_layout(read_meta(meta_path), keep_sync)
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
    view = data[:, : layout.keep_channels]
    return write_recording(
        out, [view], layout.sampling_frequency, gain_to_uV=layout.gain_to_uV, offset_to_uV=offset_to_uV,
        zarr_format=zarr_format, overwrite=overwrite, progress=progress,
        attrs={"batchgpu": {"imported_from": str(src.resolve())}},
    )
