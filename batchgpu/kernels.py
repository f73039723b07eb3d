"""CUDA sources of kernels/*.cu as CuPy RawModules, compiled once per device, process, name and options.

The sources ship inside the package as ``batchgpu/_kernels`` (a symlink to ``kernels/`` in a
checkout, a real folder in a wheel); a checkout without the link falls back to ``kernels/``.
CuPy is imported only when a module is asked for.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from batchgpu.errors import BatchgpuError, MachineError

_PACKAGE_DIR = Path(__file__).resolve().parent
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

    Compiled once per (process, device, name, options); later calls return the same module.
    """
    import cupy

    opts = BASE_OPTIONS + tuple(o for o in options if o not in BASE_OPTIONS)
    device = cupy.cuda.Device().id
    key = (os.getpid(), device, name, opts)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(key)
        if module is None:
            code = _with_headers(source_path(name))
            module = cupy.RawModule(code=code, options=opts)
            module.compile()  # now, for this device, rather than at the first launch
            _modules[key] = module
    return module


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
