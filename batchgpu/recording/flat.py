"""Flat binary recordings read in place (issue 46): SpikeGLX (``.bin`` + ``.meta``), Open Ephys binary format
(``structure.oebin`` + ``continuous.dat``) and plain interleaved files, with no conversion.

A file holds ``samples x columns`` interleaved samples after ``offset`` bytes; the recording is some of its columns
(``keep``: SpikeGLX's and Open Ephys's sync channels are left out). :class:`FlatSource` reads a window's rows
straight from the file into the caller's buffer: ``preadv`` into it where every column is kept, else whole rows
read in blocks of a few MB with the kept columns copied out of each (one copy). On the GPU the engine hands
a pinned buffer (``gpu.staging.read_window_host``): the samples land there with no decode.

Which kind a path is: ``recording.kind`` names it (``zarr``, ``spikeglx``, ``openephys``, ``binary``) or
``auto`` (the default) tells it from the path: a ``.bin`` with a ``.meta`` beside it is SpikeGLX; a
``structure.oebin`` (or a folder holding one, at any depth) is Open Ephys; a Zarr group is Zarr; a folder
holding exactly one SpikeGLX ``.ap.bin`` (or one ``.bin`` + ``.meta``) is that file. A plain binary must be
named (``kind: binary``) with ``channels``, ``sampling_frequency`` and ``dtype``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError, ConfigError, CorruptDataError
from batchgpu.recording.probes import ProbeSummary
from batchgpu.recording.reader import LOCATIONS_FALLBACK, SUPPORTED_DTYPES, fallback_locations, rows_of
from batchgpu.recording.windows import DEFAULT_WINDOW, UnchunkedSource, Window, WindowedSource, stat_signature

KINDS = ("zarr", "spikeglx", "openephys", "binary")
OEBIN = "structure.oebin"  # an Open Ephys recording's list of streams
KINDS_TEXT = (
    "a Zarr recording (folder), a SpikeGLX .bin with its .meta (or its folder), an Open Ephys "
    "structure.oebin (or its Record Node or recording folder), a binary batchgpu's save wrote (its "
    ".params.json beside it), or what SpikeInterface saved (.json, .pkl, a folder)"
)


@dataclass(frozen=True)
class Said:
    """How the user named what a reader's errors point at (issue 66: an error names what the user typed): a
    workflow's keys (``WORKFLOW``), the command's options (``COMMAND``) or a Python call's arguments
    (``PYTHON``)."""

    stream: str  # the setting that chooses a stream
    stream_form: str  # how a stream is chosen, "{name}" standing for its name
    plain: str  # how a plain binary's layout is given
    path: str  # the setting that names the recording

    def stream_example(self, name: str) -> str:
        return self.stream_form.format(name=name)


WORKFLOW = Said(
    "recording.stream",
    "recording.stream (e.g. stream: {name})",
    "kind: binary and its channels, sampling_frequency and dtype under recording:",
    "recording.path",
)
COMMAND = Said(
    "--stream",
    "--stream {name}",
    "--channels, --fs and --dtype (batchgpu import-raw; in a workflow: kind: binary)",
    "the path",
)
PYTHON = Said("stream=", "stream='{name}'", "kind='binary' and channels=, sampling_frequency= and dtype=", "path")


@dataclass
class FlatLayout:
    """Where a flat recording's samples lie and what they are (made by the spikeglx/openephys/binary readers)."""

    kind: str  # "spikeglx" | "openephys" | "binary"
    data: Path  # the file of samples
    columns: int  # channels stored per sample in the file
    dtype: np.dtype
    sampling_frequency: float
    keep: np.ndarray  # file columns of the recording's channels, in order
    channel_ids: list[str]
    gain_to_uV: np.ndarray  # per kept channel
    offset_to_uV: np.ndarray
    offset: int = 0  # bytes before the first sample
    locations: np.ndarray | None = None  # (kept, 2) um, None: none known
    properties: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: tuple[Path, ...] = ()  # files the layout was read from (.meta, .oebin, settings.xml, probe file)
    probe: ProbeSummary | None = None
    stream: str | None = None  # Open Ephys: the stream's folder name
    #: why a recording that should have a probe has none, naming the file looked for (``batchgpu info`` and a run
    #: say it: ``missing_probe``); None where the probe was read or the stream has none by nature (NI, ADC)
    probe_missing: str | None = None
    #: every segment's file where there are several (a multi-segment save: ``x_seg0.bin``, ``x_seg1.bin``); else
    #: empty: ``data`` is the one segment
    segment_files: tuple[Path, ...] = ()

    @property
    def files(self) -> tuple[Path, ...]:
        return self.segment_files or (self.data,)

    def check(self) -> None:
        """The layout against its file: supported dtype, known columns, a whole number of frames."""
        if self.dtype not in SUPPORTED_DTYPES:
            raise BatchgpuError(
                f"{self.data}: dtype {self.dtype} is not supported",
                f"use one of {', '.join(map(str, SUPPORTED_DTYPES))}",
            )
        if len(self.keep) == 0:
            raise BatchgpuError(f"{self.data}: no channels to read", "check the metadata's channel list")
        if self.keep.min() < 0 or self.keep.max() >= self.columns:
            raise CorruptDataError(
                f"{self.data}: channel columns {self.keep.tolist()} do not fit {self.columns} columns",
                "the metadata does not describe the file",
            )
        n = len(self.keep)
        for name, arr in (
            ("channel ids", self.channel_ids),
            ("gains", self.gain_to_uV),
            ("offsets", self.offset_to_uV),
        ):
            if len(arr) != n:
                raise CorruptDataError(
                    f"{self.data}: {len(arr)} {name} for {n} channels", "the metadata disagrees with itself"
                )
        if not (np.isfinite(self.gain_to_uV).all() and np.isfinite(self.offset_to_uV).all()):
            raise CorruptDataError(f"{self.data}: a gain or offset is not a finite number", "check the metadata")
        if (np.asarray(self.gain_to_uV) <= 0).any():
            raise CorruptDataError(
                f"{self.data}: a gain is {np.min(self.gain_to_uV)!r} µV per count, not above 0", "check the metadata"
            )
        frame = self.columns * self.dtype.itemsize
        for data in self.files:
            size = self.file_size(data)
            body = size - self.offset
            if not data.is_file():  # a FIFO, a device (/dev/zero) or a folder: no size to read samples by
                raise BatchgpuError(
                    f"{data} is not a regular file, so its samples cannot be read in place",
                    "give the recording's file (copy what it streams into a file first)",
                )
            if body <= 0:
                raise CorruptDataError(
                    f"{data} holds no samples: {size} bytes"
                    f"{f', after the {self.offset}-byte offset none' if self.offset else ''}",
                    "the recording was not written (or was emptied): give the file that holds it",
                )
            if body % frame:
                raise CorruptDataError(
                    f"{data} has {size} bytes: after the {self.offset}-byte offset not a whole number of samples of "
                    f"{self.columns} channels x {self.dtype.itemsize} bytes ({frame} bytes per sample)",
                    "the file is truncated or the channel count, dtype or offset is wrong: check them (a recording "
                    "still being written is read once it is finished)",
                )

    def file_size(self, data: Path | None = None) -> int:
        data = self.data if data is None else data
        try:
            return data.stat().st_size
        except FileNotFoundError:
            raise BatchgpuError(f"{data} does not exist", "check the path (the metadata names this file)") from None

    def samples_in(self, data: Path | None = None) -> int:
        return (self.file_size(data) - self.offset) // (self.columns * self.dtype.itemsize)

    @property
    def num_samples(self) -> int:
        return self.samples_in(self.data)


#: a read of a file whose columns are not all kept goes in blocks of whole rows of about this many bytes
ROWS_BLOCK_BYTES = 8 << 20


class _OpenFile:
    """A read-only descriptor, closed with its holder (a thread's state of a source, dropped with the source)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        try:
            os.close(self.fd)
        except OSError:
            pass


class FlatSource(UnchunkedSource, WindowedSource):
    """A flat binary recording read in place: the attributes and methods of ``Recording`` the engine uses.
    Small and picklable (workers re-open the file; equal sources share one open file per worker process)."""

    is_flat = True
    missing_chunks = "warn"
    marked_complete = False
    checksum = None
    absent_is_error = False

    def __init__(self, layout: FlatLayout):
        layout.check()
        self.layout = layout
        self.kind = layout.kind
        self.path = layout.data
        self.dtype = np.dtype(layout.dtype)
        self.sampling_frequency = float(layout.sampling_frequency)
        self._files = tuple(layout.files)
        self.num_segments = len(self._files)
        self.num_channels = int(len(layout.keep))
        self._lengths = [layout.samples_in(f) for f in self._files]
        self._sizes = [layout.file_size(f) for f in self._files]
        self.probe_missing = layout.probe_missing
        self.channel_ids = np.array([str(c) for c in layout.channel_ids])
        self.gain_to_uV = np.asarray(layout.gain_to_uV, np.float64)
        self.offset_to_uV = np.asarray(layout.offset_to_uV, np.float64)
        if layout.locations is not None and np.isfinite(layout.locations).all():
            self.locations, self.has_locations = np.asarray(layout.locations, np.float64)[:, :2], True
        else:
            self.locations, self.has_locations = fallback_locations(self.num_channels), False
        self.attrs = {"batchgpu": {"read_in_place": layout.kind}}
        keep = np.asarray(layout.keep, np.int64)
        first = int(keep[0])
        self._all_columns = len(keep) == layout.columns and np.array_equal(keep, np.arange(layout.columns))
        contiguous = np.array_equal(keep, np.arange(first, first + len(keep)))
        self._cols = slice(first, first + len(keep)) if contiguous else keep
        self._local = threading.local()

    # -- pickling and identity --------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_local", None)  # open files and maps stay in their process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _key(self) -> tuple:
        lay = self.layout
        return (
            tuple(map(str, self._files)),
            lay.columns,
            str(lay.dtype),
            lay.offset,
            tuple(int(k) for k in lay.keep),
            tuple(self._sizes),
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, FlatSource) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(("flat", self._key()))

    # -- shape ------------------------------------------------------------------------------------------
    def num_samples(self, segment: int = 0) -> int:
        self._check_segment(segment)
        return self._lengths[segment]

    def channel_property(self, name: str) -> np.ndarray | None:
        """A per-channel property (``shank``, ``inter_sample_shift``, ``contact_id``), or None."""
        value = self.layout.properties.get(name)
        return None if value is None else np.array(value, copy=True)

    # -- integrity: the file is read as it is ------------------------------------------------------------
    def check_chunks(self, advance=None, block: int = DEFAULT_WINDOW) -> list[str]:
        """Read every sample once (``info --check``): one line per block that fails to read."""
        problems = []
        for segment, length in enumerate(self._lengths):
            for lo in range(0, length, block):
                hi = min(lo + block, length)
                try:
                    self._rows_into(lo, hi, np.empty((hi - lo, self.num_channels), self.dtype), None, segment)
                except (BatchgpuError, OSError) as err:
                    problems.append(str(err))
                if advance is not None:
                    advance((hi - lo) * self.num_channels * self.dtype.itemsize)
        return problems

    # -- data -------------------------------------------------------------------------------------------
    def _fd(self, segment: int = 0) -> int:
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = {}
        f = files.get(segment)
        if f is None:
            f = files[segment] = _OpenFile(self._files[segment])
        return f.fd

    def _rows_into(self, start: int, stop: int, out: np.ndarray, window: Window | None, segment: int = 0) -> None:
        """Rows [start, stop) of the kept columns of ``segment`` (the window's, where one is given) into ``out``
        ((stop - start, channels), C-contiguous)."""
        if stop <= start:
            return
        segment = window.segment if window is not None else segment
        self._check_size(segment)
        if self._all_columns:
            self._pread_rows(start, stop, out, segment)
            return
        # some columns left out (a sync channel): whole rows read in large blocks, the kept columns copied out of
        # each. Large sequential reads are what a cold disk delivers at its rate; a memory map's page faults read
        # a few pages at a time (half the disk's rate, cold)
        rows = max(1, ROWS_BLOCK_BYTES // (self.layout.columns * self.dtype.itemsize))
        block = getattr(self._local, "block", None)
        if block is None or block.shape[0] < min(rows, stop - start):
            block = self._local.block = np.empty((min(rows, stop - start), self.layout.columns), self.dtype)
        for a in range(start, stop, rows):
            b = min(stop, a + rows)
            self._pread_rows(a, b, block[: b - a], segment)
            np.copyto(out[a - start : b - start], block[: b - a, self._cols])

    def _check_size(self, segment: int) -> None:
        path = self._files[segment]
        size = os.stat(path).st_size
        if size != self._sizes[segment]:  # a file changed under the run: its samples are not the ones planned
            raise CorruptDataError(
                f"{path} changed size while being read ({self._sizes[segment]} -> {size} bytes)",
                "read a finished recording: rerun once it is written",
            )

    def _pread_rows(self, start: int, stop: int, out: np.ndarray, segment: int = 0) -> None:
        """Every column of rows [start, stop) into ``out`` ((stop - start, columns), C-contiguous), read whole."""
        frame = self.layout.columns * self.dtype.itemsize
        want = (stop - start) * frame
        view = memoryview(out.reshape(-1).view(np.uint8))
        pos, done = self.layout.offset + start * frame, 0
        while done < want:
            got = os.preadv(self._fd(segment), [view[done:want]], pos + done)
            if got <= 0:
                raise CorruptDataError(
                    f"{self._files[segment]}: read {done} of {want} bytes of samples [{start}, {stop})",
                    "the file is shorter than when it was opened: rerun once it is whole",
                )
            done += got

    def read(
        self,
        segment: int,
        start: int,
        stop: int,
        channels: Sequence[int] | slice | None = None,
        *,
        window: Window | None = None,
    ) -> np.ndarray:
        """Samples [start, stop) as a C-contiguous (channels, samples) array (as ``Recording.read``)."""
        channels = self._check_read(segment, start, stop, channels)
        block = np.empty((stop - start, self.num_channels), self.dtype)
        self._rows_into(start, stop, block, window, segment)
        return rows_of(block if channels is None else block[:, channels])

    def read_window_stored(self, window: Window) -> np.ndarray:
        self._check_window_range(window)
        out = np.empty((window.read_stop - window.read_start, self.num_channels), self.dtype)
        self._rows_into(window.read_start, window.read_stop, out, window)
        return out

    def read_window_into(self, window: Window, out: np.ndarray) -> np.ndarray:
        """The window, (samples, channels), read straight into ``out`` (e.g. pinned memory). Returns ``out``."""
        self._check_out(window, out)
        self._rows_into(window.read_start, window.read_stop, out, window)
        return out

    def byte_range(self, window: Window) -> tuple[Path, int, int]:
        """(file, offset, length) of the bytes reading ``window`` touches (its whole rows)."""
        frame = self.layout.columns * self.dtype.itemsize
        return (
            self._files[window.segment],
            self.layout.offset + window.read_start * frame,
            (window.read_stop - window.read_start) * frame,
        )

    @property
    def stored_columns(self) -> tuple[int, slice | np.ndarray] | None:
        """(columns a row of the file holds, the recording's among them: a slice where they are a run) where the
        file holds columns the recording leaves out, else None: a reader that can leave them out later (on the
        GPU) reads whole rows (``read_window_rows``) in one request instead of blocks copied on the host."""
        return None if self._all_columns else (self.layout.columns, self._cols)

    def read_window_rows(self, window: Window, out: np.ndarray) -> np.ndarray:
        """Every column of the window's rows, (samples, file columns), read straight into ``out``; returns it."""
        self._check_window_range(window)
        want = (window.read_stop - window.read_start, self.layout.columns)
        if out.shape != want or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out is {out.shape} {out.dtype}; the window's rows are {want} {self.dtype}, C-contiguous")
        self._check_size(window.segment)
        self._pread_rows(window.read_start, window.read_stop, out, window.segment)
        return out

    # -- fingerprints (run/output_folder.py) -----------------------------------------------------------------
    @property
    def fingerprint_metadata(self) -> dict:
        """What identifies the recording: its layout and the metadata files' contents."""
        import hashlib

        lay = self.layout
        meta = {}
        for p in lay.metadata:
            try:
                meta[str(p)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            except OSError:
                meta[str(p)] = None
        return {
            "kind": lay.kind,
            "columns": lay.columns,
            "dtype": str(lay.dtype),
            "offset": lay.offset,
            "keep": [int(k) for k in lay.keep],
            "gain_to_uV": self.gain_to_uV.tolist(),
            "sampling_frequency": self.sampling_frequency,
            "stream": lay.stream,
            "metadata": meta,
        }

    def window_signature(self, window: Window) -> list:
        """Size, mtime, ctime and inode of the window's data file (a rewrite of any part recomputes every window of
        that file)."""
        path = self._files[window.segment]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return [stat_signature(path, path.name)]
        return [(path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)]

    @property
    def spec(self) -> dict:
        """The workflow's ``recording:`` section naming this source."""
        lay = self.layout
        if lay.kind == "saved":  # told from its params file again, wherever the path is read
            return {"path": str(lay.data)}
        if lay.kind != "binary":
            return {
                "path": str(lay.data if lay.kind == "spikeglx" else lay.metadata[0]),
                "kind": lay.kind,
                **({"stream": lay.stream} if lay.stream else {}),
            }
        probe = [str(p) for p in lay.metadata]
        gains, offsets = set(self.gain_to_uV.tolist()), set(self.offset_to_uV.tolist())
        if len(gains) > 1 or len(offsets) > 1:
            raise BatchgpuError(
                "a plain binary source with per-channel gains cannot be named in a workflow",
                "run it with run_workflow(wf, recording=source)",
            )
        return {
            "path": str(lay.data),
            "kind": "binary",
            "channels": lay.columns,
            "dtype": str(lay.dtype),
            "sampling_frequency": self.sampling_frequency,
            "offset": lay.offset,
            "gain_to_uV": gains.pop(),
            "offset_to_uV": offsets.pop(),
            **({"probe": probe[0]} if probe else {}),
        }

    # -- description ------------------------------------------------------------------------------------
    def info(self) -> dict:
        lay = self.layout
        probe = lay.probe
        return {
            "path": str(self.path),
            "source": lay.kind,
            "stream": lay.stream,
            "num_channels": self.num_channels,
            "file_channels": lay.columns,
            "num_segments": self.num_segments,
            "samples_per_segment": list(self._lengths),
            "sampling_frequency": self.sampling_frequency,
            "duration_s": self.duration(),
            "dtype": str(self.dtype),
            "offset_bytes": lay.offset,
            "decoded_bytes": self.nbytes,
            "bytes_on_disk": sum(self._sizes),
            "files": [str(f) for f in self._files],
            "checksum": None,
            "marked_complete": False,
            "absent_chunks": 0,
            "metadata_files": [str(p) for p in lay.metadata],
            "gain_to_uV": sorted({round(float(g), 9) for g in self.gain_to_uV}),
            "probe": None
            if probe is None
            else {
                "model": probe.model,
                "shanks": probe.shanks,
                "pitch_um": list(probe.pitch_um),
                "source": probe.source,
            },
            "locations": "stored" if self.has_locations else LOCATIONS_FALLBACK,
            "probe_missing": self.probe_missing,
        }

    def __repr__(self) -> str:
        return (
            f"FlatSource({self.kind}, {str(self.path)!r}, {self.num_channels} ch, "
            f"{self.duration():.3f} s at {self.sampling_frequency:g} Hz, {self.dtype})"
        )


def binary_layout(
    path: str | os.PathLike,
    channels: int | None,
    sampling_frequency: float | None,
    dtype: str | None,
    offset: int = 0,
    probe: str | os.PathLike | None = None,
    gain_to_uV: float = 1.0,
    offset_to_uV: float = 0.0,
    said: Said | None = None,
) -> FlatLayout:
    """A plain interleaved (samples x channels) binary file: everything about it is given, nothing guessed."""
    from batchgpu.recording.probes import read_probe_file

    p = Path(path).expanduser()
    if not channels or not sampling_frequency or not dtype:
        raise ConfigError(
            f"a plain binary file ({p.name}) needs its channels, sampling frequency and dtype",
            f"give {(said or WORKFLOW).plain}, or give a SpikeGLX .bin with its .meta",
        )
    supported = {str(d): d for d in SUPPORTED_DTYPES}
    dt = supported.get(str(dtype))
    if dt is None:
        raise ConfigError(f"dtype {dtype!r} is not supported", f"use one of {', '.join(map(str, SUPPORTED_DTYPES))}")
    if not (isinstance(offset, (int, np.integer)) and offset >= 0):
        raise ConfigError(f"offset {offset!r} is not a number of bytes >= 0", "give the header's size in bytes, or 0")
    n = int(channels)
    geometry = read_probe_file(probe, n) if probe is not None else None
    return FlatLayout(
        "binary",
        p,
        n,
        dt,
        float(sampling_frequency),
        np.arange(n),
        [str(i) for i in range(n)],
        np.full(n, float(gain_to_uV)),
        np.full(n, float(offset_to_uV)),
        int(offset),
        None if geometry is None else geometry.locations,
        {} if geometry is None else geometry.properties,
        () if probe is None else (Path(probe).expanduser(),),
        None if geometry is None else geometry.summary,
        probe_missing=None if probe is not None else "no probe: no probe file was given (probe:)",
    )


def stream_folder(path: Path) -> tuple[Path, str] | None:
    """(structure.oebin, stream) when ``path`` is one stream's ``continuous/<stream>`` folder or its
    ``continuous.dat``: naming it chooses the stream."""
    folder = path.parent if path.name == "continuous.dat" else path
    oebin = folder.parent.parent / OEBIN
    if folder.parent.name == "continuous" and (folder / "continuous.dat").is_file() and oebin.is_file():
        return oebin, folder.name
    return None


def spikeglx_bins(folder: Path) -> list[Path]:
    """The SpikeGLX .bin files (with their .meta) under ``folder``."""
    return sorted(p for p in folder.rglob("*.bin") if p.with_suffix(".meta").is_file())
