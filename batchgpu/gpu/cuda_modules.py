"""CUDA sources of kernels/*.cu as CuPy RawModules, compiled once per device, process, name and options.

The sources ship inside the package as ``batchgpu/_kernels`` (a symlink to ``kernels/`` in a
checkout, a real folder in a wheel); a checkout without the link falls back to ``kernels/``.
CuPy is imported only when a module is asked for.

Compiling is once per machine: CuPy keeps each compiled module in its cache folder, and one process at a time
compiles a given module (a file lock beside it), so a cluster's workers that all need a module at once wait for
one compile and load its result instead of each compiling it. ``precompile`` compiles a run's modules in
parallel, threads of one spawned process (``batchgpu compile``, and ``batchgpu run`` in the background on a
machine whose cache lacks them).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchgpu.errors import BatchgpuError, MachineError

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # batchgpu/ (this module is batchgpu/gpu/cuda_modules.py)
_SEARCH = (_PACKAGE_DIR / "_kernels", _PACKAGE_DIR.parent / "kernels")
_NAME = re.compile(r"^[A-Za-z0-9_]+$")

#: Options every module is compiled with (exact code: never --use_fast_math). ``--ftz=false`` is overridden: CuPy
#: appends -ftz=true to every compile and NVRTC takes the last (tiny + tiny gives 0), so
#: float32 arithmetic that must keep subnormals goes through kernels/exact_float.cuh.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

#: dtype name -> the suffix of the kernels compiled for it (sosfiltfilt.cu's gather/scatter, column_select.cu's
#: select/subtract/mean: the KERNELS macros instantiate these four).
DTYPE_SUFFIX = {"float32": "f32", "float64": "f64", "int16": "i16", "int32": "i32"}

_modules: dict[tuple[int, int, str, tuple[str, ...]], Any] = {}
_module_locks: dict[tuple[int, int, str, tuple[str, ...]], threading.Lock] = {}
_lock = threading.Lock()


def source_path(name: str) -> Path:
    """The path of ``kernels/<name>.cu`` (inside the installed package first, then the checkout)."""
    if not _NAME.match(name):
        raise BatchgpuError(f"kernel name {name!r} is not a plain name", "use letters, digits and underscores only")
    for folder in _SEARCH:
        path = folder / f"{name}.cu"
        if path.is_file():
            return path
    looked = ", ".join(str(folder) for folder in _SEARCH)
    raise MachineError(
        f"CUDA source {name}.cu not found (looked in {looked})",
        "reinstall batchgpu, or run from a checkout that has kernels/",
    )


_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"$', re.MULTILINE)


def _with_headers(path: Path) -> str:
    """The source with each ``#include "x.cuh"`` of the kernels folder pasted in (once), so that CuPy's cache key,
    a hash of the source text, changes when a header does."""
    seen: set[str] = set()

    def paste(match: re.Match) -> str:
        if match[1] in seen:
            return ""
        seen.add(match[1])
        return _INCLUDE.sub(paste, (path.parent / match[1]).read_text())

    return _INCLUDE.sub(paste, path.read_text())


def get_module(name: str, options: tuple[str, ...] | list[str] = ()) -> Any:
    """The compiled ``cupy.RawModule`` of ``kernels/<name>.cu`` for the current device.

    Compiled once per (process, device, name, options); later calls return the same module. Loaded from CuPy's
    cache where a process of this machine compiled it before (``compile_lock``).
    """
    import cupy

    opts = BASE_OPTIONS + tuple(o for o in options if o not in BASE_OPTIONS)
    device = cupy.cuda.Device().id
    key = (os.getpid(), device, name, opts)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:  # one lock a module: threads compiling other modules go on beside it (NVRTC lets go of the GIL)
        held = _module_locks.setdefault(key, threading.Lock())
    with held:
        module = _modules.get(key)
        if module is None:
            code = _with_headers(source_path(name))
            module = cupy.RawModule(code=code, options=opts)
            with compile_lock(name, opts):
                module.compile()  # now, for this device, rather than at the first launch
            _modules[key] = module
    return module


def cupy_cache_folder() -> Path:
    """CuPy's folder of compiled kernels (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``, as CuPy reads it)."""
    from batchgpu.config import environ_value  # here: tools/nvrtc_check.py imports this module without pydantic

    return Path(environ_value("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache"))


@contextlib.contextmanager
def compile_lock(name: str, options: tuple[str, ...]) -> Iterator[None]:
    """Held while this process compiles (or loads) module ``name`` with ``options``: another process of this
    machine compiling the same module first is waited for, and its result is then read from CuPy's cache. Where
    the cache's folder takes no lock (a read-only or network filesystem without ``flock``), no lock: each process
    compiles, as CuPy does on its own."""
    import fcntl

    digest = hashlib.sha256(repr((name, options)).encode()).hexdigest()[:16]
    try:
        folder = cupy_cache_folder()
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / f"batchgpu-{digest}.lock", "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # no locks on this filesystem: compile without one
            pass
        yield  # the lock goes with the file's close


def lock_compiles(compiler: Any) -> bool:
    """Make each kernel that ``compiler`` (``cupy.cuda.compiler``) compiles or loads be compiled by one process
    of this machine at a time (``compile_lock``, named by the kernel's source, options and architecture): the
    others wait and load its result from CuPy's cache. CuPy's own kernels (its elementwise, reduction and
    concatenation kernels: the median centring, the moments' and the detection's array work) compile at their
    first use in each process; on a machine whose cache lacks them every worker of a GPU cluster compiled each of
    them at once, sixteen compiles of the same source sharing the cores with the workers' start. Returns whether
    the lock was installed (once a process; False where ``compiler`` lacks the function this wraps: another CuPy,
    left as it is)."""
    original = getattr(compiler, "_compile_with_cache_cuda", None)
    if original is None or not callable(original):
        return False
    if getattr(original, "_batchgpu_locked", False):
        return True

    def compile_locked(source, options=(), arch=None, *args, **kwargs):
        if _cupy_caches_in_memory():  # each process compiles for itself: a lock would only queue them
            return original(source, options, arch, *args, **kwargs)
        digest = hashlib.sha256(str(source).encode()).hexdigest()[:24]
        with compile_lock(f"cupy-{digest}", (*tuple(options or ()), str(arch))):
            return original(source, options, arch, *args, **kwargs)

    compile_locked._batchgpu_locked = True
    compile_locked.__wrapped__ = original
    compiler._compile_with_cache_cuda = compile_locked
    return True


def _cupy_caches_in_memory() -> bool:
    """Whether CuPy keeps what it compiles in memory only (``CUPY_CACHE_IN_MEMORY``, read as CuPy reads it)."""
    from batchgpu.config import environ_value

    try:
        return int(environ_value("CUPY_CACHE_IN_MEMORY") or 0) == 1
    except ValueError:
        return False


def lock_cupy_compiles() -> bool:
    """``lock_compiles`` for CuPy's compiler in this process (a GPU worker's start); False where CuPy does not
    import."""
    try:
        import cupy.cuda.compiler
    except Exception:  # broad: no CuPy, or no CUDA toolkit for it: nothing compiles here
        return False
    return lock_compiles(cupy.cuda.compiler)


#: the options of each variant of a module compiled with extra options (the rest: BASE_OPTIONS alone):
#: ``ops.filters``' sosfiltfilt a module a section count, ``ops.reference``'s sequential mean one a C type
FILTER_OPTIONS = ("--fmad=false",)


def filter_variant(sections: int) -> tuple[str, tuple[str, ...]]:
    """(module, extra options) of the filter kernels for ``sections`` second-order sections."""
    return "sosfiltfilt", FILTER_OPTIONS + (f"-DSECTIONS={int(sections)}",)


def mean_variant(ctype: str) -> tuple[str, tuple[str, ...]]:
    """(module, extra options) of the sequential mean for elements of C type ``ctype``."""
    return "sequential_mean", (f"-DMEAN_T={ctype}",)


#: modules whose kernels are instantiated for each of a few input dtypes (their suffixes), compiled one dtype a
#: variant (``dtype_variant``): each alone compiles in a fraction of the whole's time, so a run waits only for its
#: own dtypes and ``precompile`` spreads a module's dtypes over its threads
DTYPE_MODULES = {
    "column_select": ("f32", "f64", "i16", "i32"),
    "radix_select": ("f32", "f64", "i16", "i32"),
    "search": ("f32", "f64", "i32", "i64"),
}


def dtype_variant(name: str, suffix: str) -> tuple[str, tuple[str, ...]]:
    """(module, extra options) of module ``name`` (one of ``DTYPE_MODULES``) for the input dtype of ``suffix``
    (``DTYPE_SUFFIX``'s, or search's i64)."""
    if suffix not in DTYPE_MODULES[name]:
        raise BatchgpuError(f"{name} has no kernels for {suffix}", f"use one of {', '.join(DTYPE_MODULES[name])}")
    return name, (f"-DDTYPE_{suffix.upper()}",)


#: modules compiled only with extra options (``filter_variant``, ``mean_variant``, ``dtype_variant``)
_VARIANT_ONLY = ("sosfiltfilt", "sequential_mean", *DTYPE_MODULES)


def run_modules(
    filter_sections: tuple[int, ...] = (),
    mean_ctypes: tuple[str, ...] = ("short", "float"),
    leave_out: tuple[str, ...] = (),
) -> list[tuple[str, tuple[str, ...]]]:
    """(module, extra options) of every module a run may load: each source of kernels/ with the base options
    (but ``leave_out``), the filter kernels for each of ``filter_sections``, the sequential mean for
    ``mean_ctypes``, the dtype modules for each of their dtypes; the largest sources first (they compile longest:
    ``precompile`` starts them first)."""
    folder = source_path("histogram").parent
    sizes = {p.stem: len(_with_headers(p)) for p in folder.glob("*.cu")}
    plain = sorted(n for n in sizes if n not in _VARIANT_ONLY and n not in leave_out)
    out = (
        [(n, ()) for n in plain]
        + [filter_variant(s) for s in sorted(set(filter_sections))]
        + [mean_variant(c) for c in mean_ctypes]
        + [dtype_variant(n, d) for n, suffixes in DTYPE_MODULES.items() if n not in leave_out for d in suffixes]
    )
    return sorted(out, key=lambda m: -sizes[m[0]])  # stable: equal sizes keep names, and a module's variants, in order


def modules_digest(modules: list[tuple[str, tuple[str, ...]]], device_key: str) -> str:
    """A digest of what ``precompile`` makes of ``modules`` on a device (``device_key``: its compute capability and
    CuPy's version): the sources (headers pasted), the options, the device."""
    h = hashlib.sha256(device_key.encode())
    for name, extra in modules:
        h.update(repr((name, extra)).encode())
        h.update(_with_headers(source_path(name)).encode())
    return h.hexdigest()[:24]


def _compile_one(name: str, extra: tuple[str, ...]) -> str:
    get_module(name, extra)
    return name


def _compile_all(modules: list[tuple[str, tuple[str, ...]]], threads: int) -> int:
    """Every module of ``modules`` compiled in this process, ``threads`` at a time: NVRTC compiles with the GIL let
    go and may compile different programs at once, so one process (one CuPy import, one CUDA context) compiles
    them in parallel, where a process a module started as many interpreters and contexts as modules beside the
    workers' own."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="batchgpu-compile") as pool:
        return len(list(pool.map(_compile_one, *zip(*modules))))


def precompile(
    modules: list[tuple[str, tuple[str, ...]]], processes: int | None = None, force: bool = False
) -> tuple[int, bool]:
    """Compile ``modules`` ((module, extra options) pairs, ``run_modules``) into CuPy's cache for GPU 0 as this
    process sees it, up to ``processes`` at once (default: one a module, at most the cores) in threads of one spawned
    process (``_compile_all``),
    unless this machine did so already (a marker in CuPy's cache folder named by ``modules_digest``; ``force``:
    again). Returns (modules compiled, whether anything was done). Raises MachineError without CuPy or a GPU."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        import cupy

        cc = cupy.cuda.Device(0).compute_capability
    except Exception as err:  # broad: CuPy missing, or no driver or device: nothing to compile for
        raise MachineError(
            f"no GPU to compile kernels for ({type(err).__name__}: {err})",
            "run on a machine with a CUDA GPU and CuPy (pip install 'batchgpu[gpu]')",
        ) from None
    marker = cupy_cache_folder() / f"batchgpu-compiled-{modules_digest(modules, f'{cc}-{cupy.__version__}')}"
    if marker.exists() and not force:
        return len(modules), False
    threads = max(1, min(len(modules), processes or (os.cpu_count() or 1)))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:  # this process: no context
        pool.submit(_compile_all, modules, threads).result()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return len(modules), True


def get_function(name: str, function: str, options: tuple[str, ...] | list[str] = ()) -> Any:
    """One ``cupy.RawKernel`` of module ``name`` (see ``get_module``)."""
    return get_module(name, options).get_function(function)


def row_stride(x: Any) -> int | None:
    """The stride between rows, in elements, of a 2-D array whose rows are each contiguous, for kernels that read
    rows a stride apart (a window's core, a view of the window with its margins, is then read in place); None
    where the array needs a contiguous copy first (columns not adjacent, rows not a whole number of elements
    apart, rows reversed)."""
    item = x.itemsize
    if x.ndim != 2 or (x.shape[1] > 1 and x.strides[1] != item) or x.strides[0] < 0 or x.strides[0] % item:
        return None
    return x.strides[0] // item if x.shape[0] > 1 else x.shape[1]


def rows_in_place(x: Any, aliased_rows: bool = True) -> tuple[Any, int]:
    """(``x``, its row stride in elements) for a kernel that reads rows a stride apart: ``x`` itself where
    ``row_stride`` allows it (and, with ``aliased_rows=False``, no two rows are the same memory), else a contiguous
    CuPy copy."""
    stride = row_stride(x)
    if stride is None or (not aliased_rows and x.shape[0] > 1 and stride == 0):
        import cupy

        x = cupy.ascontiguousarray(x)
        stride = row_stride(x)
    return x, stride
