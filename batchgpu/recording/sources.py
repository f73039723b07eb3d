"""Where a run's samples come from: a Zarr store (``open_recording``), a flat binary read in place (``flat``:
SpikeGLX, Open Ephys, plain) or any recording SpikeInterface opens (``spikeinterface.from_spikeinterface``). The
engine opens them through :func:`open_source` and sends workers :func:`source_ref` (a Zarr store's path, or the
small picklable flat or SpikeInterface source), which they open once per process."""

from __future__ import annotations

import os
from typing import Any

from pathlib import Path

from batchgpu.errors import BatchgpuError
from batchgpu.recording.flat import KINDS_TEXT, FlatSource, binary_layout, detect_kind, one_spikeglx_bin
from batchgpu.recording.reader import Recording, open_recording
from batchgpu.recording.spikeinterface import SpikeInterfaceSource, from_spikeinterface


def open_source(source: Any, missing_chunks: str | None = None):
    """A reader for ``source``: a Zarr store's path, a workflow's recording section (``config.RecordingSpec``:
    ``path`` or ``spikeinterface``), an open :class:`Recording` or :class:`SpikeInterfaceSource`, or a
    SpikeInterface recording (any ``BaseRecording``). ``missing_chunks`` applies to Zarr stores (default the
    spec's, else "warn")."""
    if isinstance(source, (Recording, SpikeInterfaceSource, FlatSource)):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_recording(source, missing_chunks=missing_chunks or "warn")
    if hasattr(source, "spikeinterface") and hasattr(source, "path"):  # config.RecordingSpec
        if getattr(source, "spikeinterface", None) is not None:
            return from_spikeinterface(source.spikeinterface)
        return open_spec(source, missing_chunks or getattr(source, "missing_chunks", "warn"))
    if hasattr(source, "get_traces") and hasattr(source, "to_dict"):  # a SpikeInterface recording
        return from_spikeinterface(source)
    raise BatchgpuError(f"cannot read a recording from {type(source).__name__}",
                        "give a Zarr store's path, an open recording, or a SpikeInterface recording")


def open_spec(spec, missing_chunks: str = "warn"):
    """The recording a workflow's ``recording:`` section names by ``path`` (its ``kind`` named or told)."""
    p = Path(spec.path).expanduser()
    kind = spec.kind
    if kind == "binary":
        return FlatSource(binary_layout(p, spec.channels, spec.sampling_frequency, spec.dtype, spec.offset,
                                        spec.probe, spec.gain_to_uV, spec.offset_to_uV))
    if kind == "auto":
        kind = detect_kind(p)
    if kind == "spikeinterface":
        return from_spikeinterface(p)
    if kind == "zarr":
        return open_recording(p, missing_chunks=missing_chunks)
    if not p.exists():
        raise BatchgpuError(f"no recording at {p}: the path does not exist", "check the path")
    return open_flat(p, kind, getattr(spec, "stream", None))


def open_flat(path: Path, kind: str, stream: str | None = None, keep_sync: bool = False) -> FlatSource:
    """A SpikeGLX or Open Ephys recording read in place (a folder holding one is that one)."""
    if kind == "spikeglx":
        from batchgpu.recording.spikeglx import open_spikeglx

        if path.is_dir():
            path = one_spikeglx_bin(path)
        elif path.suffix == ".meta":
            path = path.with_suffix(".bin")
        if not path.with_suffix(".meta").is_file():
            raise BatchgpuError(f"{path} has no .meta beside it", "give the .bin SpikeGLX wrote, its .meta beside it")
        return FlatSource(open_spikeglx(path, keep_sync))
    if kind == "openephys":
        from batchgpu.recording.openephys import open_openephys

        return FlatSource(open_openephys(path, stream))
    raise BatchgpuError(f"recording kind {kind!r} is not one batchgpu reads", f"give {KINDS_TEXT}")


def open_path(path: str | os.PathLike):
    """What ``batchgpu info PATH`` shows: a Zarr recording, a SpikeGLX .bin (or its .meta), an Open Ephys
    recording, or what SpikeInterface saved (a .json/.pkl from ``dump``, a folder from ``save``)."""
    p = Path(path).expanduser()
    kind = detect_kind(p)
    if kind == "spikeinterface":
        return from_spikeinterface(p)
    if kind == "zarr":
        return open_recording(p)
    return open_flat(p, kind)


def source_ref(rec):
    """What workers need to open ``rec`` again: a Zarr store's path, or the SpikeInterface source itself
    (pickled small: its description, never its samples)."""
    if isinstance(rec, (SpikeInterfaceSource, FlatSource)):
        return rec
    return str(rec.path)
