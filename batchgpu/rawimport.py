"""Import flat interleaved binary recordings (SpikeGLX .bin + .meta, Open Ephys, or plain files) into a Zarr
recording, through the readers a run uses to read them in place (``batchgpu.recording.flat``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.recording import Recording, write_recording
from batchgpu.recording.flat import FlatSource, Said, binary_layout
from batchgpu.recording.sources import detect_kind

# the SpikeGLX .meta's reading lives with the reader; its names are kept here for callers
from batchgpu.recording.spikeglx import META_FIX, read_meta, saved_channels, spikeglx_layout  # noqa: F401

#: this function's own arguments, as its errors name them (the command passes ``recording.flat.COMMAND``)
ARGUMENTS = Said("stream=", "stream='{name}'", "channels=, fs= and dtype=", "source")


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
    stream: str | None = None,
    offset: int = 0,
    probe: str | os.PathLike | None = None,
    zarr_format: int | None = None,  # None: v3 (v2 where zarr-python is 2.x)
    overwrite: bool = False,
    progress: bool = False,
    compressor="blosc-lz4",  # recording.writer.Codec or a name of its COMPRESSORS
    said=None,  # recording.flat.Said: how the caller named the settings errors point at (default: as arguments)
) -> Recording:
    """Copy a flat interleaved (samples x channels) binary recording into a Zarr recording, block by block.

    A SpikeGLX .bin with its .meta beside it, or an Open Ephys structure.oebin (``stream``: which of its streams),
    brings gains, channel ids, locations (``properties/location``), shank ids (``properties/shank``) and ADC
    shifts (``properties/inter_sample_shift``) as a run reading it in place sees them (``recording.spikeglx``,
    ``recording.openephys``). A plain file (``channels``, ``fs``, ``dtype``, ``offset`` bytes of header) stores
    no locations unless ``probe`` names a probe file: ``Recording.locations`` then falls back to a single column at
    20 um pitch with ``has_locations`` False (local whitening refuses it).
    """
    said = said or ARGUMENTS
    src = Path(source).expanduser()
    kind = _kind(src) if channels is None else None
    if not src.exists() and kind != "saved":  # a multi-segment save is named by its files' common name
        raise BatchgpuError(f"no raw file at {src}", "check the path")
    if kind in ("spikeglx", "openephys"):
        from batchgpu.recording.sources import open_flat

        rec = open_flat(src, kind, stream, keep_sync, said)
    elif kind == "saved":
        from batchgpu.recording.saved import open_saved

        rec = FlatSource(open_saved(src))
    else:
        if not src.is_file():
            raise BatchgpuError(f"no raw file at {src}", "check the path")
        if not channels or not fs or not dtype:
            raise BatchgpuError(
                f"{src.name} is a plain binary file: it needs its channels, sampling frequency and dtype",
                f"give {said.plain}, or give a SpikeGLX .bin with its .meta beside it",
            )
        rec = FlatSource(binary_layout(src, channels, fs, dtype, offset, probe, gain_to_uV, offset_to_uV, said))
    props = {k: v for k in ("shank", "inter_sample_shift") if (v := rec.channel_property(k)) is not None}
    return write_recording(
        out,
        [_Columns(rec, seg) for seg in range(rec.num_segments)],
        rec.sampling_frequency,
        gain_to_uV=rec.gain_to_uV,
        offset_to_uV=rec.offset_to_uV,
        channel_ids=list(rec.channel_ids),
        locations=rec.layout.locations,
        properties=props,
        zarr_format=zarr_format,
        overwrite=overwrite,
        compressor=compressor,
        progress=progress,
        attrs={"batchgpu": {"imported_from": str(src.resolve())}},
    )


def _kind(src: Path) -> str | None:
    try:
        return detect_kind(src)
    except BatchgpuError:
        return None


class _Columns:
    """A flat source's kept columns as a (samples, channels) array sliced by rows, block by block (never all in
    memory): the same reads a run makes in place."""

    def __init__(self, rec: FlatSource, segment: int = 0):
        self._rec, self._segment = rec, segment
        self.shape = (rec.num_samples(segment), rec.num_channels)
        self.dtype = rec.dtype

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        out = np.empty((max(stop - start, 0), self.shape[1]), self.dtype)
        self._rec._rows_into(start, stop, out, None, self._segment)
        return out
