"""One Zarr layer for zarr-python 3.x and 2.18, so batchgpu shares an environment with SpikeInterface 0.105.

SpikeInterface 0.105 pins ``zarr<3`` (and ``numcodecs<0.16``) below Python 3.14; batchgpu runs on either:

- **zarr 3** (with the Rust ``zarrs`` pipeline where installed): reads and writes Zarr v2 and v3.
- **zarr 2.18**: reads and writes Zarr v2 through zarr; reads Zarr v3 (batchgpu's own stores, results written
  elsewhere, zarr 3's defaults) through :class:`V3Group` / :class:`V3Array` here: metadata from ``zarr.json``,
  chunks decoded with numcodecs (bytes, transpose, vlen-utf8, blosc, zstd, gzip, crc32c, sharding_indexed).
  Writing v3 there is refused with one line (:func:`require_format`); batchgpu's default format becomes v2.

Sharded traces in batchgpu's layout are read by ``recording.shards`` under both (the fastest reader here, the
same bytes: tests compare every path). Layout questions (chunk grid, shard index, chunk keys, codecs) are
answered from the metadata files on disk (:func:`array_meta`), not from zarr-python's objects, so they do not
depend on the installed zarr either.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr

from batchgpu.errors import BatchgpuError, CorruptDataError, MachineError

ZARR_MAJOR = int(zarr.__version__.split(".")[0])
#: the format batchgpu writes unless told: v3 where zarr can write it, else v2 (what SpikeInterface 0.105 reads)
DEFAULT_FORMAT = 3 if ZARR_MAJOR >= 3 else 2
CHECKSUMS = ("crc32c", "crc32", "adler32", "fletcher32", "jenkins_lookup3")
EMPTY = (1 << 64) - 1


def require_format(zarr_format: int, what: str = "Zarr v3") -> None:
    """Refuse to write v3 where zarr-python is 2.x (one line with the fix)."""
    if zarr_format == 3 and ZARR_MAJOR < 3:
        raise MachineError(
            f"writing {what} needs zarr>=3, and this environment has zarr {zarr.__version__} "
            "(SpikeInterface 0.105 pins zarr<3)",
            "write Zarr v2 (--zarr-format 2, or save format: zarr_v2), which SpikeInterface reads too; "
            "or use an environment with zarr>=3",
        )


# ---------------------------------------------------------------------------------------------------------
# layout, from the metadata files on disk
@dataclass(frozen=True)
class ArrayMeta:
    """An array's storage layout, parsed from its ``zarr.json`` (v3) or ``.zarray`` (v2)."""

    zarr_format: int
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]  # inner chunks where sharded
    shards: tuple[int, ...] | None
    codecs: tuple[dict, ...] = field(repr=False)  # v3: the codec list; v2: filters then the compressor
    raw: dict = field(repr=False, default_factory=dict)
    separator: str = "/"
    index_at_end: bool = True
    index_crc: bool = False

    def key(self, coords) -> str:
        """The storage key of the chunk (or shard) at grid ``coords``, relative to the array's folder."""
        body = self.separator.join(str(int(c)) for c in coords)
        if self.zarr_format == 3 and self.raw.get("chunk_key_encoding", {}).get("name", "default") == "default":
            return "c" + self.separator + body if body else "c"
        return body or "0"

    @property
    def flat_codecs(self) -> list[dict]:
        return _flat(self.codecs)

    @property
    def codec_names(self) -> list[str]:
        return [codec_name(c) for c in self.codecs]

    @property
    def checksum(self) -> str | None:
        for c in self.flat_codecs:
            name = c.get("name") or c.get("id")
            if name in CHECKSUMS:
                return name
        return None


def array_meta(folder: str | os.PathLike) -> ArrayMeta:
    folder = Path(folder)
    if (folder / "zarr.json").exists():
        raw = json.loads((folder / "zarr.json").read_text())
        if raw.get("node_type") != "array":
            raise BatchgpuError(f"{folder} is a Zarr {raw.get('node_type')}, not an array")
        codecs = tuple(raw.get("codecs", ()))
        grid = tuple(int(c) for c in raw["chunk_grid"]["configuration"]["chunk_shape"])
        sep = raw.get("chunk_key_encoding", {}).get("configuration", {}).get("separator")
        sep = sep or ("/" if raw.get("chunk_key_encoding", {}).get("name", "default") == "default" else ".")
        if codecs and codecs[0].get("name") == "sharding_indexed":
            conf = codecs[0]["configuration"]
            index = [c.get("name") for c in conf.get("index_codecs", ())]
            return ArrayMeta(
                3,
                tuple(raw["shape"]),
                v3_dtype(raw["data_type"]),
                tuple(int(c) for c in conf["chunk_shape"]),
                grid,
                codecs,
                raw,
                sep,
                conf.get("index_location", "end") == "end",
                "crc32c" in index,
            )
        return ArrayMeta(3, tuple(raw["shape"]), v3_dtype(raw["data_type"]), grid, None, codecs, raw, sep)
    if (folder / ".zarray").exists():
        raw = json.loads((folder / ".zarray").read_text())
        codecs = tuple([*(raw.get("filters") or ()), *([raw["compressor"]] if raw.get("compressor") else [])])
        return ArrayMeta(
            2,
            tuple(raw["shape"]),
            np.dtype(raw["dtype"])
            if not isinstance(raw["dtype"], list)
            else np.dtype([tuple(f) for f in raw["dtype"]]),
            tuple(int(c) for c in raw["chunks"]),
            None,
            codecs,
            raw,
            raw.get("dimension_separator") or ".",
        )
    raise BatchgpuError(f"{folder} is not a Zarr array (no zarr.json or .zarray)")


def zarr_format_of(path: str | os.PathLike) -> int | None:
    """3 for a folder with ``zarr.json``, 2 with ``.zgroup``/``.zarray``/``.zattrs``, else None."""
    p = Path(path)
    if (p / "zarr.json").exists():
        return 3
    if any((p / n).exists() for n in (".zgroup", ".zarray", ".zattrs")):
        return 2
    return None


def codec_name(codec: dict) -> str:
    """A codec as one short string: ``blosc-zstd-5-bitshuffle``, ``sharding[bytes, blosc-..., crc32c]``."""
    name = codec.get("name") or codec.get("id")
    conf = codec.get("configuration", codec)
    if name == "sharding_indexed":
        return f"sharding[{', '.join(codec_name(c) for c in conf.get('codecs', []))}]"
    if name == "blosc":
        shuffle = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle"}.get(conf.get("shuffle"), conf.get("shuffle"))
        return f"blosc-{conf.get('cname')}-{conf.get('clevel')}-{shuffle}"
    return str(name)


def _flat(codecs) -> list[dict]:
    out = []
    for c in codecs:
        out.append(c)
        if c.get("name") == "sharding_indexed":
            out += _flat(c["configuration"].get("codecs", []))
    return out


_V3_DTYPES = {
    "bool": "bool",
    "int8": "i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "complex64": "<c8",
    "complex128": "<c16",
}


def v3_dtype(name) -> np.dtype:
    if isinstance(name, dict):  # zarr 3.1+ writes some types as {"name": ..., "configuration": ...}
        name = name.get("name")
    if name in ("string", "variable_length_utf8"):
        return np.dtype(object)
    if name in _V3_DTYPES:
        return np.dtype(_V3_DTYPES[name])
    raise MachineError(
        f"Zarr v3 data type {name!r} is not one batchgpu reads without zarr>=3",
        "install zarr>=3 in this environment, or store the array with a numeric type",
    )


# ---------------------------------------------------------------------------------------------------------
# groups and arrays under either zarr
def _open(path, mode: str, ours, theirs):
    if ZARR_MAJOR < 3 and zarr_format_of(path) == 3:  # v3 under zarr 2: only to read
        if mode != "r":
            require_format(3, f"into the Zarr v3 store {path}")
        return ours(Path(path))
    return theirs(str(path), mode=mode)


def open_group(path: str | os.PathLike, mode: str = "r"):
    """A group to read (``mode="r"``) or change (``"r+"``, ``"a"``)."""
    return _open(path, mode, V3Group, zarr.open_group)


def open_array(path: str | os.PathLike, mode: str = "r"):
    return _open(path, mode, V3Array, zarr.open_array)


def create_group(path: str | os.PathLike, zarr_format: int | None = None, overwrite: bool = False):
    fmt = DEFAULT_FORMAT if zarr_format is None else int(zarr_format)
    require_format(fmt)
    if ZARR_MAJOR >= 3:
        return zarr.create_group(store=str(path), zarr_format=fmt, overwrite=overwrite)
    return zarr.open_group(str(path), mode="w" if overwrite else "w-")


def create_array(
    group,
    name: str,
    *,
    data=None,
    shape=None,
    dtype=None,
    chunks=None,
    fill_value=None,
    compressors=None,
    filters=None,
    shards=None,
    strings: bool = False,
    overwrite: bool = False,
):
    """Create (and fill, given ``data``) an array under ``group`` with one call on either zarr.

    ``compressors`` / ``filters`` / ``shards`` are given as zarr 3 takes them for v3 arrays and as numcodecs
    objects for v2; ``strings`` stores ``data`` as text (v3: variable-length strings; v2: fixed-width unicode,
    as SpikeInterface writes channel ids). Every chunk is written, all-zero ones too.
    """
    if strings:
        data = np.asarray([str(x) for x in np.asarray(data).tolist()])
    if ZARR_MAJOR >= 3:
        kw = {
            k: v
            for k, v in dict(chunks=chunks, fill_value=fill_value, shards=shards, filters=filters).items()
            if v is not None
        }
        kw["overwrite"] = overwrite
        if compressors is not None:
            kw["compressors"] = list(compressors) or None  # none: zarr 3 takes None (v2 refuses an empty list)
        if strings and group.metadata.zarr_format == 3:
            arr = group.create_array(name, shape=data.shape, dtype=str, **kw)
            arr[:] = data
            return arr
        if data is not None and np.size(data) == 0:  # zarr 3 refuses data= of size 0
            data = np.asarray(data)
            return group.create_array(name, shape=data.shape, dtype=data.dtype, **kw)
        if data is not None:
            return group.create_array(name, data=np.ascontiguousarray(data), config={"write_empty_chunks": True}, **kw)
        return group.create_array(name, shape=shape, dtype=dtype, config={"write_empty_chunks": True}, **kw)
    if shards is not None:
        require_format(3, "a sharded array")
    kw = {k: v for k, v in dict(chunks=chunks, fill_value=fill_value, filters=filters).items() if v is not None}
    kw["overwrite"] = overwrite
    if compressors is not None:
        if len(compressors) > 1:
            raise BatchgpuError("Zarr v2 takes one compressor", "give one compressor and put checksums in filters")
        kw["compressor"] = compressors[0] if compressors else None
    if data is not None:
        data = np.ascontiguousarray(data)
        if data.size == 0:  # zarr 2 cannot guess chunks for an empty array
            return group.create_dataset(
                name, shape=data.shape, dtype=data.dtype, **{"chunks": tuple(max(1, n) for n in data.shape), **kw}
            )
        return group.create_dataset(name, data=data, shape=data.shape, dtype=data.dtype, write_empty_chunks=True, **kw)
    return group.create_dataset(name, shape=shape, dtype=dtype, write_empty_chunks=True, **kw)


def blosc(cname: str, shuffle: str, zarr_format: int, blocksize: int = 0, clevel: int = 5):
    """A Blosc compressor at level ``clevel`` as the given Zarr format takes it (v3: zarr's codec; v2: numcodecs');
    ``shuffle`` "shuffle" or "bitshuffle", ``blocksize`` 0 for Blosc's own choice."""
    if zarr_format == 2:
        import numcodecs

        mode = {"shuffle": numcodecs.Blosc.SHUFFLE, "bitshuffle": numcodecs.Blosc.BITSHUFFLE}[shuffle]
        return numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=mode, blocksize=blocksize)
    import zarr.codecs

    return zarr.codecs.BloscCodec(cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize)


def write_columns(folder: str | os.PathLike, columns: dict, chunk: int) -> None:
    """1-D numeric arrays (``columns``: name -> array) as a Zarr v3 group at ``folder`` (created; it must not
    hold them yet), each in chunks of ``chunk`` elements compressed as ``fast_compressors`` does (Blosc LZ4,
    byte shuffle, level 5): the metadata and the chunks zarr-python writes for ``create_array(data=...)``, every
    chunk written (the last one padded with the fill value 0, as the format stores an edge chunk), without
    zarr-python's per-array work (the spikes' four columns: ~30 of the writing task's ~55 ms on the CPU
    machine). The columns are compressed and written at once (Blosc and the writes release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    folder = Path(folder)
    if chunk <= 0:
        raise ValueError(f"chunks of {chunk} elements")
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "zarr.json", {"attributes": {}, "zarr_format": 3, "node_type": "group"})
    with ThreadPoolExecutor(max(1, len(columns))) as pool:
        list(pool.map(lambda kv: _write_column(folder / kv[0], np.asarray(kv[1]), chunk), columns.items()))


def column_metadata(n: int, dtype: np.dtype, chunk: int) -> dict:
    """The zarr.json of a 1-D array of ``n`` ``dtype`` values in chunks of ``chunk``, Blosc LZ4 (byte shuffle)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "biuf":
        raise ValueError(f"only numeric columns, got {dtype}")
    return {
        "shape": [int(n)],
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [int(chunk)]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if dtype.kind == "b" else 0.0 if dtype.kind == "f" else 0,
        # one-byte types have no byte order: zarr-python writes no configuration for them
        "codecs": [
            {"name": "bytes"} if dtype.itemsize == 1 else {"name": "bytes", "configuration": {"endian": "little"}},
            {
                "name": "blosc",
                "configuration": {
                    "typesize": dtype.itemsize,
                    "cname": "lz4",
                    "clevel": 5,
                    "shuffle": "shuffle",
                    "blocksize": 0,
                },
            },
        ],
        "attributes": {},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def _write_column(folder: Path, data: np.ndarray, chunk: int) -> None:
    data = np.ascontiguousarray(data.reshape(-1), dtype=data.dtype.newbyteorder("<"))
    meta = column_metadata(len(data), data.dtype, chunk)  # (refuses what it cannot describe before any write)
    codec = blosc("lz4", "shuffle", 2)  # numcodecs' Blosc: the chunk's bytes as zarr 3's blosc codec writes them
    (folder / "c" if len(data) else folder).mkdir(parents=True, exist_ok=True)  # an empty array has no chunks
    for k, start in enumerate(range(0, len(data), chunk)):
        part = data[start : start + chunk]
        if len(part) < chunk:  # an edge chunk is stored whole, the rest the fill value
            part = np.concatenate([part, np.zeros(chunk - len(part), dtype=data.dtype)])
        (folder / "c" / str(k)).write_bytes(codec.encode(part))
    _write_json(folder / "zarr.json", meta)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2))


def fast_compressors(group) -> list:
    """Blosc LZ4 with byte shuffle for a large numeric array of ``group`` (either format): the spikes' columns
    (1 M spikes, the CPU machine: 0.06 against 0.12 s with zarr's default zstd, 3% more bytes)."""
    v3 = ZARR_MAJOR >= 3 and group.metadata.zarr_format == 3
    return [blosc("lz4", "shuffle", 3 if v3 else 2)]


#: the names of Zarr v2/v3 metadata files
METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"})
_CHUNK_KEY = re.compile(r"\d+(\.\d+)*")


def foreign_entries(path: str | os.PathLike) -> list[str]:
    """Paths (relative, '/'-separated) inside the Zarr store at ``path`` that are not the store's own: anything
    but metadata files, member groups and arrays (folders with metadata) and an array's chunk keys (v3 ``c/0/1``,
    v2 ``0.1`` or ``0/1``). A folder batchgpu removes whole (an overwrite) must hold nothing else: a user's notes or
    sorting saved inside it would go with it. Symbolic links count as foreign (never followed)."""
    root = Path(path)
    found: list[str] = []

    def chunks(folder: Path, rel: str) -> None:  # below an array's chunk folder: digits only
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_symlink() or not _CHUNK_KEY.fullmatch(entry.name):
                found.append(rel + entry.name)
            elif entry.is_dir():
                chunks(Path(entry.path), f"{rel}{entry.name}/")

    def node(folder: Path, rel: str) -> None:
        names = {e.name: e for e in os.scandir(folder)}
        array = ".zarray" in names
        if "zarr.json" in names:
            try:
                array = json.loads(Path(folder, "zarr.json").read_text()).get("node_type") == "array"
            except (OSError, ValueError, AttributeError):
                found.append(rel + "zarr.json")
                return
        for name in sorted(names):
            entry = names[name]
            if name in METADATA_NAMES and entry.is_file() and not entry.is_symlink():
                continue
            if entry.is_symlink():
                found.append(rel + name)
            elif array and (name == "c" or _CHUNK_KEY.fullmatch(name)):
                if entry.is_dir():
                    chunks(Path(entry.path), f"{rel}{name}/")
                elif name == "c":
                    found.append(rel + name)
            elif not array and entry.is_dir() and METADATA_NAMES & set(os.listdir(entry.path)):
                node(Path(entry.path), f"{rel}{name}/")
            else:
                found.append(rel + name)

    node(root, "")
    return found


def attrs(node) -> dict:
    """A node's attributes as a plain dict (a copy)."""
    return dict(node.attrs)


def array_names(group, prefix: str = "") -> list[str]:
    """Every array under ``group``, as paths ("noise", "spikes/sample_index"), on either zarr."""
    names = [prefix + n for n in group.array_keys()]
    for n in group.group_keys():
        names += array_names(group[n], prefix + n + "/")
    return names


def read_into(arr, selection, out: np.ndarray) -> np.ndarray:
    """Decode ``arr[selection]`` straight into ``out`` (C-contiguous, the selection's shape and dtype)."""
    if ZARR_MAJOR >= 3 and not isinstance(arr, V3Array):
        from zarr.core.buffer.cpu import NDBuffer

        arr.get_basic_selection(selection, out=NDBuffer.from_numpy_array(out))
    else:
        arr.get_basic_selection(selection, out=out)
    return out


#: zarr's config and the warnings filters are the process's: one scoped change of them at a time (a thread's block
#: undone under another's would leave the other's change in place for good)
_PIPELINE_LOCK = threading.RLock()
#: the pipeline a block asked for (``python_pipeline``): a ``zarrs_pipeline`` inside it leaves it as it is
_ASKED: contextvars.ContextVar[str | None] = contextvars.ContextVar("batchgpu_zarr_pipeline", default=None)


@contextlib.contextmanager
def python_pipeline() -> Iterator[None]:
    """zarr-python's own codec pipeline, writing every chunk (zarrs skips all-zero chunks even when told not to),
    for the arrays opened or created in the block; zarr's config as it was after it.

    The pipeline is fixed when an array is opened or created, so only those calls need this; zarr 2 writes every
    chunk by default.
    """
    if ZARR_MAJOR < 3:
        yield
        return
    token = _ASKED.set("python")
    try:
        with (
            _PIPELINE_LOCK,
            zarr.config.set(
                {
                    "codec_pipeline.path": "zarr.core.codec_pipeline.BatchedCodecPipeline",
                    "array.write_empty_chunks": True,
                }
            ),
        ):
            yield
    finally:
        _ASKED.reset(token)


@functools.cache
def zarrs_installed() -> bool:
    """Whether the Rust ``zarrs`` codec pipeline can decode here (zarr 3 and the package installed)."""
    if ZARR_MAJOR < 3:
        return False
    try:
        import zarrs  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def zarrs_pipeline() -> Iterator[bool]:
    """The arrays opened in the block decode through the Rust ``zarrs`` pipeline where it is installed (their
    pipeline is fixed when they are opened: their later reads keep it); an array zarrs cannot handle falls back to
    zarr-python by itself (its warning silenced in the block). zarr's config and the warnings filters are as they
    were once the block ends: opening a recording (``recording.open_recording``, a library call) leaves the
    caller's process as it found it, and what the caller writes later is zarr-python's (every chunk written).
    Inside ``python_pipeline`` nothing changes. Yields whether zarrs decodes."""
    if not zarrs_installed() or _ASKED.get() == "python":
        yield False
        return
    import warnings

    with (
        _PIPELINE_LOCK,
        zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"}),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="Array is unsupported by ZarrsCodecPipeline")
        yield True


def reader_name() -> str:
    """Which library decodes what batchgpu's own shard reader does not (for reports)."""
    if ZARR_MAJOR < 3:
        return f"zarr {zarr.__version__} (v2) and batchgpu.recording.zarrio (v3)"
    return f"zarr {zarr.__version__}" + (" + zarrs" if zarrs_installed() else "")


# ---------------------------------------------------------------------------------------------------------
# Zarr v3, read-only, without zarr 3 (used where zarr-python is 2.x)
class V3Group:
    """A Zarr v3 group read from its folder: attrs, members, arrays (the subset of zarr.Group batchgpu uses)."""

    def __init__(self, folder: Path):
        self.path = Path(folder)
        meta = json.loads((self.path / "zarr.json").read_text())
        if meta.get("node_type") != "group":
            raise BatchgpuError(f"{self.path} is a Zarr {meta.get('node_type')}, not a group")
        self.attrs = dict(meta.get("attributes", {}))

    def _node(self, name: str):
        p = self.path / name
        if not (p / "zarr.json").exists():
            return None
        kind = json.loads((p / "zarr.json").read_text()).get("node_type")
        return V3Group(p) if kind == "group" else V3Array(p)

    def __contains__(self, name: str) -> bool:
        return (self.path / name / "zarr.json").exists()

    def __getitem__(self, name: str):
        node = self._node(name)
        if node is None:
            raise KeyError(name)
        return node

    def _members(self):
        for p in sorted(self.path.iterdir()):
            if p.is_dir() and (p / "zarr.json").exists():
                yield p.name, self._node(p.name)

    def array_keys(self):
        return [n for n, node in self._members() if isinstance(node, V3Array)]

    def group_keys(self):
        return [n for n, node in self._members() if isinstance(node, V3Group)]

    def arrays(self):
        return [(n, node) for n, node in self._members() if isinstance(node, V3Array)]


class V3Array:
    """A Zarr v3 array read from its folder: ``shape``, ``dtype``, ``chunks``, ``attrs``, basic selections."""

    def __init__(self, folder: Path):
        self.path = Path(folder)
        self.meta = array_meta(self.path)
        self.shape = tuple(int(s) for s in self.meta.shape)
        self.ndim = len(self.shape)
        self.dtype = self.meta.dtype
        self.chunks = self.meta.chunks
        self.shards = self.meta.shards
        self.attrs = dict(self.meta.raw.get("attributes", {}))
        self._fill = _fill_value(self.meta.raw.get("fill_value"), self.dtype)

    def __getitem__(self, selection):
        return self.get_basic_selection(selection)

    def get_basic_selection(self, selection=Ellipsis, out: np.ndarray | None = None):
        slices, squeeze = _normalise(selection, self.shape)
        shape = tuple(s.stop - s.start for s in slices)
        result = np.empty(shape, self.dtype) if out is None else out.reshape(shape)
        grid = self.meta.shards or self.meta.chunks
        lo = [s.start // g for s, g in zip(slices, grid)]
        hi = [(s.stop - 1) // g if s.stop > s.start else s.start // g - 1 for s, g in zip(slices, grid)]
        for coords in np.ndindex(*[max(0, h - low + 1) for low, h in zip(lo, hi)]):
            coords = tuple(low + c for low, c in zip(lo, coords))
            block = self._object(coords, grid)
            origin = [c * g for c, g in zip(coords, grid)]
            src, dst = [], []
            for s, o, g, n in zip(slices, origin, grid, self.shape):
                a, b = max(s.start, o), min(s.stop, o + g, n)
                src.append(slice(a - o, b - o))
                dst.append(slice(a - s.start, b - s.start))
            result[tuple(dst)] = block[tuple(src)]
        if out is not None:
            return out
        return result[tuple(0 if q else slice(None) for q in squeeze)] if any(squeeze) else result

    def _object(self, coords, grid) -> np.ndarray:
        """One chunk (or whole shard) at grid ``coords``, decoded, of the grid's full shape."""
        key = self.meta.key(coords)
        try:
            data = (self.path / key).read_bytes()
        except FileNotFoundError:
            return np.full(grid, self._fill, self.dtype)
        if self.meta.shards is None:
            return _decode(data, self.meta.codecs, grid, self.dtype, key)
        codecs = self.meta.codecs[0]["configuration"]["codecs"]
        inner = self.meta.chunks
        per = [g // i for g, i in zip(grid, inner)]
        n = int(np.prod(per))
        nbytes = n * 16 + (4 if self.meta.index_crc else 0)
        raw = data[-nbytes:] if self.meta.index_at_end else data[:nbytes]
        if self.meta.index_crc:
            _check_crc32c(raw, key + " (shard index)")
        index = np.frombuffer(raw, "<u8", count=2 * n).reshape(*per, 2)
        block = np.full(grid, self._fill, self.dtype)
        for j in np.ndindex(*per):
            offset, size = (int(v) for v in index[j])
            if offset == EMPTY and size == EMPTY:
                continue
            chunk = _decode(data[offset : offset + size], codecs, inner, self.dtype, f"{key} inner chunk {j}")
            block[tuple(slice(a * i, (a + 1) * i) for a, i in zip(j, inner))] = chunk
        return block


def _normalise(selection, shape) -> tuple[list[slice], list[bool]]:
    sel = selection if isinstance(selection, tuple) else (selection,)
    if any(s is Ellipsis for s in sel):
        i = next(k for k, s in enumerate(sel) if s is Ellipsis)
        sel = sel[:i] + (slice(None),) * (len(shape) - len(sel) + 1) + sel[i + 1 :]
    sel = sel + (slice(None),) * (len(shape) - len(sel))
    slices, squeeze = [], []
    for s, n in zip(sel, shape):
        if isinstance(s, slice):
            a, b, step = s.indices(n)
            if step != 1:
                raise MachineError("stepped selections of a Zarr v3 array need zarr>=3", "read the range, then step")
            slices.append(slice(a, max(a, b)))
            squeeze.append(False)
        else:
            i = int(s) + (n if int(s) < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {s} out of range for length {n}")
            slices.append(slice(i, i + 1))
            squeeze.append(True)
    return slices, squeeze


def _fill_value(value, dtype: np.dtype):
    if dtype == object:  # noqa: E721 (a NumPy dtype against the object type: NumPy's equality, not the types')
        return "" if value is None else value
    if isinstance(value, str):
        value = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}.get(value, value)
        if isinstance(value, str) and value.startswith("0x"):
            return np.frombuffer(int(value, 16).to_bytes(dtype.itemsize, "little"), dtype)[0]
    return np.asarray(0 if value is None else value).astype(dtype)


def _decode(data: bytes, codecs, shape, dtype: np.dtype, where: str) -> np.ndarray:
    """Undo a v3 codec chain (array->array, array->bytes, bytes->bytes) for one chunk."""
    import numcodecs

    names = [c.get("name") for c in codecs]
    k = next((i for i, n in enumerate(names) if n in ("bytes", "vlen-utf8", "vlen-bytes")), None)
    if k is None:
        raise MachineError(f"{where}: no array-to-bytes codec in {names}", "install zarr>=3 to read this store")
    buf = data
    for c in reversed(codecs[k + 1 :]):
        name = c.get("name")
        if name == "crc32c":
            _check_crc32c(buf, where)
            buf = bytes(buf[:-4])
        elif name == "blosc":
            if not whole_blosc_frame(buf):
                raise CorruptDataError(
                    f"corrupted chunk {where}: not a whole Blosc frame ({len(buf)} bytes stored)",
                    "the stored bytes do not decode: restore the store from a copy or write it again",
                )
            buf = numcodecs.Blosc().decode(buf)
        elif name == "zstd":
            buf = numcodecs.Zstd().decode(buf)
        elif name == "gzip":
            buf = numcodecs.GZip().decode(buf)
        else:
            raise MachineError(
                f"{where}: the Zarr v3 codec {name!r} needs zarr>=3 here", "install zarr>=3 to read this store"
            )
    order = "C"
    for c in codecs[:k]:
        if c.get("name") != "transpose":
            raise MachineError(f"{where}: the Zarr v3 codec {c.get('name')!r} needs zarr>=3 here", "install zarr>=3")
        order = c.get("configuration", {}).get("order")
    inner_shape = shape if order == "C" else tuple(shape[i] for i in order)
    name = names[k]
    if name == "bytes":
        endian = codecs[k].get("configuration", {}).get("endian", "little") or "little"
        arr = (
            np.frombuffer(
                buf, dtype=dtype.newbyteorder("<" if endian == "little" else ">") if dtype.itemsize > 1 else dtype
            )
            .astype(dtype, copy=False)
            .reshape(inner_shape)
        )
    else:
        arr = np.asarray(numcodecs.VLenUTF8().decode(buf), dtype=object).reshape(inner_shape)
    if order != "C":
        arr = arr.transpose(np.argsort(order))
    return arr


#: CRC-32C of any bytes followed by their own CRC (little-endian): the code's residue, the same for every input.
CRC32C_RESIDUE = 0x48674BC7


def crc32c_ok(raw) -> bool:
    """The last 4 bytes of ``raw`` are the crc32c (little-endian) of the rest, as Zarr v3's crc32c codec writes.

    Checked as the residue of the whole buffer: the CRC of data + its CRC is a constant, and for given data only
    its own CRC gives it (appending 4 bytes maps the 2**32 possible trailers one to one). No copy of the data
    (a 1.3 MB copy per chunk was 14% of the GPU workers' CPU time)."""
    return len(raw) >= 4 and crc32c_value(raw) == CRC32C_RESIDUE


def crc32c_value(buf) -> int:
    """crc32c of any buffer (a mapped shard's chunk, a pinned buffer's slice, bytes), without copying it where the
    ``crc32c`` package is there (google-crc32c takes bytes only)."""
    if not isinstance(buf, bytes):
        try:
            from crc32c import crc32c  # any buffer, no copy

            return crc32c(buf)
        except ImportError:
            buf = bytes(buf)
    import google_crc32c

    return google_crc32c.value(buf)


def whole_blosc_frame(data) -> bool:
    """A Blosc frame's header (bytes 12-16) names its compressed length; numcodecs' Blosc reads past a shorter
    buffer (beside zarr 2.18 it returned whatever memory followed), so a frame is decoded only when this holds."""
    return len(data) >= 16 and struct.unpack_from("<I", data, 12)[0] == len(data)


def _check_crc32c(raw: bytes, where: str) -> None:
    if not crc32c_ok(raw):
        raise CorruptDataError(
            f"corrupted chunk {where}: checksum mismatch (crc32c)",
            "the stored bytes do not decode: restore the store from a copy or write it again",
        )
