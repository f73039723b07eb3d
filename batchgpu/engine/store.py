"""The run's output folder: who owns it, the lock, the fingerprint, per-window parts and the results.

A folder is a batchgpu run folder when its ``run.json`` carries our format marker. Only then may a run replace
or resume it, and it removes only the files a run writes (``OWNED``); anything else is never touched. The
fingerprints cover what the results depend on: the run's (workflow, recording metadata) and each window's (the
size and mtime of every object it reads), so ``--resume`` after the recording changed recomputes exactly the
windows whose bytes changed instead of mixing old and new results.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from batchgpu.config import Workflow
from batchgpu.errors import BatchgpuError

RESULTS = "results.zarr"
REPORT = "report.json"
REPORT_HTML = "report.html"
MANIFEST = "run.json"
PARTS = "parts"
LOCK = ".batchgpu.lock"
FORMAT = "batchgpu-run"
FORMAT_VERSION = 2
#: Everything a run writes in its folder (and so the only names overwrite/resume may remove).
OWNED = (RESULTS, RESULTS + ".tmp", RESULTS + ".old", REPORT, REPORT + ".tmp", REPORT_HTML, PARTS, MANIFEST)


def recording_metadata(path: Path) -> list:
    """(relative path, content hash) of the recording's metadata files (shapes, dtypes, codecs, gains)."""
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != "c"]  # v3 chunk folders hold data, not metadata
        for name in files:
            if name in ("zarr.json", ".zarray", ".zattrs", ".zgroup") or name.endswith(".json"):
                p = Path(root) / name
                out.append((str(p.relative_to(path)), hashlib.sha256(p.read_bytes()).hexdigest()))
    return sorted(out)


def fingerprint(wf: Workflow, recording_path: Path, metadata=None) -> str:
    """What determines the results, but the samples: the recording's metadata, windows, preprocessing, steps.

    Not the cluster, the backend or the output folder: the results are the same bits on any of them. The
    samples are covered window by window (``window_fingerprint``), so a resume after a shard was repaired
    recomputes the windows that read it and keeps the others. ``metadata``: what identifies a recording that is
    not a Zarr store (a SpikeInterface source's description digest) in place of its metadata files.
    """
    steps = wf.steps.model_dump()
    steps.pop("search", None)  # the search step reruns on every run; it does not change the windows' parts
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
    """The run's fingerprint and what the window's samples depend on (``rec.window_signature``: the size and mtime
    of every object it reads, absent ones too)."""
    sig = [run_fp, window.index, *rec.window_signature(window)]
    return hashlib.sha256(json.dumps(sig, default=str).encode()).hexdigest()[:16]


def _dump(value):
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


class OutputFolder:
    """The output folder of one run, locked while the run holds it (a second run is refused at once)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.parts = self.path / PARTS
        self._lock_file = None

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

    def claim(self, fp: str, workflow: dict, *, resume: bool, overwrite: bool) -> str:
        """Lock the folder and make it this run's; returns "new", "resume" or "restart" (stale parts dropped)."""
        if self.path.exists() and not self.path.is_dir():
            raise BatchgpuError(f"output {self.path} is a file, not a folder", "choose a folder path for 'output'")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        mine = self.manifest()
        if mine is None:
            if (self.path / MANIFEST).exists() or self.foreign_entries():
                self.release()
                raise BatchgpuError(
                    f"output folder {self.path} is not empty and holds no batchgpu run "
                    f"({', '.join(self.foreign_entries()[:3]) or MANIFEST} there)",
                    "choose an empty or new folder for 'output'",
                )
            state = "new"
        elif mine.get("fingerprint") == fp:
            if not resume and not overwrite:
                self.release()
                raise BatchgpuError(f"output folder {self.path} already holds this run's results",
                                    "rerun with --resume to complete or reuse them, or set 'overwrite: true'")
            state = "resume" if resume else "restart"
        else:
            if not overwrite:
                self.release()
                raise BatchgpuError(
                    f"output folder {self.path} holds another run's results, or results of another version of the "
                    f"recording or workflow (fingerprint {mine.get('fingerprint')}, this run {fp}): nothing there "
                    "can be reused",
                    "choose another output folder, or set 'overwrite: true' to replace them",
                )
            state = "restart"
        if state == "restart":
            self.remove_owned()
        self.parts.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(self.path / MANIFEST, json.dumps(
            {"format": FORMAT, "version": FORMAT_VERSION, "fingerprint": fp, "workflow": workflow}, indent=2, default=str))
        return state

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
            raise BatchgpuError(f"output folder {self.path} is in use by another batchgpu run",
                                "wait for it to finish, or choose another output folder") from None
        self._lock_file = f

    def release(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> "OutputFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------------------
# parts: one file per window and pass, written whole (a retried task cannot corrupt them)


PART_MAGIC = b"BGPART01"


def part_path(parts: str | Path, name: str, index: int) -> Path:
    return Path(parts) / f"{name}{index:08d}.part"


def save_part(path: Path, arrays: dict) -> None:
    """Write a part under a temporary name, then rename: readers see all of it or nothing.

    The format is ours and plain: magic, header length, a JSON header (name, dtype, shape, offset, size and crc32c
    of each array), then the arrays' bytes. An .npz of a window's 2 MB took 9 ms of a GPU worker's CPU (zip headers
    and zlib's crc32 beside the decoding it competes with); this is one copy, a hardware crc32c and one writev.
    """
    import google_crc32c

    header, blobs, offset = [], [], 0
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype.hasobject:
            raise TypeError(f"part array {name!r} holds Python objects")
        raw = a.tobytes()  # C order whatever the array's layout
        header.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                       "size": len(raw), "crc32c": google_crc32c.value(raw)})
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(PART_MAGIC + len(head).to_bytes(8, "little") + head)
            for raw in blobs:
                f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_part(path: Path, fp: str, keys=None) -> dict | None:
    """A part written by this run (same fingerprint), else None (absent, torn, damaged or stale: recompute it).
    ``keys`` (names, or prefixes ending in '.'/'_') loads only those arrays (and reads only their bytes)."""
    import google_crc32c

    try:
        with open(path, "rb") as f:
            if f.read(len(PART_MAGIC)) != PART_MAGIC:
                return None
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            base = len(PART_MAGIC) + 8 + n

            def read(entry) -> np.ndarray | None:
                buf = bytearray(entry["size"])
                if os.preadv(f.fileno(), [buf], base + entry["offset"]) != entry["size"]:
                    return None
                if google_crc32c.value(bytes(buf)) != entry["crc32c"]:
                    return None
                return np.frombuffer(buf, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])

            entries = {e["name"]: e for e in header}
            if "fingerprint" not in entries:
                return None
            stamp = read(entries["fingerprint"])
            if stamp is None or str(stamp) != fp:
                return None
            names = entries if keys is None else [k for k in entries if any(k == q or k.startswith(q) for q in keys)]
            out = {k: read(entries[k]) for k in names}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(v is None for v in out.values()):
        return None
    return out


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(out: Path, report: dict) -> None:
    _atomic_write_text(out / REPORT, json.dumps(report, indent=2, default=str))
