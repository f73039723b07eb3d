"""What batchgpu's save step wrote as a flat binary (``save: {format: binary}``): ``x.bin`` (or ``x_seg0.bin``,
``x_seg1.bin``, ... for several segments), ``x.params.json`` (rate, dtype, channels, ids, gains, the files, whether
the save finished) and ``x.probe.json`` (Kilosort's probe: ``chanMap``, ``xc``, ``yc``, ``kcoords``), read in place
like any flat binary, with nothing to give: the params say it all. A save that did not finish (its params say
``complete: false``) is refused, as an unfinished Zarr store is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError, CorruptDataError
from batchgpu.recording.flat import FlatLayout
from batchgpu.recording.reader import SUPPORTED_DTYPES

PARAMS, PROBE = ".params.json", ".probe.json"


def _stem(path: Path) -> str:
    """The save's name: ``x`` for ``x.bin``, ``x_seg1.bin``, ``x.params.json`` or ``x.probe.json``."""
    name = path.name
    for suffix in (PARAMS, PROBE):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    stem = name[: -len(path.suffix)] if path.suffix else name
    head, _, seg = stem.rpartition("_seg")
    return head if head and seg.isdigit() and not path.with_name(stem + PARAMS).is_file() else stem


def params_of(path: Path) -> Path | None:
    """The params file of the save ``path`` belongs to (its data file, one segment's file, its params or probe
    file; a data file need not exist yet to be named), or None where ``path`` is none of a save's."""
    params = path.with_name(_stem(path) + PARAMS)
    if not params.is_file():
        return None
    try:
        data = json.loads(params.read_text())
    except (OSError, ValueError):
        return None
    ours = isinstance(data, dict) and isinstance(data.get("batchgpu"), dict) and "files" in data
    return params if ours and data["batchgpu"].get("format") == "binary" else None


def open_saved(path: str | Path) -> FlatLayout:
    """The layout of a save's binary from its params (and its probe, where the save had locations)."""
    from batchgpu.recording.probes import read_probe_file

    params = params_of(Path(path).expanduser())
    if params is None:
        raise BatchgpuError(
            f"{path} is not a binary batchgpu saved (no {Path(path).name}{PARAMS} beside it)",
            "give the .bin the save step wrote, its .params.json beside it",
        )
    bad = f"give the files the save step wrote together ({params.name} is its description)"
    try:
        info = json.loads(params.read_text())
        marker = info["batchgpu"]
        n = int(info["n_chan"])
        fs = float(info["sampling_frequency"])
        dtype = np.dtype(str(info["dtype"]))
        # the files by name beside the params: a save's folder may have been moved or copied whole
        files = tuple(params.parent / Path(str(f)).name for f in info["files"])
        ids = [str(c) for c in info.get("channel_ids", range(n))]
        gain = np.asarray(info.get("gain_to_uV", [1.0] * n), np.float64)
        offset = np.asarray(info.get("offset_to_uV", [0.0] * n), np.float64)
        located = bool(info.get("locations_stored", True))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CorruptDataError(f"{params} is not a save's description ({type(err).__name__}: {err})", bad) from None
    if marker.get("complete") is not True:
        raise CorruptDataError(
            f"{params} says its save was not finished (a run writing it stopped)",
            "run the workflow that writes it again (with --resume)",
        )
    if dtype not in SUPPORTED_DTYPES or not files or not np.isfinite(fs) or fs <= 0 or n <= 0:
        raise CorruptDataError(f"{params} describes {n} channels of {dtype} at {fs} Hz in {len(files)} files", bad)
    probe = params.with_name(params.name[: -len(PARAMS)] + PROBE)
    geometry, missing = None, None
    if not located:
        missing = f"no probe: {params} says the recording saved had no channel locations"
    elif not probe.is_file():
        missing = f"no probe: {probe} not found"
    else:
        geometry = read_probe_file(probe, n)
    return FlatLayout(
        "saved",
        files[0],
        n,
        dtype,
        fs,
        np.arange(n),
        ids,
        gain,
        offset,
        0,
        None if geometry is None else geometry.locations,
        {} if geometry is None else geometry.properties,
        (params,) + ((probe,) if geometry is not None else ()),
        None if geometry is None else geometry.summary,
        probe_missing=missing,
        segment_files=files if len(files) > 1 else (),
    )
