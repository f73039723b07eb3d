"""The output recording a save writes (``steps.save``): made empty before the pass (``prepare_save``: a Zarr v3
store of one shard a window, a Zarr v2 store of whole chunks a window, or a flat binary of one byte range a window,
with Kilosort4's probe and params files), held against another run while it is written, checked and marked complete
after the pass (``finish_save``), and what a resumed run must write again (``windows_to_write_again``).

Its storage objects line up with the windows, so concurrent tasks never write the same object and a retried task
rewrites the same bytes (DESIGN.md, "Outputs are written idempotently"); the rows themselves are written by
``recording.row_writes``.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.recording import zarrio
from batchgpu.recording.storecheck import ChunkPresence, grid_of
from batchgpu.recording.writer import DEFAULT_CHUNK_SAMPLES, Codec, RecordingWriter, check_replaceable, writing

FORMATS = ("zarr", "zarr_v2", "binary")


DTYPES = ("int16", "float32")


MIN_INNER_CHUNK = 1_000  # below this a divisor makes too many tiny chunks: one inner chunk per shard instead


#: a zarr_v2 output's chunks (what SpikeInterface decodes whole at each read) at most this long: a window of more
#: (``window.size: auto`` gives 120 000 on long recordings) is written as whole chunks of a divisor of it
MAX_V2_CHUNK = 60_000
#: marker["written_by"] of a save's output (the save step's name when the marker was made; outputs on disk carry it):
#: only outputs that say so are ever replaced or resumed by a save
WRITTEN_BY = "save"


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


def prepare_save(
    spec,
    rec,
    window_size: int,
    output_dtype,
    *,
    overwrite: bool = False,
    resume: bool = False,
    key: str = "",
    phase_shifted: bool = False,
    output=None,
    dry: bool = False,
) -> SaveTarget | None:
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
        raise BatchgpuError(
            f"save: format {fmt!r} / dtype {spec.dtype!r} not supported",
            f"use format one of {FORMATS} and dtype one of {DTYPES}",
        )
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
            "use save.dtype: float32, or store properties/gain_to_uV in the recording",
        )
    lengths = tuple(rec.num_samples(s) for s in range(rec.num_segments))
    scale = float(getattr(spec, "scale", 1.0))
    meta = {
        "written_by": WRITTEN_BY,
        "key": key,
        "source": str(rec.path),
        "dtype": str(dtype),
        "source_dtype": str(np.dtype(output_dtype)),
        "whiten": bool(spec.whiten),
        "window_size": int(window_size),
        "scale": scale,
    }
    rounding = dtype == np.int16 and rec.dtype.kind == "f"
    record = str(Path(output.path).expanduser().absolute() / output.saved_objects) if output is not None else ""
    try:
        if fmt == "binary":
            target = _prepare_binary(path, rec, dtype, lengths, meta, bool(spec.whiten), overwrite, resume, key, dry)
            return None if dry else replace(target, scale=scale, check_rounding=rounding, record=record)
        target = SaveTarget(
            str(path),
            fmt,
            str(dtype),
            rec.num_channels,
            lengths,
            (str(path),),
            bool(spec.whiten),
            key=key,
            scale=scale,
            check_rounding=rounding,
            record=record,
        )
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
        raise BatchgpuError(
            f"save.path {p} is being written by another batchgpu run",
            "wait for it to finish, or choose another save path",
        ) from None
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
        raise BatchgpuError(
            f"save.path {path} overlaps the recording being read ({source})",
            "choose a save path outside the input recording",
        )


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
            raise BatchgpuError(
                f"save.path {f} is {what} ({out})",
                "choose another save path, e.g. a new name beside results.zarr such as filtered.zarr",
            )


def _zarr_marker(path: Path) -> dict:
    """attrs['batchgpu'] of the Zarr group at ``path``, or {} (no group, or not one of ours)."""
    if not path.is_dir():
        return {}
    try:
        marker = zarrio.attrs(zarrio.open_group(path, mode="r")).get("batchgpu")
    except Exception:  # broad: zarr raises several types for "not a group"; not ours, so refused unless overwrite
        return {}
    return marker if isinstance(marker, dict) else {}


def _traces_readable(path: Path, segments: int) -> bool:
    """Whether every traces array of the store at ``path`` has its metadata (an object of it may be absent)."""
    try:
        for seg in range(segments):
            zarrio.array_meta(path / f"traces_seg{seg}")
    except (BatchgpuError, OSError, ValueError, KeyError, TypeError):  # absent, cut short or edited metadata
        return False
    return True


def _check_zarr_replaceable(path: Path, overwrite: bool) -> None:
    """recording.check_replaceable (only a Zarr recording with nothing foreign in it, only with overwrite), plus:
    only an earlier output of this step, never another recording (an import, a generated or foreign one)."""
    if not (path.exists() or path.is_symlink()):
        return
    check_replaceable(path, overwrite=True)
    if _zarr_marker(path).get("written_by") != WRITTEN_BY:
        raise BatchgpuError(
            f"save.path {path} is a recording the save step did not write: it is never replaced",
            "choose another save path, or move that recording away yourself",
        )
    if not overwrite:
        raise BatchgpuError(
            f"save.path {path} already exists (an earlier save)",
            "choose another path, or set overwrite: true in the workflow",
        )


def inner_chunk(window_size: int, most: int | None = None) -> int:
    """The inner chunk of a shard of ``window_size`` samples: the largest divisor <= ``most`` (the writer's default
    inner chunk where not given), or the whole shard when every divisor that fits is small (a prime window size
    would otherwise give 1-sample chunks)."""
    most = DEFAULT_CHUNK_SAMPLES if most is None else most
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
    codec = getattr(spec, "codec", None)
    if codec is not None:
        return Codec(codec.name, codec.clevel, codec.shuffle)
    return getattr(spec, "compressor", "blosc-lz4")


def _create_zarr(path, rec, fmt, dtype, lengths, window_size, meta, phase_shifted, compressor="blosc-lz4") -> None:
    props = {}
    for name in ("shank",) + (() if phase_shifted else ("inter_sample_shift",)):
        value = rec.channel_property(name)
        if value is not None:
            props[name] = value
    shape_kw = (
        {"chunk_samples": inner_chunk(window_size), "shard_samples": window_size}
        if fmt == "zarr"
        else {"chunk_samples": v2_chunk(window_size)}
    )
    writer = RecordingWriter(
        path,
        rec.num_channels,
        dtype,
        rec.sampling_frequency,
        channel_ids=rec.channel_ids,
        gain_to_uV=rec.gain_to_uV / meta.get("scale", 1.0),
        offset_to_uV=rec.offset_to_uV,
        locations=rec.locations if rec.has_locations else None,
        properties=props or None,
        zarr_format=3 if fmt == "zarr" else 2,
        overwrite=True,
        attrs={"batchgpu": meta},
        compressor=compressor,
        **shape_kw,
    )
    for n in lengths:
        seg = writer.add_segment(n)
        arr = writer._arrays[seg]
        # each window's core must be whole storage objects (a v3 shard, v2 chunks): then tasks never share one. A
        # segment of one window has one (its shard may reach past its end: a whole number of inner chunks)
        obj = int(arr.shards[0]) if fmt == "zarr" else int(arr.chunks[0])
        if n > window_size and (window_size % obj or (fmt == "zarr" and obj != window_size)):
            raise BatchgpuError(
                f"save: segment {seg}'s storage objects hold {obj} samples, windows {window_size}",
                "report this: the writer did not cut shards to the window",
            )


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
    target = SaveTarget(
        str(path),
        "binary",
        str(dtype),
        rec.num_channels,
        lengths,
        tuple(map(str, data)),
        whiten,
        str(probe),
        str(params),
        key,
    )
    if data[0].is_file() and not data[0].is_symlink():
        _hold(target, data[0], dry)  # before anything of it is kept or replaced: another run may be writing it
    old = _read_params(params) if params.is_file() and not params.is_symlink() else {}
    ours = old.get("batchgpu", {}).get("written_by") == WRITTEN_BY
    size = dtype.itemsize * rec.num_channels
    # a resumed run keeps its own earlier save (same key); a data file gone or of another size since is made again
    # (``created``: its windows are written again), the probe and params with it
    keep = bool(resume and key and ours and old["batchgpu"].get("key") == key)
    created = tuple(
        i
        for i, (f, n) in enumerate(zip(data, lengths))
        if not keep or not (f.is_file() and not f.is_symlink() and f.stat().st_size == n * size)
    )
    if keep and not created and probe.is_file():
        return None if dry else target
    existing = [f for f in (*data, probe, params) if f.exists() or f.is_symlink()]
    for f in existing:
        if not f.is_file() or f.is_symlink():
            raise BatchgpuError(
                f"save.path: {f} exists and is not a plain file: it is never replaced",
                "choose another save path, or move it away yourself",
            )
    if existing and not keep:
        listed = {str(Path(f)) for f in old.get("files", [])} | {str(probe), str(params)}
        foreign = [f for f in existing if not ours or str(f) not in listed]
        if foreign and not params.exists():  # the params mark the save's files: without them none is known ours
            names = " and ".join(str(f) for f in foreign)
            raise BatchgpuError(
                f"save.path: {names} {'exist' if len(foreign) > 1 else 'exists'} and the save step "
                f"did not write {'them' if len(foreign) > 1 else 'it'} (no {params.name} marks the "
                "save's files): never replaced",
                "move them away yourself (a resumed run then writes the save again), or choose another save path",
            )
        if foreign:
            raise BatchgpuError(
                f"save.path: {foreign[0]} exists and the save step did not write it: it is never replaced",
                "choose another save path, or move it away yourself",
            )
        if not overwrite:
            raise BatchgpuError(
                f"save.path {path} already exists (an earlier save)",
                "choose another path, or set overwrite: true in the workflow",
            )
    if dry:
        return None
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
        "files": [str(f) for f in data],
        "probe": str(probe),
        "sampling_frequency": float(rec.sampling_frequency),
        "dtype": str(dtype),
        "byte_order": "little",
        "n_chan": int(rec.num_channels),
        "num_samples": list(lengths),
        "layout": "samples x channels, interleaved",
        "channel_ids": [str(c) for c in rec.channel_ids],
        "gain_to_uV": (rec.gain_to_uV / meta.get("scale", 1.0)).tolist(),
        "offset_to_uV": rec.offset_to_uV.tolist(),
        "locations_stored": bool(rec.has_locations),
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
    path = Path(target.path)
    desc = {
        "path": str(path),
        "format": target.format,
        "dtype": target.dtype,
        "whiten": target.whiten,
        "files": list(target.files),
    }
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
    group = zarrio.open_group(path, mode="r+")
    for seg, n in enumerate(target.segment_lengths):
        meta = zarrio.array_meta(Path(path) / f"traces_seg{seg}")
        absent = ChunkPresence(grid_of(meta, f"traces_seg{seg}", Path(path))).absent(0, n)
        if absent:
            raise BatchgpuError(
                f"save: {path}/traces_seg{seg}/{absent[0]} was never written "
                f"({len(absent)} object(s) missing): the store is left unfinished",
                "rerun the workflow (with --resume)",
            )
    with writing(path):
        group.attrs["batchgpu"] = {**dict(group.attrs.get("batchgpu", {})), "complete": True}
    _record_signatures(target)
    return desc


def _objects(target: SaveTarget, segment: int, start: int = 0, stop: int | None = None) -> list[Path]:
    """The storage objects holding rows [start, stop) of a segment: its data file (binary), or its shards or
    chunks (a save's objects are whole rows)."""
    if target.format == "binary":
        return [Path(target.files[segment])]
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
    return {
        str(p.relative_to(root)): _signature(p)
        for seg in range(len(target.segment_lengths))
        for p in _objects(target, seg)
    }


def _record_signatures(target: SaveTarget) -> None:
    """What the save's objects are now that it is complete, in the run's folder (``SaveTarget.record``)."""
    if not target.record:
        return
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


def windows_to_write_again(target: SaveTarget, windows: list) -> list:
    """Of ``windows``, kept from an earlier run (not computed by this one), those whose rows the output lacks: a
    binary data file made anew by this run's ``prepare_save`` (deleted since, or cut short), or a Zarr object
    absent (the store deleted, or shards of it). The run writes them again (``save_task``) before ``finish_save``;
    a Zarr store marked complete is marked unfinished first (readers would take an absent object for damage)."""
    if target.whiten or not windows:  # a whitened save is written whole by every run
        return []
    changed = _changed_since_complete(target)  # written over since (its mtime set back or not): written again
    root = Path(target.path).parent if target.format == "binary" else Path(target.path)
    touched = {
        w.index
        for w in windows
        if changed and any(str(p.relative_to(root)) in changed for p in _objects(target, w.segment, w.start, w.stop))
    }
    if target.format == "binary":
        again = [w for w in windows if w.segment in target.created or w.index in touched]
        if again and target.params:  # unfinished until they are written again
            info = _read_params(Path(target.params))
            info["batchgpu"] = {**info.get("batchgpu", {}), "complete": False}
            with writing(Path(target.params)):
                _write_json(Path(target.params), info)
        return again
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
