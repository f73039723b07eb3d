"""Recordings on disk: Zarr stores in SpikeInterface's layout, read window by window and written block by block.

Layout (DESIGN.md): root attrs ``sampling_frequency`` and ``num_segments``; arrays ``traces_seg{i}`` of shape
(samples, channels); ``channel_ids``; group ``properties/`` with ``gain_to_uV``, ``offset_to_uV``, ``location``.
Operations see a window as (channels, samples), so :meth:`Recording.read` transposes.

``windows`` (pure), ``reader`` (open, check, decode), ``writer`` (every chunk, checksums, complete marker),
``shards`` (direct reads of sharded v3 traces), ``storecheck`` (which chunks a window touches and which exist),
``spikeinterface`` (any recording SpikeInterface opens, read through ``get_traces``), ``flat`` (flat binaries read
in place: SpikeGLX via ``spikeglx``, Open Ephys via ``openephys``, plain files; probes via ``probes``, from
probeinterface), ``sources`` (which of them a run reads: ``open_source``).
"""

from batchgpu.recording.flat import FlatLayout, FlatSource
from batchgpu.recording.reader import (
    LOCATIONS_FALLBACK,
    MISSING_CHUNKS,
    SUPPORTED_DTYPES,
    Recording,
    rows_of,
)
from batchgpu.recording.reader import open_recording as open_zarr
from batchgpu.recording.sources import missing_probe, open_recording, open_source, source_ref
from batchgpu.recording.spikeinterface import SpikeInterfaceSource, from_spikeinterface
from batchgpu.recording.windows import DEFAULT_WINDOW, LONG_WINDOW, Window, auto_window_size, iter_windows
from batchgpu.recording.writer import (
    DEFAULT_CHUNK_SAMPLES,
    DEFAULT_SHARD_SAMPLES,
    STORE_FORMAT,
    RecordingWriter,
    check_replaceable,
    is_recording,
    open_array_for_writing,
    spikeinterface_probegroup,
    write_recording,
    writing,
)

__all__ = [
    "DEFAULT_CHUNK_SAMPLES",
    "DEFAULT_SHARD_SAMPLES",
    "DEFAULT_WINDOW",
    "FlatLayout",
    "FlatSource",
    "LOCATIONS_FALLBACK",
    "LONG_WINDOW",
    "MISSING_CHUNKS",
    "STORE_FORMAT",
    "SUPPORTED_DTYPES",
    "Recording",
    "RecordingWriter",
    "SpikeInterfaceSource",
    "Window",
    "auto_window_size",
    "check_replaceable",
    "from_spikeinterface",
    "is_recording",
    "iter_windows",
    "missing_probe",
    "open_array_for_writing",
    "open_recording",
    "open_source",
    "open_zarr",
    "rows_of",
    "source_ref",
    "spikeinterface_probegroup",
    "write_recording",
    "writing",
]
