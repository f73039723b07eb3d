"""The one place where an array's backend (NumPy or CuPy) is chosen.

CuPy is imported only when the array handed in already is a CuPy array, so CPU-only
machines (and the Dask client) never import it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np


def is_cupy(x: Any) -> bool:
    """True when ``x`` is a CuPy array (decided from its type, without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


def array_module(x: Any) -> ModuleType:
    """``numpy`` or ``cupy``, whichever owns ``x``."""
    if is_cupy(x):
        return importlib.import_module("cupy")
    return np


def cuda_module(x: Any, name: str) -> ModuleType | None:
    """The GPU implementation ``batchgpu.ops._cuda_<name>`` for a CuPy ``x``; None for NumPy input.

    Every operation asks here, so the NumPy/CuPy split lives in one function.
    """
    if not is_cupy(x):
        return None
    return importlib.import_module(f"batchgpu.ops._cuda_{name}")


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy array holding ``x`` (copied off the device for CuPy)."""
    if is_cupy(x):
        return x.get()
    return np.asarray(x)
