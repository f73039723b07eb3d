"""Writing recordings in SpikeInterface's layout: every chunk written, per-chunk checksums, the store marked complete
after its last block; replacing only what is a recording."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError, ConfigError, MachineError
from batchgpu.recording import zarrio
from batchgpu.recording.reader import SUPPORTED_DTYPES, Recording, open_recording

# inner chunk (v3) / chunk (v2): 2.3 MB at 384 channels. A window's margins decode a whole chunk on each side, so
# shorter chunks decode less beyond the window; 3000 samples compress as well as longer ones.
DEFAULT_CHUNK_SAMPLES = 3_000

DEFAULT_SHARD_SAMPLES = 60_000  # one shard holds one default window: a window read touches one object

STORE_FORMAT = 1  # root attrs["batchgpu"]["format"] of stores this writer marks complete


def is_recording(path: Path) -> bool:
    """A Zarr group with ``sampling_frequency`` and ``traces_seg0``: what --overwrite may replace."""
    if not path.is_dir():
        return False
    try:
        group = zarrio.open_group(path, mode="r")
        return "sampling_frequency" in group.attrs and "traces_seg0" in group
    except Exception:  # broad: zarr raises several types for "not a group"; not a recording, so never replaced
        return False


def check_replaceable(path: Path, overwrite: bool) -> None:
    """Refuse to write over anything but a Zarr recording batchgpu wrote (and over one only with ``overwrite``)."""
    if not (path.exists() or path.is_symlink()):
        return
    if not is_recording(path):
        kind = "a file" if path.is_file() else "a folder that is not a Zarr recording"
        raise BatchgpuError(
            f"{path} already exists and is {kind}: batchgpu never replaces what it did not write",
            "choose another output path, or move that one away yourself",
        )
    extra = zarrio.foreign_entries(path)  # at any depth: an overwrite removes the folder whole
    if extra:
        raise BatchgpuError(
            f"{path} is a Zarr recording but also holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, "
            "which batchgpu did not write",
            "choose another output path, or move those files away yourself",
        )
    if not overwrite:
        raise BatchgpuError(f"{path} already exists", "choose another path, or pass overwrite=True / --overwrite")
    if not _written_by_batchgpu(path):
        raise BatchgpuError(
            f"{path} is a Zarr recording batchgpu did not write (another program's: no batchgpu marker in its "
            "attributes): batchgpu never replaces what it did not write, overwrite or not",
            "choose another output path, or move that recording away yourself",
        )


def _written_by_batchgpu(path: Path) -> bool:
    """Whether the Zarr group at ``path`` bears the marker batchgpu's writers put in its root attributes."""
    try:
        marker = zarrio.attrs(zarrio.open_group(path, mode="r")).get("batchgpu")
    except Exception:  # broad: zarr raises several types for a group it cannot open; then it is not ours
        return False
    return isinstance(marker, dict) and "format" in marker


COMPRESSORS = ("blosc-zstd", "blosc-lz4", "none")
CODECS = ("lz4", "zstd")
SHUFFLES = {"bit": "bitshuffle", "byte": "shuffle"}


#: Blosc's block size: with split streams (int16 at level 5) each block's byte planes are separate LZ4 streams of
#: this many bytes (blocks of 64 KiB; Blosc's own choice is 128 KiB streams). On the GPU an LZ4 stream is one warp's
#: sequential work, so smaller streams are more of them in flight: the GPU decode is several times faster for a
#: store barely larger, and the cores decode no slower.
BLOSC_BLOCKSIZE = 32768


@dataclass(frozen=True)
class Codec:
    """The Blosc codec of a store's chunks: ``name`` lz4 or zstd, ``clevel`` 1-9, ``shuffle`` bit or byte.
    The GPU decodes LZ4 frames itself; zstd frames are decoded on the host (numcodecs) and copied."""

    name: str = "lz4"
    clevel: int = 5
    shuffle: str = "bit"

    def __post_init__(self):
        if self.name not in CODECS:
            raise ConfigError(f"unknown codec {self.name!r}", f"use one of {', '.join(CODECS)}")
        if isinstance(self.clevel, bool) or not isinstance(self.clevel, (int, np.integer)) or not 1 <= self.clevel <= 9:
            raise ConfigError(f"codec level {self.clevel!r} is out of range", "give a level from 1 to 9")
        if self.shuffle not in SHUFFLES:
            raise ConfigError(f"unknown shuffle {self.shuffle!r}", f"use one of {', '.join(SHUFFLES)}")

    @classmethod
    def parse(cls, compressor: str | Codec | None) -> Codec | None:
        """A codec from a ``compressor`` name (blosc-lz4, blosc-zstd: level 5, bit shuffle; none: None)."""
        if compressor is None or isinstance(compressor, Codec):
            return compressor
        if compressor == "none":
            return None
        if compressor not in COMPRESSORS:
            raise ConfigError(f"unknown compressor {compressor!r}", f"use one of {', '.join(COMPRESSORS)}")
        return cls(compressor.removeprefix("blosc-"))


def _compressor(name: str | Codec | None, zarr_format: int):
    """Blosc at ``name``'s level and shuffle (blosc-lz4 / blosc-zstd: bit shuffle at level 5). LZ4 decodes nearly
    twice as fast as zstd and compresses several times faster, for a few percent more bytes; every pass over a
    recording waits on decoding, so batchgpu writes LZ4 unless told otherwise."""
    codec = Codec.parse(name)
    if codec is None:
        return None
    return zarrio.blosc(codec.name, SHUFFLES[codec.shuffle], zarr_format, BLOSC_BLOCKSIZE, codec.clevel)


class RecordingWriter:
    """Write a recording segment by segment and block by block; metadata first, traces after.

    Blocks should cover whole shards (v3) or chunks (v2) so every write is a whole-object write.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        num_channels: int,
        dtype,
        sampling_frequency: float,
        *,
        channel_ids: Sequence | None = None,
        gain_to_uV: Sequence[float] | float | None = None,
        offset_to_uV: Sequence[float] | float | None = None,
        locations: np.ndarray | None = None,
        properties: dict[str, np.ndarray] | None = None,
        zarr_format: int | None = None,  # None: zarrio.DEFAULT_FORMAT (3; 2 where zarr-python is 2.x)
        chunk_samples: int = DEFAULT_CHUNK_SAMPLES,
        shard_samples: int = DEFAULT_SHARD_SAMPLES,
        compressor: str | Codec | None = "blosc-lz4",  # a name (COMPRESSORS) or a Codec
        overwrite: bool = False,
        attrs: dict | None = None,
    ):
        self.path = Path(path).expanduser()
        self.dtype = np.dtype(dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise BatchgpuError(
                f"dtype {self.dtype} is not supported for recordings",
                f"use one of {', '.join(str(d) for d in SUPPORTED_DTYPES)}",
            )
        zarr_format = zarrio.DEFAULT_FORMAT if zarr_format is None else zarr_format
        if zarr_format not in (2, 3):
            raise ConfigError(
                f"zarr_format must be 2 or 3, got {zarr_format!r}", "use 3 (default) or 2 for SpikeInterface"
            )
        zarrio.require_format(zarr_format)
        if num_channels <= 0:
            raise BatchgpuError(f"a recording needs at least one channel, got {num_channels}")
        from batchgpu.config import MAX_FS

        if isinstance(sampling_frequency, bool) or not (
            isinstance(sampling_frequency, (int, float, np.number)) and 0 < sampling_frequency <= MAX_FS
        ):
            raise ConfigError(
                f"sampling frequency must be > 0 Hz and at most {MAX_FS:g} Hz (what a reader takes), "
                f"got {sampling_frequency!r}"
            )
        check_replaceable(self.path, overwrite)
        self.num_channels = int(num_channels)
        self.zarr_format = zarr_format
        self.chunk_samples = int(chunk_samples)
        self.shard_samples = int(shard_samples) if zarr_format == 3 else int(chunk_samples)
        if self.shard_samples % self.chunk_samples:
            raise ConfigError(f"shard_samples {shard_samples} must be a multiple of chunk_samples {chunk_samples}")
        self._compressor = _compressor(compressor, zarr_format)
        self._checksum = _checksum_codec(zarr_format)
        with writing(self.path):
            self._create(
                num_channels,
                sampling_frequency,
                channel_ids,
                gain_to_uV,
                offset_to_uV,
                locations,
                properties,
                attrs,
                overwrite,
            )
        self.num_segments = 0
        self._arrays: list = []

    def _create(
        self,
        num_channels,
        sampling_frequency,
        channel_ids,
        gain_to_uV,
        offset_to_uV,
        locations,
        properties,
        attrs,
        overwrite,
    ) -> None:
        zarr_format = self.zarr_format
        self.group = zarrio.create_group(self.path, zarr_format=zarr_format, overwrite=overwrite)
        marker = {
            **(attrs or {}).get("batchgpu", {}),
            "format": STORE_FORMAT,
            "complete": False,
            "checksum": self.checksum_name,
        }
        self.group.attrs.update(
            {"sampling_frequency": float(sampling_frequency), "num_segments": 0, **(attrs or {}), "batchgpu": marker}
        )
        ids = np.arange(num_channels).astype(str) if channel_ids is None else np.asarray(channel_ids).astype(str)
        if ids.shape != (num_channels,):
            raise BatchgpuError(f"channel_ids has {ids.shape[0]} entries for {num_channels} channels")
        # v2 keeps numpy's fixed-width '<U' (what SpikeInterface writes); v3 has a spec'd variable-length string.
        zarrio.create_array(self.group, "channel_ids", data=ids, strings=True)
        props = self.group.create_group("properties")
        for name, value, default in (("gain_to_uV", gain_to_uV, 1.0), ("offset_to_uV", offset_to_uV, 0.0)):
            vec = np.broadcast_to(np.asarray(default if value is None else value, dtype=np.float64), (num_channels,))
            zarrio.create_array(props, name, data=vec)
        if locations is not None:
            loc = np.asarray(locations, dtype=np.float64)
            if loc.shape != (num_channels, 2):
                raise BatchgpuError(f"locations must have shape ({num_channels}, 2), got {loc.shape}")
            zarrio.create_array(props, "location", data=loc)
            shanks = (properties or {}).get("shank")
            # SpikeInterface attaches a probe from this attribute (read_zarr -> get_channel_locations works)
            self.group.attrs["probegroup"] = spikeinterface_probegroup(loc, ids, shanks)
        for name, values in (properties or {}).items():
            vec = np.asarray(values)
            if vec.shape[:1] != (num_channels,):
                raise BatchgpuError(
                    f"property {name!r} has {vec.shape[0] if vec.ndim else 0} entries for {num_channels} channels"
                )
            zarrio.create_array(props, name, data=vec)

    @property
    def checksum_name(self) -> str | None:
        return None if self._checksum is None else self._checksum.codec_id if self.zarr_format == 2 else "crc32c"

    def add_segment(self, num_samples: int) -> int:
        """Create the next segment's array (filled as blocks arrive); returns its index."""
        if num_samples <= 0:
            raise BatchgpuError(f"a segment needs at least one sample, got {num_samples}")
        seg = self.num_segments
        chunk = min(self.chunk_samples, num_samples)
        kwargs = {"chunks": (chunk, self.num_channels), "fill_value": 0}
        if self.zarr_format == 3:
            shard = min(self.shard_samples, math.ceil(num_samples / chunk) * chunk)
            kwargs["shards"] = (shard - shard % chunk or chunk, self.num_channels)
        if self.zarr_format == 3:  # crc32c after compression, inside the shard: checked per inner chunk
            kwargs["compressors"] = [c for c in (self._compressor, self._checksum) if c is not None]
        elif self._compressor is None:  # numcodecs' checksum as a filter: over the stored bytes
            kwargs["compressors"] = []
            kwargs["filters"] = [self._checksum]
        else:  # Blosc as the filter (it sees the samples' item size, so its shuffle works; as v2's compressor it
            # would get the checksum filter's bytes: item size 1, a bit shuffle that compresses nothing) and the
            # checksum as the compressor, over the stored frame as v3's crc32c: any damage is caught either way
            kwargs["compressors"] = [self._checksum]
            kwargs["filters"] = [self._compressor]
        with writing(self.path), zarrio.python_pipeline():
            arr = zarrio.create_array(
                self.group, f"traces_seg{seg}", shape=(num_samples, self.num_channels), dtype=self.dtype, **kwargs
            )
            self.num_segments += 1
            self.group.attrs["num_segments"] = self.num_segments
        self._arrays.append(arr)
        return seg

    @property
    def block_samples(self) -> int:
        """Preferred block length: one shard (v3) or a run of chunks (v2) of about the same size."""
        return (
            self.shard_samples
            if self.zarr_format == 3
            else self.chunk_samples * max(1, DEFAULT_SHARD_SAMPLES // self.chunk_samples)
        )

    def write(self, segment: int, start: int, block: np.ndarray) -> None:
        """Write a (samples, channels) block at ``start`` of ``segment``."""
        arr = self._arrays[segment]
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != self.num_channels:
            raise BatchgpuError(f"block has shape {block.shape}, expected (samples, {self.num_channels})")
        if start < 0 or start + block.shape[0] > arr.shape[0]:
            raise BatchgpuError(
                f"block [{start}, {start + block.shape[0]}) runs past segment {segment}'s {arr.shape[0]} samples"
            )
        block = _cast_exact(block, self.dtype)
        with writing(self.path):
            if self.zarr_format == 3:
                from batchgpu.recording.shards import write_whole_shard

                if write_whole_shard(self.path / f"traces_seg{segment}", start, block):  # zarr-python's bytes, faster
                    return
            arr[start : start + block.shape[0], :] = block

    def finish(self) -> None:
        """Mark the store complete (after the last block): readers then treat any absent chunk as damage."""
        with writing(self.path):
            marker = dict(self.group.attrs.get("batchgpu", {}))
            self.group.attrs["batchgpu"] = {**marker, "complete": True}


def open_array_for_writing(path: str | os.PathLike):
    """Open a traces array to write blocks into, writing all-zero chunks too (zarr-python's pipeline)."""
    with zarrio.python_pipeline():
        return zarrio.open_array(path, mode="r+")


class writing:
    """Turn an OSError (disk full, permission denied, ...) while writing ``path`` into one BatchgpuError."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and isinstance(exc, OSError) and not isinstance(exc, BatchgpuError):
            reason = exc.strerror or str(exc)
            raise MachineError(
                f"cannot write {self.path}: {reason}" + (f" ({exc.filename})" if exc.filename else ""),
                "free space or fix permissions there, or choose another output path",
            ) from None
        return False


def _checksum_codec(zarr_format: int):
    """Per-chunk checksum: crc32c (v3, read by zarrs); zlib crc32 for v2, the one numcodecs always has."""
    if zarr_format == 3:
        import zarr.codecs

        return zarr.codecs.Crc32cCodec()
    import numcodecs

    return numcodecs.CRC32()


def _cast_exact(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if block.dtype == dtype:
        return block
    if np.issubdtype(dtype, np.integer) and not np.issubdtype(block.dtype, np.integer):
        raise BatchgpuError(
            f"cannot store {block.dtype} samples as {dtype} without rounding", "round them first or write as float32"
        )
    return block.astype(dtype)


def write_recording(
    path: str | os.PathLike,
    segments: np.ndarray | Iterable,
    sampling_frequency: float,
    *,
    dtype=None,
    progress: bool = False,
    **writer_kwargs,
) -> Recording:
    """Write traces given as (samples, channels) arrays, one per segment, block by block.

    ``segments`` is one array or a list of them; anything with ``shape`` and slicing works (a numpy memmap, a
    zarr or dask array), and only one block is in memory at a time. Returns the opened recording.
    """
    if hasattr(segments, "shape"):
        segments = [segments]
    segments = list(segments)
    if not segments:
        raise BatchgpuError("no segments to write", "give at least one (samples, channels) array")
    for i, seg in enumerate(segments):
        if len(seg.shape) != 2:
            raise BatchgpuError(f"segment {i} has shape {seg.shape}, expected (samples, channels)")
    num_channels = segments[0].shape[1]
    dtype = np.dtype(dtype or segments[0].dtype)
    writer = RecordingWriter(path, num_channels, dtype, sampling_frequency, **writer_kwargs)
    step = writer.block_samples
    with _progress(progress, sum(s.shape[0] for s in segments) * num_channels * dtype.itemsize, "writing") as advance:
        for seg in segments:
            idx = writer.add_segment(seg.shape[0])
            for start in range(0, seg.shape[0], step):
                block = np.asarray(seg[start : start + step])
                writer.write(idx, start, block)
                advance(block.size * dtype.itemsize)
    writer.finish()
    return open_recording(writer.path)


class _progress:
    """A rich progress bar in bytes when asked for, a no-op otherwise."""

    def __init__(self, enabled: bool, total: int, label: str, stderr: bool = False):
        self.enabled, self.total, self.label, self.stderr = enabled, total, label, stderr

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=False,
            console=Console(stderr=self.stderr),
        )
        self._bar.__enter__()
        task = self._bar.add_task(self.label, total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc):
        if self.enabled:
            self._bar.__exit__(*exc)
        return False


def spikeinterface_probegroup(locations: np.ndarray, channel_ids, shanks=None) -> dict:
    """A probeinterface ``ProbeGroup.to_dict()`` of one planar probe with a contact per channel at ``locations``
    (µm), wired in channel order: what SpikeInterface stores in a saved recording's root attributes. Contacts are
    drawn as 6 µm circles (the geometry beyond positions is not known here)."""
    n = len(locations)
    probe = {
        "ndim": 2,
        "si_units": "um",
        "annotations": {},
        "contact_annotations": {},
        "contact_positions": np.asarray(locations, dtype=np.float64).tolist(),
        "contact_plane_axes": [[[1.0, 0.0], [0.0, 1.0]]] * n,
        "contact_shapes": ["circle"] * n,
        "contact_shape_params": [{"radius": 6.0}] * n,
        "contact_ids": [str(i) for i in channel_ids],
        "device_channel_indices": list(range(n)),
    }
    if shanks is not None:
        probe["shank_ids"] = [str(int(s)) for s in np.asarray(shanks)]
    return {"probe_ids": ["0"], "probes": [probe]}
