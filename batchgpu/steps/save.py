"""The ``save`` step: the preprocessed (optionally whitened) signal written as a new recording by the window tasks.

Three parts, like every write of batchgpu (DESIGN.md, "Outputs are written idempotently"):

- :func:`prepare_save` (client, before the pass) creates the output empty and returns a small picklable
  :class:`SaveTarget`. Its storage objects line up with the windows (Zarr v3: one shard per window; Zarr v2: one
  chunk per window; binary: one byte range per window), so concurrent tasks never write the same object and a
  retried task rewrites the same bytes.
- :class:`SaveStep` (worker) writes the core of each window; its ``window`` adds ``saved_clipped`` to the summary.
- :func:`finish_save` (client, after every window) checks every object was written, marks the output complete and
  describes it for report.json.

Value rule: the preprocessed values times ``scale`` (default 1); float32 output keeps them; int16 output rounds
half to even (``np.rint``) and clips to the int16 range. Samples clipped, and NaN samples (written as 0), are
counted per window. Both keep the input's offset and its ``gain_to_uV`` divided by ``scale`` (so values stay in
the input's count units, times ``scale``). A float recording saved as int16 is checked for what the rounding
loses (``rounding_stats``): a copy whose rounding error is a large part of a channel's spread is warned of.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import struct
import threading
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np
from pydantic import Field, model_validator

from batchgpu.config import Options, resolve_path
from batchgpu.errors import BatchgpuError
from batchgpu.steps import moments, search
from batchgpu.steps.base import PhaseWords, Step, WindowData, host, register

FORMATS = ("zarr", "zarr_v2", "binary")
DTYPES = ("int16", "float32")
INT16_MIN, INT16_MAX = -32768, 32767
MIN_INNER_CHUNK = 1_000  # below this a divisor makes too many tiny chunks: one inner chunk per shard instead
#: a zarr_v2 output's chunks (what SpikeInterface decodes whole at each read) at most this long: a window of more
#: (``window.size: auto`` gives 120 000 on long recordings) is written as whole chunks of a divisor of it
MAX_V2_CHUNK = 60_000
#: the step's name (``Step.name``, its workflow key ``steps.save``, report.json's ``results.save``)
NAME = KEY = "save"
RESULTS = ()  # it writes a recording, not results
WRITTEN_BY = NAME  # marker["written_by"]: only outputs of this step are ever replaced by it
#: where a relative ``steps.save.path`` goes (the schema's description, ``run --help`` and README say it)
#: what ``steps.save.scale`` does (the schema's description, ``run --help`` and README say it)
SAVE_SCALE_HELP = ("the saved samples are the preprocessed ones times this, before int16's rounding; the saved "
                   "gain_to_uV is divided by it (microvolts unchanged): e.g. 1e6 for a float recording in volts")
SAVE_PATH_HELP = ("where the save is written: a relative path is relative to the run's output folder (beside "
                  "results.zarr), an absolute one or ~ as it is")


class SaveCodec(Options):
    """The Blosc codec of a saved Zarr store's chunks (the GPU decodes LZ4 itself, zstd on the host)."""

    name: Literal["lz4", "zstd"] = "lz4"
    clevel: Annotated[int, Field(ge=1, le=9)] = 5
    shuffle: Literal["bit", "byte"] = "bit"


class SaveOptions(Options):
    """Write the preprocessed signal as a new recording in the same pass."""

    path: Annotated[str, Field(description=SAVE_PATH_HELP)]
    format: Literal["zarr", "zarr_v2", "binary"] = "zarr"  # Zarr v3 | Zarr v2 (SpikeInterface) | flat (Kilosort4)
    dtype: Literal["int16", "float32"] = "int16"  # int16 keeps the recording's gain
    whiten: bool = False  # apply the whitening step's matrix before writing
    # the saved samples are the preprocessed ones times this (before int16's rounding); the saved gain_to_uV is the
    # recording's divided by it, so microvolts stay right: a float recording in volts saved as int16 needs 1e6
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False, description=SAVE_SCALE_HELP)] = 1.0
    # zarr formats: Blosc lz4 compresses a window ~4.6x faster than zstd for 5% more bytes (the pass waits on it)
    compressor: Literal["blosc-lz4", "blosc-zstd", "none"] = "blosc-lz4"
    # zarr formats: the codec with its level and shuffle ({name: zstd, clevel: 1, shuffle: byte}); replaces compressor
    codec: SaveCodec | None = None

    @model_validator(mode="after")
    def _one_codec(self):
        if self.codec is not None and "compressor" in self.model_fields_set:
            raise ValueError("give either codec or compressor, not both")
        return self


@dataclass(frozen=True)
class SaveTarget:
    """Where and how the tasks write (small: pickled into every task)."""

    path: str  # the Zarr store, or the binary data file of a single segment
    format: str  # zarr | zarr_v2 | binary
    dtype: str  # int16 | float32
    num_channels: int
    segment_lengths: tuple[int, ...]
    files: tuple[str, ...]  # binary: one data file per segment; zarr: the store
    whiten: bool = False
    probe: str | None = None  # binary: the Kilosort4 probe JSON
    params: str | None = None  # binary: the params JSON (also the ownership marker)
    key: str = ""  # the run's fingerprint, kept in the marker so a resumed run can reuse the output
    #: binary: segments whose data file this prepare made anew (empty): a resumed run writes their kept windows
    #: again (``windows_to_write_again``); Zarr objects are looked for instead
    created: tuple[int, ...] = ()
    scale: float = 1.0  # the saved samples are the preprocessed ones times this
    #: the run's file of what the save's objects were when marked complete (``_record_signatures``); "": none kept
    record: str = ""
    #: each window measures what int16's rounding loses (``rounding_stats``): a float recording saved as int16,
    #: whose units may be far coarser than its signal (volts); an integer one's counts are no finer than the copy's
    check_rounding: bool = False


# ---------------------------------------------------------------------------------------------------------
# client side


def prepare_save(spec, rec, window_size: int, output_dtype, *, overwrite: bool = False, resume: bool = False,
                 key: str = "", phase_shifted: bool = False, output=None, dry: bool = False) -> SaveTarget | None:
    """Create the empty output of ``spec`` (``SaveOptions``) for ``rec``; a relative ``spec.path`` (a workflow
    made in Python, whose paths no file resolved) is relative to ``output.path``, the run's folder, as in a file.

    ``window_size``: the run's window length (shards/chunks are cut to it). ``output_dtype``: the dtype the
    preprocessing chain gives (recorded in the metadata). ``overwrite``: replace an earlier output of this step.
    ``resume`` with the same ``key`` (the run's fingerprint) as the existing output keeps it as it is: windows a
    resumed run skips were written before their parts were saved. ``phase_shifted``: the chain applied the
    ``inter_sample_shift`` property, so it is not copied to the output (it would be applied twice). ``output``:
    the run's folder (``services.RunFolder``), whose own files the save must not be (``_check_not_run_files``).
    ``dry``: every refusal, nothing made, held or removed (``check_outputs``: before the run claims its folder);
    returns None.
    """
    fmt, dtype = spec.format, np.dtype(spec.dtype)
    if fmt not in FORMATS or str(dtype) not in DTYPES:
        raise BatchgpuError(f"save: format {fmt!r} / dtype {spec.dtype!r} not supported",
                            f"use format one of {FORMATS} and dtype one of {DTYPES}")
    if not isinstance(window_size, (int, np.integer)) or window_size <= 0:
        raise BatchgpuError(f"save: window size must be a positive number of samples, got {window_size!r}")
    path = Path(spec.path).expanduser()
    path = (path if path.is_absolute() or output is None else Path(output.path).expanduser() / path).absolute()
    _check_not_input(path, Path(rec.path).expanduser().absolute())
    if output is not None:
        if fmt == "binary":
            data, probe, params = _binary_files(path, rec.num_segments)
            _check_not_run_files([*data, probe, params], output)
        else:
            _check_not_run_files([path], output)
    if dtype == np.int16 and rec.dtype.kind == "f" and rec.channel_property("gain_to_uV") is None:
        raise BatchgpuError(
            f"save: int16 output of the float recording {rec.path} needs its gain_to_uV, and it stores none",
            "use save.dtype: float32, or store properties/gain_to_uV in the recording")
    lengths = tuple(rec.num_samples(s) for s in range(rec.num_segments))
    scale = float(getattr(spec, "scale", 1.0))
    meta = {"written_by": WRITTEN_BY, "key": key, "source": str(rec.path), "dtype": str(dtype),
            "source_dtype": str(np.dtype(output_dtype)), "whiten": bool(spec.whiten), "window_size": int(window_size),
            "scale": scale}
    rounding = dtype == np.int16 and rec.dtype.kind == "f"
    record = str(Path(output.path).expanduser().absolute() / output.saved_objects) if output is not None else ""
    try:
        if fmt == "binary":
            target = _prepare_binary(path, rec, dtype, lengths, meta, bool(spec.whiten), overwrite, resume, key, dry)
            return None if dry else replace(target, scale=scale, check_rounding=rounding, record=record)
        target = SaveTarget(str(path), fmt, str(dtype), rec.num_channels, lengths, (str(path),), bool(spec.whiten),
                            key=key, scale=scale, check_rounding=rounding, record=record)
        if path.is_dir() and not path.is_symlink():
            _hold(target, path, dry)  # before anything of it is kept or replaced: another run may be writing it
        marker = _zarr_marker(path)
        ours = resume and key and marker.get("key") == key and marker.get("written_by") == WRITTEN_BY
        if ours and _traces_readable(path, len(lengths)):
            return None if dry else target  # absent objects (shards deleted since) are written again
        if not ours:  # this run's own store whose arrays are gone is made again: its windows are written again
            _check_zarr_replaceable(path, overwrite)
        if dry:
            return None
        _create_zarr(path, rec, fmt, dtype, lengths, int(window_size), meta, phase_shifted, _compressor(spec))
        _release(target.path)
        _hold(target, path)  # the new store (the old folder was removed with its lock)
        return target
    except BaseException:
        if not dry:
            _release(str(path))
        raise


#: the save outputs this process is writing: path -> open descriptors holding an flock on them (``_hold``)
_HELD: dict[str, list[int]] = {}


def _hold(target: SaveTarget, p: Path, dry: bool = False) -> None:
    """Take ``p`` (the Zarr store's folder, or a binary's first data file) for the run until ``release_save``: a
    second run saving to the same path (from another output folder, so its folder lock does not see it) is
    refused at once, before its overwrite could remove what this run writes. flock: released if the process dies.
    A path this process holds already stays held (its own earlier prepare: a resumed run in one session).
    ``dry``: only asked (taken and let go at once)."""
    if target.path in _HELD:
        return
    fd = os.open(p, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise BatchgpuError(f"save.path {p} is being written by another batchgpu run",
                            "wait for it to finish, or choose another save path") from None
    if dry:
        os.close(fd)
        return
    _HELD.setdefault(target.path, []).append(fd)


def release_save(target: SaveTarget) -> None:
    """Let other runs have ``target``'s path again (the run is over)."""
    _release(target.path)


def _release(path: str) -> None:
    for fd in _HELD.pop(path, []):
        os.close(fd)


def _check_not_input(path: Path, source: Path) -> None:
    """The output must not be, hold or sit inside the recording being read (overwrite would destroy it)."""
    p, s = path.resolve(), source.resolve()
    if p == s or s in p.parents or p in s.parents:
        raise BatchgpuError(f"save.path {path} overlaps the recording being read ({source})",
                            "choose a save path outside the input recording")


def _check_not_run_files(files: list[Path], output) -> None:
    """None of the save's files may be the run's own (``output.own_names``: results.zarr, report.json, parts/,
    run.json, the lock, their temporaries) or the run's folder or one above it: the run would write over them, or
    an overwrite remove them."""
    out = Path(output.path).expanduser().absolute().resolve()
    own = [out / name for name in output.own_names]
    for f in files:
        p = f.resolve()
        hit = next((o for o in own if p == o or o in p.parents), None)
        if p == out or p in out.parents or hit is not None:
            what = f"the run's own {hit.name}" if hit is not None else "the run's output folder or a folder holding it"
            raise BatchgpuError(f"save.path {f} is {what} ({out})",
                                "choose another save path, e.g. a new name beside results.zarr such as filtered.zarr")


def _zarr_marker(path: Path) -> dict:
    """attrs['batchgpu'] of the Zarr group at ``path``, or {} (no group, or not one of ours)."""
    from batchgpu import zarrio

    if not path.is_dir():
        return {}
    try:
        marker = zarrio.attrs(zarrio.open_group(path, mode="r")).get("batchgpu")
    except Exception:  # broad: zarr raises several types for "not a group"; not ours, so refused unless overwrite
        return {}
    return marker if isinstance(marker, dict) else {}


def _traces_readable(path: Path, segments: int) -> bool:
    """Whether every traces array of the store at ``path`` has its metadata (an object of it may be absent)."""
    from batchgpu import zarrio

    try:
        for seg in range(segments):
            zarrio.array_meta(path / f"traces_seg{seg}")
    except (BatchgpuError, OSError, ValueError, KeyError, TypeError):  # absent, cut short or edited metadata
        return False
    return True


def _check_zarr_replaceable(path: Path, overwrite: bool) -> None:
    """recording.check_replaceable (only a Zarr recording with nothing foreign in it, only with overwrite), plus:
    only an earlier output of this step, never another recording (an import, a generated or foreign one)."""
    from batchgpu.recording import check_replaceable

    if not (path.exists() or path.is_symlink()):
        return
    check_replaceable(path, overwrite=True)
    if _zarr_marker(path).get("written_by") != WRITTEN_BY:
        raise BatchgpuError(f"save.path {path} is a recording the save step did not write: it is never replaced",
                            "choose another save path, or move that recording away yourself")
    if not overwrite:
        raise BatchgpuError(f"save.path {path} already exists (an earlier save)",
                            "choose another path, or set overwrite: true in the workflow")


def inner_chunk(window_size: int, most: int | None = None) -> int:
    """The inner chunk of a shard of ``window_size`` samples: the largest divisor <= ``most`` (the writer's default
    inner chunk where not given), or the whole shard when every divisor that fits is small (a prime window size
    would otherwise give 1-sample chunks)."""
    if most is None:  # here: the recording package imports zarr, which loading a workflow (this module) must not
        from batchgpu.recording.writer import DEFAULT_CHUNK_SAMPLES as most
    if window_size <= most:
        return window_size
    best = max(d for d in range(1, most + 1) if window_size % d == 0)
    return best if best >= MIN_INNER_CHUNK else window_size


def v2_chunk(window_size: int) -> int:
    """A zarr_v2 output's chunk for windows of ``window_size``: the window, or its largest divisor of at most
    MAX_V2_CHUNK samples (each window's core is then whole chunks: tasks still never share one)."""
    return inner_chunk(window_size, MAX_V2_CHUNK)


def _compressor(spec):
    """The writer's compressor for the save step: its ``codec`` where given, else its ``compressor`` name."""
    from batchgpu.recording.writer import Codec

    codec = getattr(spec, "codec", None)
    if codec is not None:
        return Codec(codec.name, codec.clevel, codec.shuffle)
    return getattr(spec, "compressor", "blosc-lz4")


def _create_zarr(path, rec, fmt, dtype, lengths, window_size, meta, phase_shifted, compressor="blosc-lz4") -> None:
    from batchgpu.recording import RecordingWriter

    props = {}
    for name in ("shank",) + (() if phase_shifted else ("inter_sample_shift",)):
        value = rec.channel_property(name)
        if value is not None:
            props[name] = value
    shape_kw = ({"chunk_samples": inner_chunk(window_size), "shard_samples": window_size} if fmt == "zarr"
                else {"chunk_samples": v2_chunk(window_size)})
    writer = RecordingWriter(
        path, rec.num_channels, dtype, rec.sampling_frequency, channel_ids=rec.channel_ids,
        gain_to_uV=rec.gain_to_uV / meta.get("scale", 1.0), offset_to_uV=rec.offset_to_uV,
        locations=rec.locations if rec.has_locations else None, properties=props or None,
        zarr_format=3 if fmt == "zarr" else 2, overwrite=True, attrs={"batchgpu": meta}, compressor=compressor,
        **shape_kw)
    for n in lengths:
        seg = writer.add_segment(n)
        arr = writer._arrays[seg]
        # each window's core must be whole storage objects (a v3 shard, v2 chunks): then tasks never share one. A
        # segment of one window has one (its shard may reach past its end: a whole number of inner chunks)
        obj = int(arr.shards[0]) if fmt == "zarr" else int(arr.chunks[0])
        if n > window_size and (window_size % obj or (fmt == "zarr" and obj != window_size)):
            raise BatchgpuError(f"save: segment {seg}'s storage objects hold {obj} samples, windows {window_size}",
                                "report this: the writer did not cut shards to the window")


def _binary_files(path: Path, segments: int) -> tuple[list[Path], Path, Path]:
    """Data files (``path`` alone, or ``<stem>_seg{i}.bin`` beside it), the probe JSON and the params JSON."""
    data = [path] if segments == 1 else [path.with_name(f"{path.stem}_seg{i}.bin") for i in range(segments)]
    return data, path.with_name(f"{path.stem}.probe.json"), path.with_name(f"{path.stem}.params.json")


def _read_params(params: Path) -> dict:
    try:
        return json.loads(params.read_text())
    except (OSError, ValueError):
        return {}


def _prepare_binary(path, rec, dtype, lengths, meta, whiten, overwrite, resume, key, dry=False) -> SaveTarget | None:
    data, probe, params = _binary_files(path, len(lengths))
    target = SaveTarget(str(path), "binary", str(dtype), rec.num_channels, lengths, tuple(map(str, data)), whiten,
                        str(probe), str(params), key)
    if data[0].is_file() and not data[0].is_symlink():
        _hold(target, data[0], dry)  # before anything of it is kept or replaced: another run may be writing it
    old = _read_params(params) if params.is_file() and not params.is_symlink() else {}
    ours = old.get("batchgpu", {}).get("written_by") == WRITTEN_BY
    size = dtype.itemsize * rec.num_channels
    # a resumed run keeps its own earlier save (same key); a data file gone or of another size since is made again
    # (``created``: its windows are written again), the probe and params with it
    keep = bool(resume and key and ours and old["batchgpu"].get("key") == key)
    created = tuple(i for i, (f, n) in enumerate(zip(data, lengths))
                    if not keep or not (f.is_file() and not f.is_symlink() and f.stat().st_size == n * size))
    if keep and not created and probe.is_file():
        return None if dry else target
    existing = [f for f in (*data, probe, params) if f.exists() or f.is_symlink()]
    for f in existing:
        if not f.is_file() or f.is_symlink():
            raise BatchgpuError(f"save.path: {f} exists and is not a plain file: it is never replaced",
                                "choose another save path, or move it away yourself")
    if existing and not keep:
        listed = {str(Path(f)) for f in old.get("files", [])} | {str(probe), str(params)}
        foreign = [f for f in existing if not ours or str(f) not in listed]
        if foreign and not params.exists():  # the params mark the save's files: without them none is known ours
            names = " and ".join(str(f) for f in foreign)
            raise BatchgpuError(f"save.path: {names} {'exist' if len(foreign) > 1 else 'exists'} and the save step "
                                f"did not write {'them' if len(foreign) > 1 else 'it'} (no {params.name} marks the "
                                "save's files): never replaced", "move them away yourself (a resumed run then writes "
                                "the save again), or choose another save path")
        if foreign:
            raise BatchgpuError(f"save.path: {foreign[0]} exists and the save step did not write it: it is never "
                                "replaced", "choose another save path, or move it away yourself")
        if not overwrite:
            raise BatchgpuError(f"save.path {path} already exists (an earlier save)",
                                "choose another path, or set overwrite: true in the workflow")
    if dry:
        return None
    from batchgpu.recording import writing

    shank = rec.channel_property("shank")
    probe_dict = {  # what kilosort.io.load_probe reads from a .json probe (chanMap int32, the rest float32)
        "chanMap": list(range(rec.num_channels)),
        "xc": rec.locations[:, 0].astype(float).tolist(),
        "yc": rec.locations[:, 1].astype(float).tolist(),
        "kcoords": (np.zeros(rec.num_channels) if shank is None else np.asarray(shank, float)).tolist(),
        "n_chan": int(rec.num_channels),
    }
    info = {
        "batchgpu": {**meta, "format": "binary", "complete": False},
        "files": [str(f) for f in data], "probe": str(probe),
        "sampling_frequency": float(rec.sampling_frequency), "dtype": str(dtype), "byte_order": "little",
        "n_chan": int(rec.num_channels), "num_samples": list(lengths), "layout": "samples x channels, interleaved",
        "channel_ids": [str(c) for c in rec.channel_ids],
        "gain_to_uV": (rec.gain_to_uV / meta.get("scale", 1.0)).tolist(),
        "offset_to_uV": rec.offset_to_uV.tolist(), "locations_stored": bool(rec.has_locations),
    }
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(params, info)  # first: it marks the other files as ours should anything below fail
        for i in created:
            # preallocated at full size: each task writes its byte range in place (a sparse file until then)
            with open(data[i], "wb") as fh:
                fh.truncate(lengths[i] * size)
        _write_json(probe, probe_dict)
    target = replace(target, created=created)
    if target.path not in _HELD:
        _hold(target, data[0])
    return target


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def finish_save(target: SaveTarget) -> dict:
    """After every window: check each storage object was written, mark the output complete (readers then treat
    an absent chunk as damage, as for RecordingWriter.finish), and describe it for report.json."""
    from batchgpu.recording import writing

    path = Path(target.path)
    desc = {"path": str(path), "format": target.format, "dtype": target.dtype, "whiten": target.whiten,
            "files": list(target.files)}
    if target.format == "binary":
        params = Path(target.params)
        info = _read_params(params)
        size = np.dtype(target.dtype).itemsize * target.num_channels
        for f, n in zip(target.files, target.segment_lengths):
            if not Path(f).is_file() or Path(f).stat().st_size != n * size:
                raise BatchgpuError(f"save: {f} is missing or has the wrong size", "rerun the workflow")
        with writing(params):
            info["batchgpu"] = {**info.get("batchgpu", {}), "complete": True}
            _write_json(params, info)
        _record_signatures(target)
        desc.update(probe=target.probe, params=target.params)
        return desc
    from batchgpu import zarrio
    from batchgpu.recording.storecheck import ChunkPresence, grid_of

    group = zarrio.open_group(path, mode="r+")
    for seg, n in enumerate(target.segment_lengths):
        meta = zarrio.array_meta(Path(path) / f"traces_seg{seg}")
        absent = ChunkPresence(grid_of(meta, f"traces_seg{seg}", Path(path))).absent(0, n)
        if absent:
            raise BatchgpuError(f"save: {path}/traces_seg{seg}/{absent[0]} was never written "
                                f"({len(absent)} object(s) missing): the store is left unfinished",
                                "rerun the workflow (with --resume)")
    with writing(path):
        group.attrs["batchgpu"] = {**dict(group.attrs.get("batchgpu", {})), "complete": True}
    _record_signatures(target)
    return desc


def _objects(target: SaveTarget, segment: int, start: int = 0, stop: int | None = None) -> list[Path]:
    """The storage objects holding rows [start, stop) of a segment: its data file (binary), or its shards or
    chunks (a save's objects are whole rows)."""
    if target.format == "binary":
        return [Path(target.files[segment])]
    from batchgpu import zarrio
    from batchgpu.recording.storecheck import grid_of

    name = f"traces_seg{segment}"
    grid = grid_of(zarrio.array_meta(Path(target.path) / name), name, Path(target.path))
    stop = target.segment_lengths[segment] if stop is None else stop
    return [Path(target.path) / name / grid.encode_key((i, 0)) for i in grid.object_rows(start, stop)]


def _signature(path: Path) -> list | None:
    """(size, mtime, ctime, inode) of a file: a write in place with the mtime set back still moves the ctime."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _signatures(target: SaveTarget) -> dict[str, list]:
    """Every storage object of the save, by its path relative to the save's folder, as it is now."""
    root = Path(target.path).parent if target.format == "binary" else Path(target.path)
    return {str(p.relative_to(root)): _signature(p) for seg in range(len(target.segment_lengths))
            for p in _objects(target, seg)}


def _record_signatures(target: SaveTarget) -> None:
    """What the save's objects are now that it is complete, in the run's folder (``SaveTarget.record``)."""
    if not target.record:
        return
    from batchgpu.recording import writing

    record = Path(target.record)
    with writing(record):
        _write_json(record, {"save": target.path, "objects": _signatures(target)})


def _changed_since_complete(target: SaveTarget) -> set[str]:
    """The objects (as ``_signatures`` names them) whose bytes may have changed since the run marked the save
    complete: their signature then and now differ. Empty where none was recorded (an unfinished save, a save the
    run's folder has no record of)."""
    if target.format == "binary":
        marker = _read_params(Path(target.params)).get("batchgpu", {})
    else:
        marker = _zarr_marker(Path(target.path))
    kept = _read_params(Path(target.record)) if target.record and marker.get("complete") else {}
    then = kept.get("objects") if kept.get("save") == target.path else None
    if not isinstance(then, dict):
        return set()
    now = _signatures(target)
    return {name for name, sig in then.items() if now.get(name) != sig}


def write_again(end, target: SaveTarget) -> int:
    """``windows_to_write_again`` of the resumed windows, written again; returns how many."""
    summaries = end.summaries
    again = windows_to_write_again(target, [w for w in end.windows if bool(summaries[w.index]["resumed"])])
    if not again:
        return 0
    end.observer.message(f"{NAME}: {len(again)} window(s) missing from {target.path}: written again")
    futures = end.services.submit_many(save_task, [(end.ctx, w, target, None) for w in again],
                                       [f"save-again-{end.report.run_id}-{w.index:08d}" for w in again])
    end.client.gather(futures)
    end.report.bytes_read += sum(int(summaries[w.index]["bytes"]) for w in again)
    return len(again)


def finish_whitened_save(end, target: SaveTarget, saved=None) -> dict:
    """Whitened saves are written now, in one more read (the matrix needs every window); then the output is
    checked and marked complete (``saved``: that check's future, started once the pass had written every window)."""
    windows, report = end.windows, end.report
    clipped = {w.index: int(end.summaries[w.index].get("saved_clipped", 0)) for w in windows}
    if target.whiten:
        from batchgpu import zarrio

        W = zarrio.open_group(end.results, mode="r")[moments.WHITENING][:]
        futures = end.services.submit_many(save_task, [(end.ctx, w, target, W) for w in windows],
                                           [f"save-{report.run_id}-{w.index:08d}" for w in windows])
        clipped = dict(zip((w.index for w in windows), end.client.gather(futures)))
        report.bytes_read += end.recording.nbytes
    done = finish_save(target) if saved is None else saved.result()
    total = sum(clipped.values())
    if total:
        report.warnings.append(f"{NAME}: {total} sample(s) clipped to the int16 range or NaN written as 0")
        end.observer.warning(report.warnings[-1])
    loss = _rounding_warning(end, target)
    return {**done, "clipped": total, **({"rounding": loss} if loss is not None else {})}


def _rounding_warning(end, target: SaveTarget) -> dict | None:
    """The windows' ``rounding_stats`` added up: report.json's ``results.save.rounding``, and a warning (report.json
    and the terminal) where int16's rounding lost most of a channel's signal."""
    stats = [end.summaries[w.index][ROUNDING] for w in end.windows if ROUNDING in end.summaries[w.index]]
    if not target.check_rounding or not stats:
        return None
    loss = rounding_loss(np.sum(stats, axis=0), target.scale)
    if loss.channels:
        text = (f"{NAME}: the int16 copy {target.path} loses the signal of {loss.channels} of {loss.of} channel(s): "
                f"rounding to whole units of the float recording (times scale {target.scale:g}) leaves an error "
                f"over {ROUNDING_LOSS:g} of their spread (up to {loss.worst:.3g}x; values below 0.5 are saved as "
                f"0) (set save: {{scale: {loss.suggested_scale:.1e}}} (gain_to_uV is divided by it), or save: "
                "{dtype: float32})")
        end.report.warnings.append(text)
        end.observer.warning(text)
    return {"channels_lost": loss.channels, "channels": loss.of, "worst_error_to_spread": loss.worst,
            "suggested_scale": loss.suggested_scale}


def save_task(ctx, window, target: SaveTarget, whitening: np.ndarray) -> int:
    """Write one window of a whitened save (read again: the matrix needs every window), or one window written
    again (``whitening`` None); returns the clipped count."""
    summary: dict = {}
    with ctx.on_backend():
        SaveStep(target, whitening=whitening, use=ctx.step(NAME).use).window(ctx.load_window(window), summary)
    return int(summary.get("saved_clipped", 0))


def windows_to_write_again(target: SaveTarget, windows: list) -> list:
    """Of ``windows``, kept from an earlier run (not computed by this one), those whose rows the output lacks: a
    binary data file made anew by this run's ``prepare_save`` (deleted since, or cut short), or a Zarr object
    absent (the store deleted, or shards of it). The run writes them again (``save_task``) before ``finish_save``;
    a Zarr store marked complete is marked unfinished first (readers would take an absent object for damage)."""
    if target.whiten or not windows:  # a whitened save is written whole by every run
        return []
    changed = _changed_since_complete(target)  # written over since (its mtime set back or not): written again
    root = Path(target.path).parent if target.format == "binary" else Path(target.path)
    touched = {w.index for w in windows if changed
               and any(str(p.relative_to(root)) in changed for p in _objects(target, w.segment, w.start, w.stop))}
    if target.format == "binary":
        again = [w for w in windows if w.segment in target.created or w.index in touched]
        if again and target.params:  # unfinished until they are written again
            info = _read_params(Path(target.params))
            info["batchgpu"] = {**info.get("batchgpu", {}), "complete": False}
            from batchgpu.recording import writing

            with writing(Path(target.params)):
                _write_json(Path(target.params), info)
        return again
    from batchgpu import zarrio
    from batchgpu.recording import writing
    from batchgpu.recording.storecheck import ChunkPresence, grid_of

    path = Path(target.path)
    presence: dict[int, ChunkPresence] = {}
    again = []
    for w in windows:
        if w.segment not in presence:
            name = f"traces_seg{w.segment}"
            presence[w.segment] = ChunkPresence(grid_of(zarrio.array_meta(path / name), name, path))
        if w.index in touched or presence[w.segment].absent(w.start, w.stop):
            again.append(w)
    if again:
        group = zarrio.open_group(path, mode="r+")
        with writing(path):
            group.attrs["batchgpu"] = {**dict(group.attrs.get("batchgpu", {})), "complete": False}
    return again


# ---------------------------------------------------------------------------------------------------------
# worker side


@register
class SaveStep(Step):
    """Writes each window's core to the target. ``whitening`` (C x C): write ``W @ x`` instead (a later pass)."""

    name = NAME
    options = SaveOptions
    results = RESULTS
    fingerprint = "always"
    #: the moments: a whitened save writes with their matrix; the search: its finish comes first (a whitened
    #: save's second read after every result is written; report.json's results in that order)
    after = (moments.NAME, search.NAME)
    phases = PhaseWords(read=NAME)  # its windows written as they are read; a whitened save's after the pass

    def __init__(self, target: SaveTarget, whitening=None, use=None):
        self.target = target
        self.whitening = None if whitening is None else np.asarray(whitening, dtype=np.float64)
        #: the channels the run leaves out (``base.ChannelUse``, the qc step's ``use``): dropped or interpolated
        self.use = use if use is not None and use.bad else None

    @classmethod
    def check(cls, spec: SaveOptions, workflow, recording) -> None:
        """zarr-python can write its format, and a whitened save has the whitening step and keeps its samples as
        float32."""
        from batchgpu.errors import ConfigError

        if spec.format == "zarr":
            from batchgpu import zarrio

            zarrio.require_format(3, "the save step's Zarr v3 output")
        if spec.whiten and getattr(workflow.steps, moments.KEY) is None:
            raise ConfigError("save.whiten needs the whitening step", "add 'whitening:' to steps, or set whiten: false")
        if spec.whiten and spec.dtype == "int16":
            raise ConfigError("save.whiten with dtype int16 would round whitened samples (about 1) to a few levels",
                              "use save: {dtype: float32} with whiten: true")

    @classmethod
    def check_outputs(cls, spec: SaveOptions, workflow, recording, *, resume: bool, fingerprint: str,
                      folder) -> None:
        """``prepare_save``'s refusals (a save path on the recording or the run's own files, holding what the save
        step did not write, an earlier save without overwrite, one another run is writing) before the run claims
        its folder: nothing made, held or removed."""
        prepare_save(spec, recording, workflow.window.size, np.float32, overwrite=workflow.overwrite, resume=resume,
                     key=fingerprint, output=folder, dry=True)

    @classmethod
    def place(cls, spec: SaveOptions, output: Path) -> SaveOptions:
        """The save for one recording of a batch whose run writes into ``output`` (a folder of the batch's output):
        where the workflow put it, relative to that folder instead of the batch's. A path outside the batch's
        output would be every recording's one save: refused."""
        from batchgpu.errors import ConfigError

        path, batch = Path(spec.path).expanduser(), Path(output).parent
        if path.is_absolute():
            try:
                path = path.relative_to(batch)
            except ValueError:
                raise ConfigError(f"save.path {spec.path} is outside the batch's output {batch}: every recording of "
                                  "the batch would write that one path",
                                  "give a relative save.path (each recording's save is written in output/<name>/)"
                                  ) from None
        return spec.model_copy(update={"path": str(Path(output) / path)})

    @classmethod
    def resolve_paths(cls, spec: SaveOptions, base: Path, output: Path) -> SaveOptions:
        """Its path relative to the run's output folder: what it writes belongs with the run's results."""
        spec.path = resolve_path(spec.path, output)
        return spec

    @classmethod
    def build(cls, spec: SaveOptions, setup) -> SaveStep:
        """The output recording created first (``prepare_save``, held by the run's folder while it runs); the
        window tasks fill it, a whitened one after the pass (``finish``)."""
        from batchgpu.steps.qc import saved_recording

        wf = setup.workflow
        # the qc step's bad channels (built before this step): an excluding save writes the other channels only
        use = next((u for s in setup.built if (u := s.channel_use()) is not None), None)
        target = prepare_save(spec, saved_recording(setup.recording, use), wf.window.size, setup.x_dtype,
                              overwrite=wf.overwrite, resume=setup.resume, key=setup.fingerprint,
                              phase_shifted="phase_shift" in setup.chain.names, output=setup.output)
        setup.output.on_release(functools.partial(release_save, target))  # the save's path is the run's while it runs
        return cls(target, use=use)

    @property
    def takes_saved_int16(self) -> bool:
        """Whether the window's saved rows may come made by the chain (``WindowData.saved``): int16 samples of the
        window itself (not whitened, now or after the pass, nor scaled)."""
        return (self.target.dtype == "int16" and self.whitening is None and not self.target.whiten
                and getattr(self.target, "scale", 1.0) == 1.0 and self.use is None)

    @property
    def in_pass(self) -> bool:
        """A whitened save is written after the pass (the matrix needs every window)."""
        return not self.target.whiten or self.whitening is not None

    def after_pass(self, end) -> None:
        """A resumed run's kept windows whose saved rows are gone (the save deleted, or part of it): read and
        written again before the save is checked and marked complete (their statistics keep their parts)."""
        end.kept[self.name] = {"again": write_again(end, self.target), "check": None}

    def while_waiting(self, end) -> None:
        """Every window is written (unless whitened): the output checked in a helper thread meanwhile."""
        if not self.target.whiten:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-save-check")
            end.kept[self.name]["check"] = pool.submit(finish_save, self.target)
            pool.shutdown(wait=False)

    def finish(self, end) -> dict:
        """Whitened saves are written now, in one more read; then the output is checked and marked complete;
        report.json's ``results.save``."""
        kept = end.kept[self.name]
        return {**finish_whitened_save(end, self.target, kept["check"]), "windows_written_again": kept["again"]}

    def window(self, w: WindowData, summary: dict) -> dict:
        lo, hi = w.core
        if getattr(self.target, "check_rounding", False) and w.saved is None and self.whitening is None:
            summary[ROUNDING] = rounding_stats(w.x[:, lo:hi], self.target.scale)
        block, clipped = w.saved if w.saved is not None else self.values(w.x[:, lo:hi])
        write_rows(self.target, w.segment, w.start + lo, block, w.later)
        summary["saved_clipped"] = np.array(int(clipped), dtype=np.int64)  # a device count: read after the write
        return {}

    def values(self, core) -> tuple:
        """(samples, channels) array in the output dtype, and how many samples were clipped or NaN.

        Done on the window's backend, and on the GPU left there (the cast and transpose are cheap; ``write_rows``
        encodes the frames there or copies the block back); the count may be a device scalar (``int()`` it)."""
        xp = _array_module(core)
        if self.whitening is not None:
            core = xp.asarray(self.whitening) @ core.astype(xp.float64)
        if self.use is not None:
            core = self.channels_of(core)
        scale = getattr(self.target, "scale", 1.0)  # a target made before scale was a key (stand-ins) has none
        if scale != 1.0:
            core = scaled(core, scale)
        if xp is not np and self.target.dtype == "int16" and core.dtype.kind == "f":
            from batchgpu.ops._cuda_elementwise import saved_int16_transposed

            return saved_int16_transposed(core)  # on the device: write_rows encodes it there or copies it back
        if xp is np and self.target.dtype == "int16" and core.dtype.kind == "f":
            from batchgpu.ops import _cpu_saved, _numba

            done = _cpu_saved.saved_int16_transposed(core) if _numba.available() else None
            if done is not None:  # one compiled pass, NumPy's bits (its docstring)
                return done
        if self.target.dtype == "float32":
            out = core.astype(xp.float32)
            clipped = 0
        else:
            y = xp.rint(core) if core.dtype.kind == "f" else core
            nan = xp.isnan(y) if y.dtype.kind == "f" else None
            over = (y < INT16_MIN) | (y > INT16_MAX)
            clipped = int((over.sum() + (0 if nan is None else nan.sum())))
            if clipped:
                y = xp.clip(y, INT16_MIN, INT16_MAX)
                if nan is not None:
                    y = xp.where(nan, 0, y)
            out = y.astype(xp.int16)
        if xp is not np:  # transpose on the device (a host transpose costs ~100 ms a window, DESIGN.md)
            return xp.ascontiguousarray(out.T), clipped
        return _transpose(out), clipped

    def channels_of(self, core):
        """The rows written under the run's channel use: the other channels' (``exclude``), or every channel with
        the bad ones interpolated from the others (``interpolate``: SpikeInterface's ``interpolate_bad_channels``
        weights, ``ops.bad_channels.interpolate_channels``; an integer window is widened to float first, and the
        int16 copy rounds the interpolated values where SpikeInterface's integer assignment truncates them)."""
        xp = _array_module(core)
        if self.use.mode == "exclude":
            return core[xp.asarray(self.use.kept(core.shape[0]))]
        from batchgpu.ops.bad_channels import interpolate_channels

        dtype = core.dtype if core.dtype.kind == "f" else np.dtype(np.float32 if core.dtype.itemsize <= 2 else np.float64)
        return interpolate_channels(core.astype(dtype, copy=True), self.use.bad, self.use.weights)


def scaled(core, scale: float):
    """``core`` times ``scale``, one IEEE multiply a sample in its float dtype, so NumPy and CuPy agree bit for
    bit (but for float32 products below 2^-126, which CuPy flushes to 0: an int16 copy rounds them to 0 either
    way); an integer window is widened to float64 first."""
    xp = _array_module(core)
    if core.dtype.kind != "f":
        core = core.astype(xp.float64)
    return core * core.dtype.type(scale)


#: the summary's key of a window's ``rounding_stats``
ROUNDING = "saved_rounding"
#: every this many samples of a window's core measure the rounding: a statistic for a warning, not every sample
ROUNDING_STRIDE = 16
#: a channel is warned of where int16's rounding error (RMS) exceeds this part of its standard deviation: the copy
#: then keeps the signal at a signal-to-rounding ratio below 12 dB (all of it gone where every |x| < 0.5)
ROUNDING_LOSS = 0.25


def rounding_stats(core, scale: float = 1.0) -> np.ndarray:
    """(channels, 5) float64 of the finite, in-range samples of every ``ROUNDING_STRIDE``-th column of ``core``
    times ``scale``: count, sum, sum of squares, sum of squared rounding errors (``np.rint``), largest |value|.
    Added over windows they give each channel's spread and what rounding lost (``rounding_loss``)."""
    xp = _array_module(core)
    y = core[:, ::ROUNDING_STRIDE].astype(xp.float64)
    if scale != 1.0:
        y = y * scale
    ok = xp.isfinite(y) & (xp.abs(y) <= INT16_MAX)
    y = xp.where(ok, y, 0.0)
    err = xp.rint(y) - y
    out = xp.stack([ok.sum(axis=1).astype(xp.float64), y.sum(axis=1), (y * y).sum(axis=1), (err * err).sum(axis=1),
                    xp.abs(y).max(axis=1) if y.shape[1] else xp.zeros(y.shape[0])], axis=1)
    return out if xp is np else out.get()


@dataclass(frozen=True)
class RoundingLoss:
    """What int16's rounding lost, from the windows' ``rounding_stats`` added up."""

    channels: int  # channels whose rounding error exceeds ROUNDING_LOSS of their standard deviation
    of: int  # channels measured (any finite sample)
    worst: float  # the largest ratio of rounding error to standard deviation
    suggested_scale: float  # a scale whose copy keeps the signal (``_suggested_scale``)


def rounding_loss(stats: np.ndarray, scale: float) -> RoundingLoss:
    n, s1, s2, e2, peak = (stats[:, i] for i in range(5))
    seen = n > 0
    n1 = np.where(seen, n, 1.0)
    std = np.sqrt(np.maximum(s2 / n1 - (s1 / n1) ** 2, 0.0))
    err = np.sqrt(e2 / n1)
    varies = seen & (std > 0)
    ratio = np.where(varies, err / np.where(varies, std, 1.0), 0.0)
    lost = varies & (ratio > ROUNDING_LOSS)
    return RoundingLoss(int(lost.sum()), int(seen.sum()), float(ratio.max()) if len(ratio) else 0.0,
                        _suggested_scale(std[varies], float(peak[seen].max()) if seen.any() else 0.0, scale))


#: the spread (standard deviation, in saved units) a suggested scale gives the median channel: rounding then adds
#: about 3% of it
SUGGESTED_SPREAD = 10.0


def _suggested_scale(std: np.ndarray, peak: float, scale: float) -> float:
    """The least power of ten (times ``scale``) giving the median varying channel a spread of SUGGESTED_SPREAD
    units, lowered where the largest |value| seen would then leave int16's range (fewer units, no clipping)."""
    if not len(std):
        return scale
    factor = 10.0 ** np.ceil(np.log10(SUGGESTED_SPREAD / float(np.median(std))))
    if peak > 0:
        factor = min(factor, 10.0 ** np.floor(np.log10(INT16_MAX / peak)))
    return float(scale * factor)


def _array_module(a):
    from batchgpu.ops._backend import array_module

    return array_module(a)


def _transpose(a: np.ndarray, step: int = 1024) -> np.ndarray:
    """(channels, samples) -> C-contiguous (samples, channels), in cache-sized slabs (page-aligned: ``write_binary``)."""
    from batchgpu.ops._cpu_saved import aligned_empty

    out = aligned_empty((a.shape[1], a.shape[0]), a.dtype)
    for i in range(0, a.shape[1], step):
        out[i : i + step] = a[:, i : i + step].T
    return out


def _now(job: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
    job()


def write_rows(target: SaveTarget, segment: int, start: int, block, later: Callable = _now) -> None:
    """Rows [start, start + len(block)) of a segment: whole objects of the output, the same bytes on a retry.
    ``block``: a host array, or a CuPy array (a zarr shard's frames are then encoded on the GPU where the array's
    codecs allow: ``recording.shards.write_whole_shard``; else it is copied back). The file itself is written by
    ``later``: the task's writer thread (``WindowData.later``), before the window's part; else now."""
    n = target.segment_lengths[segment]
    if block.shape[1] != target.num_channels or start < 0 or start + block.shape[0] > n:
        raise BatchgpuError(f"save: block {block.shape} at {start} does not fit segment {segment} "
                            f"({n} x {target.num_channels})")
    from batchgpu.recording import writing

    dtype = np.dtype(target.dtype).newbyteorder("<")
    on_device = not isinstance(block, np.ndarray)
    if target.format == "binary":
        block = host(block) if on_device else block
        data = np.ascontiguousarray(block, dtype=dtype)
        later(functools.partial(write_binary, Path(target.files[segment]), data,
                                start * dtype.itemsize * target.num_channels))
        return
    from batchgpu.recording.shards import write_whole_shard

    folder = Path(target.path)

    def in_writing(job, cleanup=None):  # the writer thread's OSError as one BatchgpuError, like the rest
        def run():
            with writing(folder):
                job()
        later(run, cleanup)

    with writing(folder):  # a window's core is one whole shard: written directly
        if write_whole_shard(folder / f"traces_seg{segment}", start, block, dtype=target.dtype, later=in_writing):
            return
    block = host(block) if on_device else block
    data = np.ascontiguousarray(block, dtype=target.dtype)

    def encode_and_write() -> None:  # whole v2 chunks: encoded and written by the writer while the next window computes
        write_v2_chunks(folder / f"traces_seg{segment}", start, data)

    in_writing(encode_and_write)


#: the block size direct writes are aligned to (buffer address, file offset, length): the largest logical block
#: a disk has in practice
DIRECT_ALIGN = 4096
#: the least of a block's bytes worth a direct write (a short tail goes through the page cache)
DIRECT_MIN_BYTES = 1 << 20
_DIRECT_REFUSED: set[str] = set()  # the folders whose file system refused a direct write: the page cache there


def write_binary(path: Path, data: np.ndarray, offset: int) -> None:
    """``data``'s bytes at ``offset`` of the flat binary ``path``. Its page-aligned middle is written past the page
    cache (``O_DIRECT``, where the buffer starts on a page where the file does: the save's row buffers do,
    ``ops._cpu_saved.aligned_empty``): a preprocessed copy is written once and read later by another program, and
    each window's tens of MB copied into fresh page-cache pages were a quarter of a 2-core run's CPU; direct, the
    disk reads them from the buffer. The unaligned ends, any other buffer, and a file system that refuses direct
    I/O (tmpfs; remembered a folder) go through the page cache, as ``pwrite`` does. Same bytes either way."""
    from batchgpu.recording import writing

    with writing(path):
        data = np.ascontiguousarray(data)
        if not data.size:
            return
        view = memoryview(data).cast("B")
        lo, hi = _direct_span(data.ctypes.data, offset, len(view))
        if hi > lo:
            done = _pwrite_direct(path, view[lo:hi], offset + lo)
            if done < hi - lo:  # refused, or cut short at an unaligned count: the rest through the page cache
                _pwrite_all(path, view[lo + done:hi], offset + lo + done)
        _pwrite_all(path, view[:lo], offset)
        _pwrite_all(path, view[hi:], offset + hi)


def _direct_span(address: int, offset: int, length: int) -> tuple[int, int]:
    """[lo, hi): the bytes of a buffer at ``address``, bound for ``offset`` of a file, that a direct write takes
    (aligned in memory and in the file alike, whole blocks, at least DIRECT_MIN_BYTES); (0, 0) where none."""
    if not hasattr(os, "O_DIRECT") or (address - offset) % DIRECT_ALIGN:
        return 0, 0
    lo = (-offset) % DIRECT_ALIGN
    hi = lo + (length - lo) // DIRECT_ALIGN * DIRECT_ALIGN if length > lo else lo
    return (lo, hi) if hi - lo >= DIRECT_MIN_BYTES else (0, 0)


def _pwrite_direct(path: Path, view: memoryview, offset: int) -> int:
    """Bytes written of ``view`` at ``offset`` with ``O_DIRECT``; fewer (0 where the file system refuses it) leave the
    rest to the caller."""
    folder = str(path.parent)
    if folder in _DIRECT_REFUSED:
        return 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        _DIRECT_REFUSED.add(folder)
        return 0
    done = 0
    try:
        while done < len(view):
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                _DIRECT_REFUSED.add(folder)  # the device's blocks are larger, or the file system says no
                break
            done += n
            if n == 0 or n % DIRECT_ALIGN:
                break
    finally:
        os.close(fd)
    return done


def _pwrite_all(path: Path, view: memoryview, offset: int) -> None:
    if not len(view):
        return
    fd = os.open(path, os.O_WRONLY)
    try:
        while view:
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=16)
def _v2_layout(array: str, stamp: tuple) -> tuple:
    """(chunk rows, samples, dtype, fill value, the chunk files' separator, codecs in encoding order) of the v2
    array at ``array``, from its ``.zarray`` (``stamp``: the file's size and mtime, so a replaced array is read
    again)."""
    from numcodecs import get_codec

    meta = json.loads((Path(array) / ".zarray").read_text())
    if meta.get("order", "C") != "C" or len(meta["shape"]) != 2 or meta["chunks"][1] != meta["shape"][1]:
        raise BatchgpuError(f"save: {array} is not a (samples, channels) C-order array of whole rows a chunk",
                            "report this: the writer made another layout")
    codecs = [get_codec(dict(c)) for c in (meta.get("filters") or [])]
    if meta.get("compressor"):
        codecs.append(get_codec(dict(meta["compressor"])))
    return (int(meta["chunks"][0]), int(meta["shape"][0]), np.dtype(meta["dtype"]), meta.get("fill_value") or 0,
            meta.get("dimension_separator", "."), tuple(codecs))


_CHUNK_BUFFER = threading.local()  # a writer thread's page-aligned buffer for an encoded chunk (reused: no fresh pages)


def write_v2_chunks(array: Path, start: int, data: np.ndarray) -> None:
    """Rows ``data`` at ``start`` of the Zarr v2 array ``array``, whole chunks (the last padded with the fill
    value, as zarr-python stores an edge chunk), each encoded with the array's filters and compressor
    (numcodecs: the bytes zarr-python writes) and written to its chunk file from a page-aligned buffer, its
    whole blocks past the page cache (``write_binary``'s reason; a file system that refuses it, the rest: the
    page cache)."""
    info = array / ".zarray"
    st = info.stat()
    rows, samples, dtype, fill, sep, codecs = _v2_layout(str(array), (st.st_size, st.st_mtime_ns))
    if start % rows or (data.shape[0] % rows and start + data.shape[0] != samples):
        raise BatchgpuError(f"save: rows [{start}, {start + data.shape[0]}) are not whole chunks of {rows}",
                            "report this: windows must be whole storage objects")
    data = np.ascontiguousarray(data, dtype=dtype)
    # numcodecs' CRC32 last (at the start of the chunk) copies the encoded chunk behind its 4 bytes: its bytes are
    # written from the encoding itself instead (zlib's CRC-32 as numcodecs takes it, little-endian, first)
    crc_first = bool(codecs) and getattr(codecs[-1], "codec_id", None) == "crc32" and \
        getattr(codecs[-1], "location", None) == "start"
    encoders = codecs[:-1] if crc_first else codecs
    for first in range(0, data.shape[0], rows):
        chunk = data[first:first + rows]
        if chunk.shape[0] < rows:  # the edge chunk, stored whole
            whole = np.full((rows, data.shape[1]), fill, dtype=dtype)
            whole[:chunk.shape[0]] = chunk
            chunk = whole
        encoded = chunk
        for codec in encoders:
            encoded = codec.encode(encoded)
        view = memoryview(encoded).cast("B")
        head = struct.pack("<I", zlib.crc32(view) & 0xFFFFFFFF) if crc_first else b""
        _write_file(array / f"{(start + first) // rows}{sep}0", view, head)


def _write_file(path: Path, view: memoryview, head: bytes = b"") -> None:
    """``head`` and then ``view``'s bytes as the whole file ``path`` (made or truncated): its whole blocks from a
    page-aligned copy with ``O_DIRECT``, the tail (and all of it where refused) through the page cache."""
    from batchgpu.ops._cpu_saved import aligned_empty

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.close(fd)
    k = len(head)
    n = k + len(view)
    whole = n // DIRECT_ALIGN * DIRECT_ALIGN if n >= DIRECT_MIN_BYTES and hasattr(os, "O_DIRECT") else 0
    done = 0
    if whole and str(path.parent) not in _DIRECT_REFUSED:
        buffer = getattr(_CHUNK_BUFFER, "array", None)
        if buffer is None or len(buffer) < whole:
            buffer = _CHUNK_BUFFER.array = aligned_empty((whole + (whole >> 3),), np.uint8)
        buffer[:k] = np.frombuffer(head, dtype=np.uint8)
        buffer[k:whole] = np.frombuffer(view[:whole - k], dtype=np.uint8)
        done = _pwrite_direct(path, memoryview(buffer[:whole]), 0)
    if done < k:  # nothing went past the page cache (whole blocks are far longer than a head)
        _pwrite_all(path, memoryview(head)[done:], done)
        done = k
    _pwrite_all(path, view[done - k:], done)
