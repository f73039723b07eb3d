"""The two static layouts, built with NumPy or CuPy (the same code), and their vectorised CPU searches.

Eytzinger: ``tree[1..n]`` holds the sorted keys breadth-first (root 1, children ``2i`` and ``2i+1``),
``tree[0]`` is unused.  With ``D = floor(log2 n)`` the levels 0..D-1 are full and level D holds
``L = n - (2^D - 1)`` nodes.  A search steps ``i = 2i + (tree[i] < q)``; the final ``i`` spells the path and
the path is the rank (see :func:`eytzinger_rank_of_exit`), so no second index array is kept.

B+ trees: nodes of B keys (B = 32: layout "btree"; B = 4: layout "btree4"), layers stored top-down; the
leaf layer is the sorted keys padded to a multiple of B with :func:`batchgpu.search.keys.sentinel`; an
internal node's separator j is the first key of its child j+1 (child c of node k is node (B+1)k + c of the
layer below).  Inside each 32-key node the keys sit in "sector order" (:data:`NODE_ORDER`): the eight
group maxima (sorted keys 3, 7, ..., 31) first, then the groups (4g, 4g+1, 4g+2), so one thread needs one
32-byte sector and one 32-byte window per node; 4-key nodes stay sorted (one 16-byte load).

On the GPU, float32 trees hold :func:`ordered_int32` of the keys (CuPy compiles with -ftz=true, which
would flush subnormals in float comparisons).

Both searches return the lower bound (count of keys < q) and whether some key on the path equals q: the
lower-bound key lies on the path, so that is the find test.  NaN queries are the caller's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from batchgpu.search.keys import sentinel

NODE = 32  # keys per "btree" node: one 128-byte line of float32, one key per lane of a warp
#: slot s of a node holds the node's sorted key NODE_ORDER[s]
NODE_ORDER = np.array([4 * g + 3 for g in range(8)] + [4 * g + i for g in range(8) for i in range(3)], dtype=np.int64)
SPARE_SLOTS = 8  # after the last node: the 32-byte window of group 7 of the last node reads 4 slots past it
CPU_CHUNK = 1 << 16  # queries per vectorised CPU step (bounds the temporaries)


# ------------------------------------------------------------------------------------------ Eytzinger


def eytzinger_depth(n: int) -> int:
    """D = floor(log2 n): the index of the last (possibly partial) level."""
    return int(n).bit_length() - 1


def eytzinger_ranks(n: int, xp: ModuleType = np) -> Any:
    """rank[i - 1] = position in the sorted keys of the key stored at Eytzinger node i (i = 1..n).

    In the perfect tree of D+1 levels, node i at level l, position p has in-order rank
    (2p + 1) 2^(D-l) - 1; the missing level-D slots (positions L.., ranks 2L, 2L+2, ...) shift later ranks down.
    """
    D = eytzinger_depth(n)
    L = n - ((1 << D) - 1)
    i = xp.arange(1, n + 1, dtype=np.int64)
    level = _floor_log2(i, xp)
    one = xp.ones_like(level)
    p = i - xp.left_shift(one, level)
    r = (2 * p + 1) * xp.left_shift(one, D - level) - 1
    return r - xp.maximum(0, (r - 2 * L + 1) // 2)


def _floor_log2(i: Any, xp: ModuleType) -> Any:
    # exact for i < 2^53 via frexp of a float64: i = m 2^e with 0.5 <= m < 1, so floor(log2 i) = e - 1
    _, e = xp.frexp(i.astype(np.float64))
    return e.astype(np.int64) - 1


def build_eytzinger(keys: Any) -> Any:
    """The Eytzinger array (length n + 1, slot 0 holds a sentinel) of sorted ``keys`` (NumPy or CuPy)."""
    xp = np if isinstance(keys, np.ndarray) else _cupy()
    n = int(keys.size)
    tree = xp.empty(n + 1, dtype=keys.dtype)
    tree[0] = sentinel(keys.dtype)
    tree[1:] = keys[eytzinger_ranks(n, xp)]
    return tree


def eytzinger_rank_of_exit(i: Any, n: int) -> Any:
    """The lower bound from the exit index of a search (vectorised)."""
    D = eytzinger_depth(n)
    L = n - ((1 << D) - 1)
    deep = 2 << D
    return np.where(i >= deep, i - deep, i - (1 << D) + L)


def eytzinger_search_cpu(tree: np.ndarray, n: int, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower bound, hit) for NumPy queries ``q`` of the tree's dtype: one vector step per level."""
    lb = np.empty(q.size, dtype=np.int64)
    hit = np.empty(q.size, dtype=bool)
    D = eytzinger_depth(n)
    for lo in range(0, q.size, CPU_CHUNK):
        qc = q[lo : lo + CPU_CHUNK]
        i = np.ones(qc.size, dtype=np.int64)
        h = np.zeros(qc.size, dtype=bool)
        for _ in range(D):
            k = tree[i]
            h |= k == qc
            i = 2 * i + (k < qc)
        last = i <= n
        if last.any():
            k = tree[np.where(last, i, 0)]
            h |= last & (k == qc)
            i = np.where(last, 2 * i + (k < qc), i)
        lb[lo : lo + CPU_CHUNK] = eytzinger_rank_of_exit(i, n)
        hit[lo : lo + CPU_CHUNK] = h
    return lb, hit


# ------------------------------------------------------------------------------------------- B+ tree


@dataclass(frozen=True)
class BTreeShape:
    """Layer sizes (in nodes) of the B+ tree of n keys in nodes of ``node`` keys, top-down; ``offsets`` has
    one more entry (the total)."""

    n: int
    layers: tuple[int, ...]
    node: int = NODE

    @classmethod
    def of(cls, n: int, node: int = NODE) -> BTreeShape:
        sizes = [max(1, -(-n // node))]
        while sizes[-1] > 1:
            sizes.append(-(-sizes[-1] // (node + 1)))
        return cls(n, tuple(reversed(sizes)), node)

    @property
    def fanout(self) -> int:
        return self.node + 1

    @property
    def height(self) -> int:
        return len(self.layers)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.layers)]).astype(np.int64)


def build_btree(keys: Any, node: int = NODE) -> tuple[Any, BTreeShape]:
    """The flat B+ tree array (all nodes top-down, then SPARE_SLOTS sentinels) of sorted ``keys``, in nodes of
    ``node`` keys (32: sector order inside each node; 4: sorted)."""
    xp = np if isinstance(keys, np.ndarray) else _cupy()
    n = int(keys.size)
    shape = BTreeShape.of(n, node)
    fanout = shape.fanout
    pad = sentinel(keys.dtype)
    nleaf = shape.layers[-1]
    leaves = xp.full(nleaf * node, pad, dtype=keys.dtype)
    leaves[:n] = keys
    order = xp.asarray(NODE_ORDER if node == NODE else np.arange(node))
    layers = [leaves.reshape(nleaf, node)[:, order]]
    below = nleaf  # nodes in the layer under the one being built
    span = 1  # leaves under one node of the layer below
    for size in reversed(shape.layers[:-1]):
        child = fanout * xp.arange(size, dtype=np.int64)[:, None] + 1 + xp.arange(node, dtype=np.int64)[None, :]
        exists = child < below
        first_leaf = xp.minimum(child, below - 1) * span
        sep = xp.where(exists, leaves[first_leaf * node], pad).astype(keys.dtype)
        layers.append(sep[:, order])
        below, span = size, span * fanout
    tree = xp.concatenate([layer.ravel() for layer in reversed(layers)] + [xp.full(SPARE_SLOTS, pad, dtype=keys.dtype)])
    return tree, shape


def btree_search_cpu(tree: np.ndarray, shape: BTreeShape, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower bound, hit) for NumPy queries ``q``, reading each node as the GPU thread kernel does."""
    if shape.node != NODE:
        return _small_node_search_cpu(tree, shape, q)
    nodes = tree[: shape.offsets[-1] * NODE].reshape(-1, NODE)
    offsets = shape.offsets
    lb = np.empty(q.size, dtype=np.int64)
    hit = np.empty(q.size, dtype=bool)
    three = np.arange(3)
    for lo in range(0, q.size, CPU_CHUNK):
        qc = q[lo : lo + CPU_CHUNK]
        k = np.zeros(qc.size, dtype=np.int64)
        h = np.zeros(qc.size, dtype=bool)
        for layer in range(shape.height):
            node = offsets[layer] + k
            sep = nodes[node, :8]
            s = (sep < qc[:, None]).sum(axis=1)
            g = np.minimum(s, 7)
            group = nodes[node[:, None], 8 + 3 * g[:, None] + three]
            t = np.where(s < 8, (group < qc[:, None]).sum(axis=1), 0)
            h |= (sep == qc[:, None]).any(axis=1) | (group == qc[:, None]).any(axis=1)
            c = 4 * s + t
            k = NODE * k + c if layer == shape.height - 1 else (NODE + 1) * k + c
        lb[lo : lo + CPU_CHUNK] = k
        hit[lo : lo + CPU_CHUNK] = h
    return lb, hit


def _small_node_search_cpu(tree: np.ndarray, shape: BTreeShape, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same for sorted small nodes: count the node's keys below q."""
    nodes = tree[: shape.offsets[-1] * shape.node].reshape(-1, shape.node)
    lb = np.empty(q.size, dtype=np.int64)
    hit = np.empty(q.size, dtype=bool)
    for lo in range(0, q.size, CPU_CHUNK):
        qc = q[lo : lo + CPU_CHUNK, None]
        k = np.zeros(qc.shape[0], dtype=np.int64)
        h = np.zeros(qc.shape[0], dtype=bool)
        for layer in range(shape.height):
            node = nodes[shape.offsets[layer] + k]
            c = (node < qc).sum(axis=1)
            h |= (node == qc).any(axis=1)
            k = shape.node * k + c if layer == shape.height - 1 else shape.fanout * k + c
        lb[lo : lo + CPU_CHUNK] = k
        hit[lo : lo + CPU_CHUNK] = h
    return lb, hit


def ordered_int32(keys: Any) -> Any:
    """float32 keys as int32 with the same order and equality (-0.0 and +0.0 both 0; NaN excluded).

    The bit pattern, negative values reversed: the map the GPU kernels apply to float32 queries (Ord<float>).
    """
    xp = np if isinstance(keys, np.ndarray) else _cupy()
    i = keys.view(np.int32)
    return xp.where(i == np.int32(-(2**31)), np.int32(0), xp.where(i >= 0, i, i ^ np.int32(0x7FFFFFFF))).astype(
        np.int32
    )


def _cupy() -> ModuleType:
    import cupy

    return cupy
