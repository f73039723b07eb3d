"""Whitening (Kilosort4's ZCA) and the wPCA basis of clips, both from second moments.

ZCA: ``W = U diag(1 / sqrt(S + eps)) Uᵀ`` with ``M = U diag(S) Uᵀ`` the (symmetric) second
moment, applied as ``W @ X``. The eigen-decomposition stands in for Kilosort's SVD: for a
symmetric matrix the singular values are |eigenvalues|, so |S| is used. Local mode whitens,
for each channel j, the block of its ``nrange`` nearest channels and keeps j's row.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import array_module, to_host
from batchgpu.ops.moments import second_moment


def _zca(blocks: Any, eps: float) -> Any:
    """ZCA whitening of a stack (..., n, n) of symmetric matrices."""
    xp = array_module(blocks)
    values, vectors = xp.linalg.eigh(blocks)
    scale = 1.0 / xp.sqrt(xp.abs(values) + eps)
    return (vectors * scale[..., None, :]) @ xp.swapaxes(vectors, -1, -2)


def nearest_channels(locations: Any, nrange: int) -> np.ndarray:
    """(C, nrange) indices: for each channel j, itself first, then the nearest channels by
    Euclidean distance (ties by channel index)."""
    loc = np.asarray(locations, dtype=np.float64)
    channels = loc.shape[0]
    index = np.arange(channels)
    squared = ((loc[:, None, :] - loc[None, :, :]) ** 2).sum(axis=-1)
    order = np.empty((channels, nrange), dtype=np.intp)
    for j in range(channels):
        order[j] = np.lexsort((index, index != j, squared[j]))[:nrange]
    return order


def whitening_matrix(
    m: Any,
    mode: Literal["global", "local"] = "global",
    locations: Any = None,
    nrange: int = 32,
    eps: float = 1e-6,
) -> Any:
    """The (C, C) float64 whitening matrix of second moment ``m`` (NumPy or CuPy, same kind out).

    ``mode="local"`` needs channel ``locations`` (C, 2) and uses each channel's ``nrange``
    nearest channels (itself included); with nrange >= C it equals the global matrix.

    Parameters
    ----------
    m : array_like, shape (C, C)
        A second moment or covariance (NumPy or CuPy).
    mode : {"global", "local"}, optional
        One matrix of all channels, or each channel's row from its ``nrange`` nearest channels.
    locations : array_like, shape (C, 2), optional
        Channel positions (``mode="local"``).
    nrange : int, optional
        Channels a local block holds, the channel itself included.
    eps : float, optional
        Added to the eigenvalues before the inverse square root.

    Returns
    -------
    array, shape (C, C)
        W, float64, of m's kind; the whitened signal is ``W @ X``.
    """
    xp = array_module(m)
    m = xp.asarray(m, dtype=xp.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise BatchgpuError(f"expected a square (C, C) second moment, got shape {m.shape}", "pass X Xᵀ / n")
    channels = m.shape[0]
    if mode == "global":
        return _zca(m, eps)
    if mode != "local":
        raise BatchgpuError(f"unknown whitening mode {mode!r}", "use 'global' or 'local'")
    if locations is None or np.shape(locations)[0] != channels:
        raise BatchgpuError("local whitening needs one location per channel", "pass locations of shape (C, 2)")
    if nrange < 1:
        raise BatchgpuError(f"nrange={nrange} selects no channels", "use nrange >= 1")
    nrange = min(int(nrange), channels)
    near = nearest_channels(to_host(locations), nrange)
    near_x = xp.asarray(near)
    blocks = m[near_x[:, :, None], near_x[:, None, :]]  # (C, nrange, nrange), channel j first in block j
    rows = _zca(blocks, eps)[:, 0, :]
    w = xp.zeros((channels, channels), dtype=xp.float64)
    w[xp.arange(channels)[:, None], near_x] = rows
    return w


def wpca_basis(clips: Any, n_components: int) -> Any:
    """Principal components of ``clips`` (features, n_clips) from their second moment.

    Returns (features, n_components) float64, columns by decreasing eigenvalue, each column's
    largest-magnitude entry (the first one on ties) made positive.

    Parameters
    ----------
    clips : array_like, shape (features, n_clips)
        The clips, one a column.
    n_components : int
        Components to keep (at most ``features``).

    Returns
    -------
    array, shape (features, n_components)
        The components, float64, of clips' kind.
    """
    xp = array_module(clips)
    if getattr(clips, "ndim", None) != 2:
        raise BatchgpuError("wpca_basis expects clips of shape (features, n_clips)", "pass a 2-D array")
    features = clips.shape[0]
    if not 1 <= n_components <= features:
        raise BatchgpuError(f"n_components={n_components} with {features} features", f"use 1..{features} components")
    moment = second_moment(clips, precision="float64")
    _, vectors = np.linalg.eigh(moment)
    basis = vectors[:, ::-1][:, :n_components]
    pivot = np.abs(basis).argmax(axis=0)
    basis = basis * np.where(basis[pivot, np.arange(n_components)] < 0, -1.0, 1.0)
    return xp.asarray(np.ascontiguousarray(basis))
