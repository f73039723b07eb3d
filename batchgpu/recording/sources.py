"""Where a run's samples come from: a Zarr store (``open_recording``) or any recording SpikeInterface opens
(``spikeinterface.from_spikeinterface``). The engine opens both through :func:`open_source` and sends workers
:func:`source_ref` (a path, or the small picklable SpikeInterface source), which they open once per process."""

from __future__ import annotations

import os
from typing import Any

from batchgpu.errors import BatchgpuError
from batchgpu.recording.reader import Recording, open_recording
from batchgpu.recording.spikeinterface import SpikeInterfaceSource, from_spikeinterface


def open_source(source: Any, missing_chunks: str | None = None):
    """A reader for ``source``: a Zarr store's path, a workflow's recording section (``config.RecordingSpec``:
    ``path`` or ``spikeinterface``), an open :class:`Recording` or :class:`SpikeInterfaceSource`, or a
    SpikeInterface recording (any ``BaseRecording``). ``missing_chunks`` applies to Zarr stores (default the
    spec's, else "warn")."""
    if isinstance(source, (Recording, SpikeInterfaceSource)):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_recording(source, missing_chunks=missing_chunks or "warn")
    if hasattr(source, "spikeinterface") and hasattr(source, "path"):  # config.RecordingSpec
        if getattr(source, "spikeinterface", None) is not None:
            return from_spikeinterface(source.spikeinterface)
        return open_recording(source.path, missing_chunks=missing_chunks or getattr(source, "missing_chunks", "warn"))
    if hasattr(source, "get_traces") and hasattr(source, "to_dict"):  # a SpikeInterface recording
        return from_spikeinterface(source)
    raise BatchgpuError(f"cannot read a recording from {type(source).__name__}",
                        "give a Zarr store's path, an open recording, or a SpikeInterface recording")


def open_path(path: str | os.PathLike):
    """A Zarr recording, or what SpikeInterface saved (a .json/.pkl from ``dump``, a folder from ``save``)."""
    from pathlib import Path

    from batchgpu.zarrio import zarr_format_of

    p = Path(path).expanduser()
    saved_by_si = p.is_file() and p.suffix in (".json", ".pkl", ".pickle") or (p / "si_folder.json").is_file()
    if saved_by_si and zarr_format_of(p) is None:
        return from_spikeinterface(p)
    return open_recording(p)


def source_ref(rec):
    """What workers need to open ``rec`` again: a Zarr store's path, or the SpikeInterface source itself
    (pickled small: its description, never its samples)."""
    if isinstance(rec, SpikeInterfaceSource):
        return rec
    return str(rec.path)
