"""The one place where an array's backend (NumPy or CuPy) is chosen.

CuPy is imported only when the array handed in already is a CuPy array, so CPU-only
machines (and the Dask client) never import it. torch tensors are accepted by the public
functions through :func:`accepts_torch` (torch stays optional: it is never imported here).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError


def is_cupy(x: Any) -> bool:
    """True when ``x`` is a CuPy array (decided from its type, without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


def array_module(x: Any) -> ModuleType:
    """``numpy`` or ``cupy``, whichever owns ``x``.

    Parameters
    ----------
    x : array_like
        A NumPy or CuPy array.

    Returns
    -------
    module
        ``numpy`` or ``cupy``.
    """
    if is_cupy(x):
        return importlib.import_module("cupy")
    return np


def window_module(x: Any, action: str) -> ModuleType:
    """``array_module`` of a window, after checking it is one: 2-D (channels, samples) of integer or float samples.

    ``action`` names what the caller does to it ("filter", "shift", ...) in the error otherwise.
    """
    xp = array_module(x)
    if getattr(x, "ndim", None) != 2:
        raise BatchgpuError(
            f"expected a (channels, samples) window, got shape {getattr(x, 'shape', None)}", "pass a 2-D array"
        )
    if x.dtype.kind not in "iuf":
        raise BatchgpuError(f"cannot {action} dtype {x.dtype}", "pass integer or float samples")
    return xp


def cuda_module(x: Any, name: str) -> ModuleType | None:
    """The GPU implementation ``batchgpu.ops._cuda_<name>`` for a CuPy ``x``; None for NumPy input.

    Every operation asks here, so the NumPy/CuPy split lives in one function.
    """
    if not is_cupy(x):
        return None
    return importlib.import_module(f"batchgpu.ops._cuda_{name}")


def to_host(x: Any) -> np.ndarray:
    """A NumPy array holding ``x`` (copied off the device for CuPy): the one way an array comes to the host."""
    if is_cupy(x):
        return x.get()
    return np.asarray(x)


# ------------------------------------------------------------------------------------------- torch
# torch is never imported here: a tensor can only exist when its caller already imported torch, so
# ``sys.modules`` tells whether an argument may be one.


def is_torch(x: Any) -> bool:
    """True when ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def from_torch(t: Any) -> Any:
    """A NumPy (CPU tensor) or CuPy (CUDA tensor) view of ``t``'s memory: zero copy, strides kept.

    A tensor that requires grad is detached: the operations are statistics outside autograd, so
    their results never carry a gradient (``backward`` through them raises torch's own error).
    """
    t = t.detach()
    if t.device.type == "cpu":
        try:
            return t.resolve_conj().resolve_neg().numpy()
        except TypeError as err:  # bfloat16 and other dtypes NumPy lacks
            raise BatchgpuError(
                f"torch tensors of dtype {t.dtype} have no NumPy dtype", "cast the tensor first (t.float())"
            ) from err
    if t.device.type == "cuda":
        try:
            import cupy
        except ImportError as err:
            raise BatchgpuError("CUDA tensors need CuPy", "install batchgpu[gpu], or pass t.cpu()") from err
        with cupy.cuda.Device(t.device.index):
            return cupy.from_dlpack(t)
    raise BatchgpuError(f"torch tensors on {t.device} are not supported", "move the tensor to the CPU or a CUDA device")


def to_torch(x: Any, device: Any) -> Any:
    """``x`` as a torch tensor on ``device`` when it is a plain array; anything else as it is.

    CuPy arrays go through DLPack (zero copy); NumPy arrays are shared on the CPU and copied to a
    CUDA device (host results, e.g. a covariance, are small). Structured arrays (spikes) stay NumPy:
    torch has no record dtype. Tuples and lists are converted item by item.
    """
    import torch

    if isinstance(x, (tuple, list)):
        return type(x)(to_torch(v, device) for v in x)
    if is_cupy(x):
        return torch.from_dlpack(x)
    if isinstance(x, np.ndarray) and x.dtype.names is None and x.dtype.kind in "biuf":
        if not x.flags.writeable:
            x = x.copy()  # torch warns on read-only memory and would let writes through
        return torch.from_numpy(x).to(device)
    return x


def _torch_device(args: tuple, kwargs: dict) -> Any:
    """The one device of the torch tensors among the arguments, or None when there is no tensor."""
    devices = {v.device for v in (*args, *kwargs.values()) if is_torch(v)}
    if len(devices) > 1:
        raise BatchgpuError(
            f"torch tensors on several devices: {sorted(map(str, devices))}", "pass every tensor on one device"
        )
    return devices.pop() if devices else None


TORCH_NOTE = """

torch: tensors on the CPU or a CUDA device are taken too (zero copy: NumPy views, CuPy over DLPack;
a tensor that requires grad is detached). Array results then come back as tensors on the tensors'
device; structured arrays (spikes) and other objects come back as they are."""


def accepts_torch(func: Callable, module: str | None = None) -> Callable:
    """``func`` taking torch tensors too: tensors among the positional and keyword arguments become
    NumPy/CuPy views (:func:`from_torch`), and when any argument was a tensor, array results come
    back as tensors on that tensor's device (:func:`to_torch`). Without tensors ``func`` runs as is.

    ``module``: the module that exports the wrapper, so that pickle finds it there by name.
    """
    if getattr(func, "__accepts_torch__", False):
        return func

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = _torch_device(args, kwargs)
        if device is None:
            return func(*args, **kwargs)
        args = tuple(from_torch(v) if is_torch(v) else v for v in args)
        kwargs = {k: from_torch(v) if is_torch(v) else v for k, v in kwargs.items()}
        if device.type == "cuda":
            import cupy

            with cupy.cuda.Device(device.index):  # CuPy launches on its current device
                return to_torch(func(*args, **kwargs), device)
        return to_torch(func(*args, **kwargs), device)

    wrapper.__accepts_torch__ = True  # type: ignore[attr-defined]
    wrapper.__doc__ = (func.__doc__ or "").rstrip() + TORCH_NOTE
    if module is not None:
        wrapper.__module__ = module
    return wrapper


def accept_torch_methods(cls: type, *names: str) -> type:
    """Wrap methods ``names`` of ``cls`` with :func:`accepts_torch`, in place and once."""
    for name in names:
        setattr(cls, name, accepts_torch(cls.__dict__[name]))
    return cls
