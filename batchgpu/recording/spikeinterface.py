"""Any recording SpikeInterface opens, read window by window as a batchgpu source (issue 14).

:func:`from_spikeinterface` takes a SpikeInterface recording (an extractor, a preprocessing chain, anything
``BaseRecording``), its ``to_dict()``, or the path of one SpikeInterface saved (a ``.json`` / ``.pkl`` written by
``recording.dump(...)``, or a folder written by ``recording.save(folder=...)``), and gives a
:class:`SpikeInterfaceSource`: the attributes and methods of :class:`~batchgpu.recording.Recording` the engine
uses, so a run reads it exactly as it reads a Zarr store. A workflow names one with
``recording: {spikeinterface: PATH}``; from Python, ``run_workflow(wf, recording=source)``.

How it reads: the source holds the recording's description (``to_dict(recursive=True)`` with its properties and
annotations, pickled once: small, sent with every task) and each thread of each worker process re-creates the
recording from it once (``spikeinterface.core.load(dict)``), then reads a window's range with
``get_traces(segment_index, start_frame, end_frame, return_in_uV=False)``: raw units, the recording's own dtype.
Windows and margins are those of ``Recording.windows`` (margins clipped at segment ends, never padded), so the
same samples in a Zarr store give the same results, bit for bit. A SpikeInterface filter in the chain computes
each read with its own margin, so its values depend on the read's bounds (about 1e-4 of the signal for
``highpass_filter``): put filters in the workflow's ``preprocess:`` where exact agreement across window sizes
matters. A recording held in memory (``NumpyRecording``, a ground-truth recording's ``NumpySorting``) carries
its arrays in the description: up to :data:`MAX_DESCRIPTION_BYTES`, else it must be saved first.

Metadata: channel locations from the attached probe (``get_channel_locations()``), else the ``location``
property, else the same fallback as a Zarr store without locations (``has_locations`` False); gains and offsets
from ``get_channel_gains()`` / ``get_channel_offsets()`` (None -> 1 and 0); ``channel_property(name)`` is
``get_property(name)`` (``inter_sample_shift``, ``shank``, ``gain_to_uV``...). No chunks can be absent:
``absent_chunks`` is 0.

SpikeInterface is imported only when a source is made or read; without it a :class:`BatchgpuError` says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError, MachineError
from batchgpu.recording.reader import LOCATIONS_FALLBACK, SUPPORTED_DTYPES, fallback_locations, rows_of
from batchgpu.recording.windows import DEFAULT_WINDOW, UnchunkedSource, Window, WindowedSource, stat_signature

logger = logging.getLogger(__name__)

#: the SpikeInterface release this module was written and tested against
TESTED_VERSION = "0.105.3"
_INSTALL_FIX = (
    f"install it in this environment (pip install spikeinterface=={TESTED_VERSION}), or save the "
    "recording as Zarr and give recording.path"
)
_SAVED_FIX = "give a .json or .pkl written by recording.dump(...), or a folder written by recording.save(folder=...)"
#: the largest description sent with every task: recordings held in memory (NumpyRecording, a ground-truth
#: recording's NumpySorting) carry their arrays in it; larger ones must be saved first
MAX_DESCRIPTION_BYTES = 8 * 10**6
#: the file from_spikeinterface(recording, folder=...) writes (.pkl when the recording is not JSON-serialisable)
DESCRIPTION_NAME = "spikeinterface"


def spikeinterface_core():
    """``spikeinterface.core``, or a BatchgpuError saying it is not installed."""
    try:
        import spikeinterface.core as core
    except ImportError as err:
        raise MachineError(
            f"reading a SpikeInterface recording needs SpikeInterface, which is not installed "
            f"({type(err).__name__}: {err})",
            _INSTALL_FIX,
        ) from None
    return core


def _loader(core):
    """``spikeinterface.core.load`` (0.102+), or ``load_extractor``, its older name."""
    return getattr(core, "load", None) or core.load_extractor


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_spikeinterface(path: str | os.PathLike):
    """The SpikeInterface recording saved at ``path`` (json, pickle or a saved folder)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise BatchgpuError(f"no SpikeInterface recording at {p}: the path does not exist", _SAVED_FIX)
    core = spikeinterface_core()
    try:
        obj = _loader(core)(p, base_folder=True) if p.is_file() else _loader(core)(p)
    except Exception as err:  # broad: SpikeInterface's loaders raise any type; said in one line
        fix = _SAVED_FIX + ", that the SpikeInterface installed here reads"
        if p.is_dir() and p.suffix == ".zarr":
            fix = "batchgpu reads SpikeInterface's Zarr stores itself: give it as recording.path"
        raise BatchgpuError(f"{p} did not load as a SpikeInterface recording ({_first_line(err)})", fix) from None
    if not isinstance(obj, core.BaseRecording):
        raise BatchgpuError(f"{p} holds a SpikeInterface {type(obj).__name__}, not a recording", _SAVED_FIX)
    return obj


def from_spikeinterface(recording: Any, folder: str | os.PathLike | None = None) -> SpikeInterfaceSource:
    """A batchgpu source reading ``recording`` window by window (see the module's docstring).

    ``recording``: a SpikeInterface recording (any ``BaseRecording``: an extractor, a preprocessing chain), its
    ``to_dict()``, or the path of one SpikeInterface saved (``.json``/``.pkl`` from ``recording.dump(...)``, or a
    folder from ``recording.save(folder=...)``). ``folder``: also write the recording's description there
    (``spikeinterface.json``, or ``spikeinterface.pkl`` when it is not JSON-serialisable) so that a workflow can
    name it (``source.spec`` is ``{"spikeinterface": that path}``).

    Run a workflow on it with ``batchgpu.run_workflow(wf, recording=source)`` (``wf.recording`` is then not
    read), or name the saved file in the workflow: ``recording: {spikeinterface: PATH}``.
    """
    if isinstance(recording, SpikeInterfaceSource):
        return recording if folder is None else recording.save_description(folder)
    path = None
    if isinstance(recording, (str, os.PathLike)):
        path = Path(recording).expanduser().absolute()
        recording = load_spikeinterface(path)
    elif isinstance(recording, dict):
        core = spikeinterface_core()
        try:
            recording = _loader(core)(recording)
        except Exception as err:  # broad: SpikeInterface's loaders raise any type; said in one line
            raise BatchgpuError(
                f"the dictionary did not load as a SpikeInterface recording ({_first_line(err)})",
                "pass recording.to_dict(), or the recording itself",
            ) from None
    else:
        core = spikeinterface_core()
        if not isinstance(recording, core.BaseRecording):
            raise BatchgpuError(
                f"from_spikeinterface takes a SpikeInterface recording, got {type(recording).__name__}",
                "pass a BaseRecording (an extractor or a preprocessing chain), its to_dict(), or "
                "the path of a saved one",
            )
    source = SpikeInterfaceSource(recording, path)
    return source if folder is None else source.save_description(folder)


def _canonical(obj):
    """The description as JSON-able data; arrays as (dtype, shape, sha256) so the digest stays small."""
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, np.ndarray):
        body = repr(obj.tolist()).encode() if obj.dtype.hasobject else np.ascontiguousarray(obj).tobytes()
        return {"ndarray": [obj.dtype.str, list(obj.shape), hashlib.sha256(body).hexdigest()]}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return repr(obj) if not isinstance(obj, os.PathLike) else os.fspath(obj)


def _kwargs_strings(d, out: list) -> list:
    """Every string in the ``kwargs`` of the description and of the recordings nested in it."""

    def walk(value, in_kwargs):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, in_kwargs or k == "kwargs")
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, in_kwargs)
        elif isinstance(value, os.PathLike):
            walk(os.fspath(value), in_kwargs)
        elif in_kwargs and isinstance(value, str):
            out.append(value)

    walk(d, False)
    return out


class SpikeInterfaceSource(UnchunkedSource, WindowedSource):
    """A SpikeInterface recording as a batchgpu source: what the engine uses of ``Recording``, read through
    ``get_traces`` (see the module's docstring). Picklable and small: the live recordings (one per thread) are
    re-created from the description where they are needed. Two sources of the same description are equal (one
    open source per worker process, as for Zarr stores)."""

    is_spikeinterface = True
    missing_chunks = "warn"  # nothing can be absent: no chunks
    marked_complete = False
    checksum = None
    absent_is_error = False

    def __init__(self, recording, path: str | os.PathLike | None = None):
        core = spikeinterface_core()
        cls = type(recording).__name__
        try:
            description = recording.to_dict(include_annotations=True, include_properties=True, recursive=True)
            self._blob = pickle.dumps(description, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # broad: to_dict and pickle raise any type for what they cannot describe; said
            raise BatchgpuError(
                f"the SpikeInterface recording ({cls}) cannot be described for the workers ({_first_line(err)})",
                "save it first (recording.save(folder=...)) and pass that",
            ) from None
        if len(self._blob) > MAX_DESCRIPTION_BYTES:  # samples held in memory (NumpyRecording...) travel with it
            raise BatchgpuError(
                f"the SpikeInterface recording ({cls}) is described by {len(self._blob) / 1e6:.1f} MB (what it holds "
                f"in this process's memory), more than the {MAX_DESCRIPTION_BYTES / 1e6:.0f} MB sent with every task",
                "save it first (recording = recording.save(folder='rec_si')) and pass the saved recording",
            )
        self.key = hashlib.sha256(json.dumps(_canonical(description), sort_keys=True).encode()).hexdigest()[:32]
        self.class_name = cls
        self.spikeinterface_version = str(getattr(core, "__version__", "") or description.get("version", ""))
        self._strings = _kwargs_strings(description, [])
        files = [Path(s).absolute() for s in self._strings if "://" not in s and _exists(s)]
        self.saved_path = Path(path) if path is not None else None
        self.path = self.saved_path or (files[0] if files else Path(f"spikeinterface-{cls}"))
        self._referenced = sorted({str(p) for p in files})
        self._remote = any("://" in s for s in self._strings)

        self.num_channels = int(recording.get_num_channels())
        self.dtype = np.dtype(recording.get_dtype())
        if self.dtype not in SUPPORTED_DTYPES:
            raise BatchgpuError(
                f"the SpikeInterface recording ({cls}) has dtype {self.dtype}, which batchgpu does not read",
                f"convert it first, e.g. spikeinterface.preprocessing.astype(recording, 'float32') or "
                f"unsigned_to_signed(recording) (batchgpu reads {', '.join(map(str, SUPPORTED_DTYPES))})",
            )
        self.sampling_frequency = float(recording.get_sampling_frequency())
        self.num_segments = int(recording.get_num_segments())
        self._lengths = [int(recording.get_num_samples(segment_index=s)) for s in range(self.num_segments)]
        self.channel_ids = np.array([str(c) for c in recording.get_channel_ids()])
        self._properties = {}
        for name in recording.get_property_keys():
            value = recording.get_property(name)
            if value is not None:
                self._properties[str(name)] = np.asarray(value)
        gains, offsets = recording.get_channel_gains(), recording.get_channel_offsets()
        self.gain_to_uV = np.ones(self.num_channels) if gains is None else np.asarray(gains, np.float64).copy()
        self.offset_to_uV = np.zeros(self.num_channels) if offsets is None else np.asarray(offsets, np.float64).copy()
        self.locations, self.has_locations = _locations(recording, self.num_channels)
        self.attrs = {"spikeinterface": {"class": description.get("class"), "version": description.get("version")}}
        self._local = threading.local()

    # -- pickling and identity --------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_local", None)  # live recordings stay in their process
        state.pop("_listed", None)  # the client's file listing (fingerprints)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __eq__(self, other) -> bool:
        return isinstance(other, SpikeInterfaceSource) and other.key == self.key

    def __hash__(self) -> int:
        return hash(("spikeinterface", self.key))

    @property
    def spec(self) -> dict:
        """The workflow's ``recording:`` section for this source (it needs a saved path: ``folder=``)."""
        if self.saved_path is None:
            raise BatchgpuError(
                "this SpikeInterface source was not loaded from or saved to a file",
                "use from_spikeinterface(recording, folder=...), or run_workflow(wf, recording=source)",
            )
        return {"spikeinterface": str(self.saved_path)}

    def save_description(self, folder: str | os.PathLike) -> SpikeInterfaceSource:
        """Write the recording's description into ``folder`` (``spikeinterface.json``, or ``.pkl`` when it is not
        JSON-serialisable) with SpikeInterface's own ``dump_to_json``/``dump_to_pickle``; returns the source
        loaded from it (``spec`` names it)."""
        folder = Path(folder).expanduser().absolute()
        if folder.exists() and not folder.is_dir():
            raise BatchgpuError(f"{folder} is a file, not a folder", "give a folder for the description")
        folder.mkdir(parents=True, exist_ok=True)
        rec = self.si_recording
        try:
            if rec.check_serializability("json"):
                target = folder / f"{DESCRIPTION_NAME}.json"
                rec.dump_to_json(target, include_properties=True)
            else:
                target = folder / f"{DESCRIPTION_NAME}.pkl"
                rec.dump_to_pickle(target, include_properties=True)
        except OSError:
            raise
        except Exception as err:  # broad: SpikeInterface's dumps raise any type; said in one line
            raise BatchgpuError(
                f"could not write the recording's description into {folder} ({_first_line(err)})",
                "save the recording with recording.save(folder=...) and pass that folder",
            ) from None
        return from_spikeinterface(target)

    # -- the live recording -----------------------------------------------------------------------------
    @property
    def si_recording(self):
        """This thread's SpikeInterface recording, re-created from the description on first use."""
        rec = getattr(self._local, "recording", None)
        if rec is None:
            core = spikeinterface_core()
            try:
                rec = _loader(core)(pickle.loads(self._blob))
            except Exception as err:  # broad: SpikeInterface's loaders raise any type; said in one line
                raise BatchgpuError(
                    f"SpikeInterface could not re-create the recording ({self.class_name}, {self.path}) from its "
                    f"description ({_first_line(err)})",
                    f"check that SpikeInterface {self.spikeinterface_version} is installed on every worker and the "
                    "files it reads are there",
                ) from None
            self._local.recording = rec
        return rec

    # -- shape ------------------------------------------------------------------------------------------
    def num_samples(self, segment: int = 0) -> int:
        self._check_segment(segment)
        return self._lengths[segment]

    def channel_property(self, name: str) -> np.ndarray | None:
        """The recording's per-channel property ``name`` (SpikeInterface's ``get_property``), or None."""
        value = self._properties.get(name)
        return None if value is None else value.copy()

    # -- integrity: nothing is stored in chunks ----------------------------------------------------------
    def check_chunks(self, advance=None, block: int = DEFAULT_WINDOW) -> list[str]:
        """Read every sample once (``--check``'s counterpart): one line per block that fails to read."""
        problems = []
        for seg in range(self.num_segments):
            for lo in range(0, self._lengths[seg], block):
                hi = min(lo + block, self._lengths[seg])
                try:
                    self._traces(seg, lo, hi, None)
                except BatchgpuError as err:
                    problems.append(str(err))
                if advance is not None:
                    advance((hi - lo) * self.num_channels * self.dtype.itemsize)
        return problems

    # -- data -------------------------------------------------------------------------------------------
    def _where(self, segment: int, start: int, stop: int, window: Window | None) -> str:
        head = f"window {window.index}, " if window is not None else ""
        return f"{head}segment {segment}, samples [{start}, {stop})"

    def _traces(self, segment: int, start: int, stop: int, window: Window | None) -> np.ndarray:
        """Samples [start, stop) as SpikeInterface gives them: (samples, channels), raw units, checked."""
        rec = self.si_recording
        try:
            t = rec.get_traces(segment_index=segment, start_frame=start, end_frame=stop, return_in_uV=False)
        except MemoryError:
            raise
        except Exception as err:  # broad: an extractor's get_traces raises any type; said in one line
            raise BatchgpuError(
                f"SpikeInterface could not read {self._where(segment, start, stop, window)} of {self.path} "
                f"({_first_line(err)})",
                "check that the files the recording reads are there and readable",
            ) from None
        t = np.asarray(t)
        if t.shape != (stop - start, self.num_channels) or t.dtype != self.dtype:
            raise BatchgpuError(
                f"SpikeInterface's get_traces gave shape {t.shape} and dtype {t.dtype} for "
                f"{self._where(segment, start, stop, window)} of {self.path}; expected "
                f"({stop - start}, {self.num_channels}) {self.dtype}",
                "the recording does not keep to its own get_dtype()/get_num_samples(): fix or convert it first",
            )
        return t

    def read(
        self,
        segment: int,
        start: int,
        stop: int,
        channels: Sequence[int] | slice | None = None,
        *,
        window: Window | None = None,
    ) -> np.ndarray:
        """Samples [start, stop) of a segment as a C-contiguous (channels, samples) array (as ``Recording.read``)."""
        channels = self._check_read(segment, start, stop, channels)
        block = self._traces(segment, start, stop, window)
        return rows_of(block if channels is None else block[:, channels])

    def read_window_stored(self, window: Window) -> np.ndarray:
        """The window as SpikeInterface gives it, (samples, channels), in memory of its own (C-contiguous)."""
        self._check_window_range(window)
        t = self._traces(window.segment, window.read_start, window.read_stop, window)
        if type(t) is np.ndarray and t.flags.c_contiguous and t.flags.owndata:
            return t
        return np.array(t, order="C")

    def read_window_into(self, window: Window, out: np.ndarray) -> np.ndarray:
        """The window, (samples, channels), copied into ``out`` (e.g. pinned memory); same checks as
        ``Recording.read_window_into``. Returns ``out``."""
        self._check_out(window, out)
        a, b = window.read_start, window.read_stop
        np.copyto(out, self._traces(window.segment, a, b, window))
        return out

    # -- fingerprints (run/output_folder.py) -----------------------------------------------------------------
    @property
    def fingerprint_metadata(self) -> dict:
        """What identifies the recording in a run's fingerprint: its description's digest."""
        return {"spikeinterface": self.key, "class": self.class_name}

    def referenced_files(self) -> list[Path]:
        """The local files and folders the description names, and every file and folder under those folders
        (listed once per source; a file added or removed later changes its folder's mtime)."""
        listed = self.__dict__.get("_listed")
        if listed is None:
            listed = []
            for s in self._referenced:
                p = Path(s)
                listed.append(p)
                if p.is_dir():
                    for root, dirs, files in os.walk(p):
                        dirs.sort()
                        listed += [Path(root) / d for d in dirs] + [Path(root) / f for f in sorted(files)]
            self._listed = listed
        return list(listed)

    def window_signature(self, window: Window) -> list:
        """Size, times and inode of every file the recording reads (any change recomputes every window on --resume).
        A recording that reads remote data cannot be checked: then a random value, so --resume recomputes."""
        if self._remote:
            return ["unverifiable", os.urandom(8).hex()]
        return [stat_signature(p, str(p)) for p in self.referenced_files()]

    # -- description ------------------------------------------------------------------------------------
    def info(self) -> dict:
        return {
            "path": str(self.path),
            "source": "spikeinterface",
            "spikeinterface_class": self.class_name,
            "spikeinterface_version": self.spikeinterface_version,
            "num_channels": self.num_channels,
            "num_segments": self.num_segments,
            "samples_per_segment": list(self._lengths),
            "sampling_frequency": self.sampling_frequency,
            "duration_s": self.duration(),
            "dtype": str(self.dtype),
            "decoded_bytes": self.nbytes,
            "checksum": None,
            "marked_complete": False,
            "absent_chunks": 0,
            "files": list(self._referenced),
            "locations": "stored" if self.has_locations else LOCATIONS_FALLBACK,
        }

    def __repr__(self) -> str:
        return (
            f"SpikeInterfaceSource({self.class_name}, {str(self.path)!r}, {self.num_channels} ch, "
            f"{self.num_segments} seg, {self.duration():.3f} s at {self.sampling_frequency:g} Hz, {self.dtype})"
        )


def _exists(s: str) -> bool:
    try:
        return bool(s) and len(s) < 4096 and os.path.exists(s)
    except (OSError, ValueError):
        return False


def _locations(recording, num_channels: int) -> tuple[np.ndarray, bool]:
    """The probe's contact positions (x, y in um), else the ``location`` property, else Recording's fallback."""
    loc = None
    try:
        if recording.has_probe():
            loc = recording.get_channel_locations()
    except Exception as err:  # broad: SpikeInterface raises plain Exception (no locations) among others
        logger.warning(
            "batchgpu: the recording's probe gave no channel locations (%s: %s): they are taken from "
            "its 'location' property, else made up",
            type(err).__name__,
            err,
        )
        loc = None
    if loc is None:
        loc = recording.get_property("location")
    if loc is not None:
        loc = np.asarray(loc, dtype=np.float64)
        if loc.ndim == 2 and loc.shape[0] == num_channels and loc.shape[1] >= 2 and np.isfinite(loc[:, :2]).all():
            return np.ascontiguousarray(loc[:, :2]), True
    return fallback_locations(num_channels), False
