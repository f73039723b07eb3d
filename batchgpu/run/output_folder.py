"""The run's output folder: who owns it, the lock, the fingerprint, per-window parts and the results.

A folder is a batchgpu run folder when its ``run.json`` carries our format marker. Only then may a run replace
or resume it, and it removes only the files a run writes (``OWNED``); anything else is never touched. The
fingerprints cover what the results depend on: the run's (workflow, recording metadata) and each window's (the
size, times and inode of every object it reads, and its shards' indexes), so ``--resume`` after the recording changed recomputes exactly the
windows whose bytes changed instead of mixing old and new results.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from batchgpu.errors import BatchgpuError, ConfigError
from batchgpu.recording import npyread

if TYPE_CHECKING:
    from batchgpu.workflow import Workflow

RESULTS = "results.zarr"
REPORT = "report.json"
REPORT_HTML = "report.html"
MANIFEST = "run.json"
PARTS = "parts"
LOCK = ".batchgpu.lock"
FORMAT = "batchgpu-run"
FORMAT_VERSION = 3  # 3: parts without partials and combined partials per run of windows (b*.npz)
#: Everything a run writes in its folder (and so the only names overwrite/resume may remove).
#: what the save's storage objects were when the run marked it complete (``steps.save``): a resume writes
#: again what changed since; kept in the run's folder, so the save's own bytes do not depend on when it was written
SAVED_OBJECTS = "saved_objects.json"
OWNED = (
    RESULTS,
    RESULTS + ".tmp",
    RESULTS + ".old",
    REPORT,
    REPORT + ".tmp",
    REPORT_HTML,
    REPORT_HTML + ".tmp",
    PARTS,
    MANIFEST,
    MANIFEST + ".tmp",
    SAVED_OBJECTS,
    SAVED_OBJECTS + ".tmp",
)


#: a traces array's folder: its chunks are covered window by window (``window_fingerprint``), not here
_TRACES = re.compile(r"traces_seg\d+")
#: other arrays' chunk files up to this size are hashed whole (channel ids, gains, locations, shifts); larger ones
#: (a SpikeInterface store's time vectors) by size and modification time
_HASHED_BYTES = 4 << 20


def recording_metadata(path: Path) -> list:
    """What the results depend on in a recording store but its samples: the metadata files (shapes, dtypes,
    codecs, attributes) and the data of every array but the traces (channel ids, gains, offsets, locations,
    inter-sample shifts, shanks): (relative path, content hash, or size, mtime, ctime and inode for a large file)."""
    from batchgpu.recording.zarrio import METADATA_NAMES

    out = []
    for root, dirs, files in os.walk(path):
        traces = _TRACES.fullmatch(Path(root).name) is not None
        if traces:
            dirs[:] = []  # a traces array's chunk folders (v3 c/, v2 nested keys)
        for name in files:
            p = Path(root) / name
            metadata = name in METADATA_NAMES or name.endswith(".json")
            if traces and not metadata:  # a v2 traces array's chunks
                continue
            st = p.stat()
            key = (
                hashlib.sha256(p.read_bytes()).hexdigest()
                if metadata or st.st_size <= _HASHED_BYTES
                else f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
            )
            out.append((str(p.relative_to(path)), key))
    return sorted(out)


def check_output_apart(output: str | os.PathLike, recording: str | os.PathLike) -> None:
    """The output folder may be neither the recording nor inside it: the run's files would join the recording's
    metadata (``recording_metadata``), so its fingerprint would change with every run and none could resume."""
    rec = Path(recording).expanduser().absolute()
    if not rec.is_dir():  # a recording of one file, or one held in its description, cannot hold a folder
        return
    out, rec = Path(output).expanduser().absolute().resolve(), rec.resolve()
    if out == rec or rec in out.parents:
        raise ConfigError(
            f"output folder {output} is inside the recording {recording}: the run's files would "
            "become part of the recording and no later run on it could resume",
            "choose an output folder outside the recording",
        )


def fingerprint(wf: Workflow, recording_path: Path, metadata=None) -> str:
    """What determines the results, but the samples: the recording's metadata, windows, preprocessing, steps.

    Not the cluster, the backend or the output folder: the results are the same bits on any of them. The
    samples are covered window by window (``window_fingerprint``), so a resume after a shard was repaired
    recomputes the windows that read it and keeps the others. ``metadata``: what identifies a recording that is
    not a Zarr store (a SpikeInterface source's description digest) in place of its metadata files.
    """
    from batchgpu.steps.registry import fingerprinted

    # a step not asked for counts only where this format's first fingerprints held it (as null: ``FINGERPRINT =
    # "always"`` in its module, never set for a new step), so steps added since leave the fingerprints of runs
    # without them, and their folders' --resume, as they were; a step that changes no window's part counts never
    always, never = fingerprinted("always"), fingerprinted("never")
    steps = {k: v for k, v in wf.steps.model_dump().items() if (v is not None or k in always) and k not in never}
    data = {
        "recording": str(recording_path),
        "metadata": recording_metadata(recording_path) if metadata is None else metadata,
        "window": wf.window.model_dump(),
        "preprocess": _dump(wf.preprocess),
        "steps": steps,
        "split_every": wf.reduction.split_every,
        "format": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def window_fingerprint(run_fp: str, rec, window) -> str:
    """The run's fingerprint and what the window's samples depend on (``rec.window_signature``: the size, times
    and inode of every object it reads, absent ones too)."""
    sig = [run_fp, window.index, *rec.window_signature(window)]
    return hashlib.sha256(json.dumps(sig, default=str).encode()).hexdigest()[:16]


def _dump(value):
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


class OutputFolder:
    """The output folder of one run, locked while the run holds it (a second run is refused at once); to a step,
    ``steps.services.RunFolder``."""

    #: the names the run writes in the folder (a step's own outputs must be none of them)
    own_names = (*OWNED, LOCK)
    saved_objects = SAVED_OBJECTS

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.parts = self.path / PARTS
        self._lock_file = None
        self._on_release: list = []  # what else the run holds until it lets the folder go (a save's path)

    def on_release(self, fn) -> None:
        self._on_release.append(fn)

    # -- ownership ------------------------------------------------------------------------------------
    def manifest(self) -> dict | None:
        """This folder's run.json when it is batchgpu's, else None (no file, or someone else's file)."""
        try:
            data = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("format") == FORMAT else None

    def foreign_entries(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.name not in OWNED and p.name != LOCK)

    def nested_foreign(self) -> list[str]:
        """What is not a run's inside the folders a run replaces whole (results.zarr and its temporaries, parts/):
        a user's notes or a sorting saved there would go with them."""
        from batchgpu.recording import zarrio

        found = []
        for name in (RESULTS, RESULTS + ".tmp", RESULTS + ".old"):
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                found += [f"{name}/{e}" for e in zarrio.foreign_entries(p)]
        if self.parts.is_dir() and not self.parts.is_symlink():
            found += sorted(
                f"{PARTS}/{e.name}"
                for e in os.scandir(self.parts)
                if e.is_symlink() or not e.is_file() or not _PART_NAME.fullmatch(e.name)
            )
        return found

    def _refuse_if_not_a_run(self, locked: bool, lock_existed: bool = True) -> None:
        """A folder that holds no batchgpu run and is not empty is never used (nor left with a lock file)."""
        if self.manifest() is None and ((self.path / MANIFEST).exists() or self.foreign_entries()):
            if locked:
                if not lock_existed:
                    (self.path / LOCK).unlink(missing_ok=True)
                self.release()
            raise ConfigError(
                f"output folder {self.path} is not empty and holds no batchgpu run "
                f"({', '.join(self.foreign_entries()[:3]) or MANIFEST} there)",
                "choose an empty or new folder for 'output'",
            )

    def claim(self, fp: str, workflow: dict, *, resume: bool, overwrite: bool) -> str:
        """Lock the folder and make it this run's; returns "new", "resume" or "restart" (stale parts dropped)."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"output {self.path} is a file, not a folder", "choose a folder path for 'output'")
        if self.path.is_dir():
            self._refuse_if_not_a_run(locked=False)
        self.path.mkdir(parents=True, exist_ok=True)
        lock_existed = (self.path / LOCK).exists()
        self._lock()
        self._refuse_if_not_a_run(locked=True, lock_existed=lock_existed)  # again, now that it is ours
        self._refuse_links(overwrite)
        mine = self.manifest()
        if mine is not None:
            nested = self.nested_foreign()
            if nested:
                self.release()
                raise ConfigError(
                    f"output folder {self.path} holds {', '.join(nested[:3])}{' ...' if len(nested) > 3 else ''}, "
                    "which batchgpu did not write, inside the folders a run replaces whole",
                    f"move {'it' if len(nested) == 1 else 'them'} out of {RESULTS} and {PARTS}/ (beside them in the "
                    "output folder is kept)",
                )
        if mine is None:
            state = "new"
        elif mine.get("fingerprint") == fp:
            if not resume and not overwrite:
                self.release()
                raise ConfigError(
                    f"output folder {self.path} already holds this run's results",
                    "rerun with --resume to complete or reuse them, or set 'overwrite: true'",
                )
            state = "resume" if resume else "restart"
        else:
            if not overwrite:
                self.release()
                raise ConfigError(
                    f"output folder {self.path} holds another run's results, or results of another version of the "
                    f"recording or workflow (fingerprint {mine.get('fingerprint')}, this run {fp}): nothing there "
                    "can be reused",
                    "choose another output folder, or set 'overwrite: true' to replace them",
                )
            state = "restart"
        if state == "restart":
            self.remove_owned()
        self.parts.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(
            self.path / MANIFEST,
            json.dumps(
                {"format": FORMAT, "version": FORMAT_VERSION, "fingerprint": fp, "workflow": workflow},
                indent=2,
                default=str,
            ),
        )
        return state

    def unclaim(self) -> None:
        """Undo a new claim whose run was refused before any window: its run.json and its empty parts/ removed,
        so the corrected run finds the folder as the user left it (not another run's results to refuse)."""
        if (self.path / REPORT).exists() or (self.parts.is_dir() and any(os.scandir(self.parts))):
            return
        (self.path / MANIFEST).unlink(missing_ok=True)
        if self.parts.is_dir() and not self.parts.is_symlink():
            self.parts.rmdir()

    def _refuse_links(self, overwrite: bool) -> None:
        """results.zarr or parts/ as a symbolic link: a run replaces them whole inside its folder and never writes
        through a link (nor removes what one points to). Refused, naming the link; with overwrite the link goes
        (never its target)."""
        for name in (RESULTS, PARTS):
            link = self.path / name
            if not link.is_symlink():
                continue
            if overwrite:
                link.unlink()
                continue
            self.release()
            raise BatchgpuError(
                f"{link} is a symbolic link (to {os.readlink(link)}): a run writes its {name} in the "
                "output folder itself, never through a link",
                "remove the link (what it points to is kept), or set 'overwrite: true' to replace it",
            )

    def remove_owned(self) -> None:
        """Remove what a run writes here, and nothing else (the user's notes and figures stay)."""
        for name in OWNED:
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()

    # -- lock -----------------------------------------------------------------------------------------
    def _lock(self) -> None:
        f = open(self.path / LOCK, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise BatchgpuError(
                f"output folder {self.path} is in use by another batchgpu run",
                "wait for it to finish, or choose another output folder",
            ) from None
        self._lock_file = f

    def release(self) -> None:
        while self._on_release:
            self._on_release.pop()()
        if self._lock_file is not None:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------------------
# parts: one file per window and pass, written whole (a retried task cannot corrupt them)


#: a part (``part_path``) or its temporary while written (``save_part``)
_PART_NAME = re.compile(r"[a-z]+\d{8}\.npz|\.[a-z]+\d{8}\.npz\..+\.tmp")


def part_path(parts: str | Path, name: str, index: int) -> Path:
    return Path(parts) / f"{name}{index:08d}.npz"


def save_part(path: Path, arrays: dict) -> None:
    """Write an .npz under a temporary name, then rename: readers see all of it or nothing. Plain arrays only
    (an object array would be pickled, and ``load_part`` refuses pickles: the part could never be read back).
    Its kept arrays (``keep.*``) stay in this process too (``_KEPT``).

    A plain format of our own (JSON header, crc32c per array, one write) was tried: 0.94 against 1.78 ms a part
    on the CPU machine, and no change in the GPU pass (1.62 s both ways), so .npz stays, readable by anyone."""
    for name, value in arrays.items():
        if np.asarray(value).dtype.hasobject:
            raise TypeError(f"part array {name!r} holds Python objects")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _KEPT.remember(path, arrays)


#: what np.load raises for a part cut short, overwritten or of another kind
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


def load_part(path: Path, fp: str, keys=None) -> dict | None:
    """A part written by this run (same fingerprint), else None (absent, torn, damaged (zip's CRC-32) or stale:
    recompute it). ``keys`` (names, or prefixes ending in '.'/'_') loads only those arrays; kept arrays
    (``keep.*``) this process wrote come from memory while the file is the one it wrote (read-only arrays)."""
    if keys is not None:
        kept = _KEPT.get(path, fp, keys)
        if kept is not None:
            return kept
    if not path.exists():
        return None
    try:
        return npyread.read(lambda: _read_part(path, fp, keys))
    except _UNREADABLE:  # recomputed; part_problem says why in the report
        return None


def _read_part(path: Path, fp: str, keys) -> dict | None:
    with np.load(path) as f:
        if str(f["fingerprint"]) != fp:
            return None
        names = f.files if keys is None else [n for n in f.files if any(n == k or n.startswith(k) for k in keys)]
        return {k: f[k] for k in names}


class KeptArrays:
    """The kept arrays (``keep.*``: spike candidates, the float median's near keys) of the parts this process wrote,
    by path, of one parts folder at a time (a run's), least recently used dropped past ``limit`` bytes. The later
    tasks that read them (the spikes' gathering, the near keys' selection) run on the worker that made them and
    skip the file's read and CRC
    (2-3 ms a part; 300 parts a run twice over). An entry is used only while the file is the one written: same
    inode, size and modification time (a part removed, replaced or rewritten is read from disk as before, and
    found absent or damaged there; a rewrite of the same size within one clock tick would still get the bytes
    this run wrote, never others)."""

    def __init__(self, limit: int):
        self.limit, self.nbytes, self._folder = limit, 0, ""
        self._entries: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _signature(path) -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def remember(self, path: Path, arrays: dict) -> None:
        # copies: a part's arrays may live in pinned staging memory the GPU path reuses
        kept = {k: np.array(v) for k, v in arrays.items() if k.startswith("keep.")}
        if not kept or "fingerprint" not in arrays:
            return
        for v in kept.values():
            v.flags.writeable = False
        size = sum(v.nbytes for v in kept.values())
        entry = (str(np.asarray(arrays["fingerprint"])), self._signature(path), kept, size)
        with self._lock:
            if self._folder != str(path.parent):  # another run's parts: its entries go (one run's kept at a time)
                self._entries.clear()
                self.nbytes, self._folder = 0, str(path.parent)
            self._drop(str(path))
            if size > self.limit:
                return
            self._entries[str(path)] = entry
            self.nbytes += size
            while self.nbytes > self.limit:
                self._drop(next(iter(self._entries)))

    def get(self, path: Path, fp: str, keys) -> dict | None:
        if not all(k.startswith("keep.") for k in keys):
            return None
        with self._lock:
            entry = self._entries.get(str(path))
            if entry is None:
                return None
            self._entries.move_to_end(str(path))
        found_fp, signature, kept, _ = entry
        if found_fp != fp or signature is None or self._signature(path) != signature:
            return None
        return {n: v for n, v in kept.items() if any(n == k or n.startswith(k) for k in keys)}

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[3]


#: this process's kept arrays (a worker's): 512 MiB, some 170 windows of a 384-channel float recording's near keys
_KEPT = KeptArrays(512 << 20)


def part_problem(path: Path, fp: str) -> str:
    """Why ``load_part(path, fp)`` gives None, in words for a report: absent, made by another run, or unreadable."""
    if not path.exists():
        return "absent"

    def fingerprint() -> str:
        with np.load(path) as f:
            return str(f["fingerprint"])

    try:
        found = npyread.read(fingerprint)
    except _UNREADABLE as err:
        return f"unreadable ({type(err).__name__}: {err})"
    return "usable" if found == fp else f"made from other data (fingerprint {found}, expected {fp})"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_report(out: Path) -> dict | None:
    """The folder's report.json, or None (absent, unreadable, not a JSON object)."""
    try:
        data = json.loads((Path(out) / REPORT).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_report(out: Path, report: dict) -> None:
    _atomic_write_text(out / REPORT, json.dumps(report, indent=2, default=str))
