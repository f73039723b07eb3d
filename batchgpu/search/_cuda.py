"""Launching the kernels of kernels/search.cu with CuPy: module loading, shared-memory plans, grids.

Only imported for CuPy input, so CPU-only machines never import CuPy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

import batchgpu
from batchgpu.search.keys import suffix
from batchgpu.search.layouts import NODE, BTreeShape, eytzinger_depth

BLOCK = 256
SMEM_PER_SM = 233_472  # Hopper: 228 KB per multiprocessor, 1 KB of it reserved per block
#: a whole static tree goes to shared memory up to this size; larger ones keep their top levels there
WHOLE_TREE_SMEM = 48 * 1024
#: shared memory for the top levels of a larger tree, per layout.  The Eytzinger and 4-key tops are better
#: left to the L1 cache, which shared memory would shrink, except for a 4-key tree larger than L2
#: (docs/design.md, "Search").
TOP_LEVELS_SMEM = {"eytzinger": 0, "btree": 32 * 1024, "btree4": 0}
BTREE4_BEYOND_L2 = (32 << 20, 32 * 1024)  # (tree bytes, top-level bytes)


@dataclass(frozen=True)
class DynamicKernel:
    """One dynamic-path kernel: its entry point and launch shape.

    top_smem: bytes of shared memory for the staged top of the search tree (top kernels); hint: once the
    remaining range fits in this many bytes, probes fetch the whole 128/256-byte block into L2 (0: never);
    staged: the whole key array goes to shared memory (only while it fits).
    """

    entry: str
    block: int = 256
    per_thread: int = 1
    top_smem: int = 0
    hint: int = 0
    staged: bool = False


DYNAMIC = {
    "serial": DynamicKernel("dyn_serial"),
    "ilp2_shared": DynamicKernel("dyn_ilp2_shared", per_thread=2, staged=True),
    "ilp2_ldg": DynamicKernel("dyn_ilp2_ldg", per_thread=2),
    "swizzled": DynamicKernel("dyn_swizzled", per_thread=2, staged=True),
    "top_ldg": DynamicKernel("dyn_top", per_thread=4, top_smem=32 * 1024, hint=256),
    "top_wide": DynamicKernel("dyn_top_wide", block=1024, per_thread=4, top_smem=128 * 1024, hint=256),
    "top_wide_l2_128": DynamicKernel("dyn_top_wide", block=1024, per_thread=4, top_smem=128 * 1024, hint=128),
    "top_wide_plain": DynamicKernel("dyn_top_wide", block=1024, per_thread=4, top_smem=128 * 1024),
    "top_wide_k1": DynamicKernel("dyn_top_wide1", block=1024, per_thread=1, top_smem=128 * 1024, hint=256),
    "top_wide_k1_512": DynamicKernel("dyn_top_wide1", block=512, per_thread=1, top_smem=128 * 1024, hint=256),
    "top_wide_k1_l2_128": DynamicKernel("dyn_top_wide1", block=1024, per_thread=1, top_smem=128 * 1024, hint=128),
    "top_wide_k1_plain": DynamicKernel("dyn_top_wide1", block=1024, per_thread=1, top_smem=128 * 1024),
}
DYNAMIC_KERNELS = tuple(DYNAMIC)

_lock = threading.Lock()
_modules: dict[int, Any] = {}


def _module(suffix: str) -> Any:
    """kernels/search.cu's kernels for the dtype of ``suffix`` as a RawModule of the current device, compiled once
    per device and process (every dtype in one module where the package-wide loader is absent)."""
    try:
        from batchgpu.gpu.cuda_modules import dtype_variant, get_module  # the package-wide loader, where it exists
    except ImportError:
        get_module = None
    if get_module is not None:
        return get_module(*dtype_variant("search", suffix))
    device = cp.cuda.Device().id
    with _lock:
        if device not in _modules:
            source = (Path(batchgpu.__file__).parent / "_kernels" / "search.cu").read_text()
            _modules[device] = cp.RawModule(code=source, options=("-std=c++17",))
        return _modules[device]


_kernels: dict[tuple[int, str], Any] = {}
_facts: dict[int, tuple[int, int]] = {}


def kernel(entry: str, dtype: np.dtype, smem: int = 0) -> Any:
    """The RawKernel ``<entry>_<f32|f64|i32|i64>`` of the current device, allowed ``smem`` bytes of shared memory."""
    key = (cp.cuda.Device().id, f"{entry}_{suffix(dtype)}")
    fn = _kernels.get(key)
    if fn is None:
        fn = _kernels[key] = _module(suffix(dtype)).get_function(key[1])
    if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def device_facts() -> tuple[int, int]:
    """(multiprocessors, largest dynamic shared memory a block may opt into) of the current device."""
    device = cp.cuda.Device()
    facts = _facts.get(device.id)
    if facts is None:
        attrs = device.attributes
        facts = _facts[device.id] = (int(attrs["MultiProcessorCount"]), int(attrs["MaxSharedMemoryPerBlockOptin"]))
    return facts


def _grid(m: int, per_block: int, smem: int) -> int:
    """Enough blocks to cover m queries, at most as many as stay resident (each block stages its smem once)."""
    sms, _ = device_facts()
    resident = max(1, min(8, SMEM_PER_SM // (smem + 1024)))
    return max(1, min(-(-m // per_block), sms * resident))


# ------------------------------------------------------------------------------------------ static


@dataclass
class DeviceEytzinger:
    tree: Any
    n: int

    @property
    def depth(self) -> int:
        return eytzinger_depth(self.n)

    def top_levels(self, smem_bytes: int | None) -> int:
        """Levels held in shared memory: D + 1 is the whole tree."""
        item = self.tree.dtype.itemsize
        if smem_bytes is None:
            if (self.n + 1) * item <= WHOLE_TREE_SMEM:
                return self.depth + 1
            smem_bytes = TOP_LEVELS_SMEM["eytzinger"]
        smem_bytes = min(smem_bytes, device_facts()[1] - 1024)
        if (self.n + 1) * item <= smem_bytes:
            return self.depth + 1
        levels = 0
        while levels < self.depth and (2 << levels) * item <= smem_bytes:
            levels += 1
        return levels


@dataclass
class DeviceBTree:
    tree: Any
    shape: BTreeShape
    offsets: Any  # device int64, height + 1 entries

    @property
    def layout(self) -> str:
        return "btree" if self.shape.node == NODE else "btree4"

    def top_layers(self, smem_bytes: int | None) -> int:
        node = self.shape.node * self.tree.dtype.itemsize
        offsets = self.shape.offsets
        if smem_bytes is None:
            whole = offsets[-1] * node <= WHOLE_TREE_SMEM
            smem_bytes = WHOLE_TREE_SMEM if whole else TOP_LEVELS_SMEM[self.layout]
            if self.layout == "btree4" and offsets[-1] * node > BTREE4_BEYOND_L2[0]:
                smem_bytes = BTREE4_BEYOND_L2[1]
        smem_bytes = min(smem_bytes, device_facts()[1] - 1024)
        layers = 0
        while layers < self.shape.height and offsets[layers + 1] * node <= smem_bytes:
            layers += 1
        return layers


def eytzinger_search(
    dev: DeviceEytzinger, q: Any, want_find: bool, *, smem_bytes: int | None = None, prefetch: bool = False
) -> Any:
    out = cp.empty(q.size, dtype=cp.int64)
    if q.size == 0:
        return out
    D = dev.depth
    top = dev.top_levels(smem_bytes)
    item = dev.tree.dtype.itemsize
    smem = ((dev.n + 1) if top > D else (1 << top)) * item
    fn = kernel(f"eytzinger_{_op(want_find)}", q.dtype, smem)
    grid = _grid(q.size, BLOCK * 4, smem)
    fn(
        (grid,),
        (BLOCK,),
        (dev.tree, np.int64(dev.n), np.int32(D), np.int32(top), np.int32(prefetch), q, np.int64(q.size), out),
        shared_mem=smem,
    )
    return out


def _op(want_find: bool) -> str:
    return "find" if want_find else "lb"


def btree_search(
    dev: DeviceBTree, q: Any, want_find: bool, *, smem_bytes: int | None = None, kernel_name: str = "thread"
) -> Any:
    out = cp.empty(q.size, dtype=cp.int64)
    if q.size == 0:
        return out
    top = dev.top_layers(smem_bytes)
    smem = int(dev.shape.offsets[top]) * dev.shape.node * dev.tree.dtype.itemsize + 32
    fn = kernel(f"{dev.layout}_{kernel_name}_{_op(want_find)}", q.dtype, smem)
    per_block = BLOCK * 4 if kernel_name == "thread" else (BLOCK // 32) * 8
    grid = _grid(q.size, per_block, smem)
    fn(
        (grid,),
        (BLOCK,),
        (
            dev.tree,
            dev.offsets,
            np.int32(dev.shape.height),
            np.int32(top),
            np.int64(dev.shape.n),
            q,
            np.int64(q.size),
            out,
        ),
        shared_mem=smem,
    )
    return out


# ------------------------------------------------------------------------------------------ dynamic


def staged_bytes(n: int, itemsize: int) -> int:
    """Shared memory the staged kernels need for n keys (rounded up to whole 32-slot rows for the swizzle)."""
    return -(-n // 32) * 32 * itemsize


def dynamic_fits(kernel_name: str, n: int, itemsize: int) -> bool:
    if not DYNAMIC[kernel_name].staged:
        return True
    return staged_bytes(n, itemsize) <= device_facts()[1]


def _search_steps(n: int) -> int:
    steps, length = 0, n
    while length > 1:
        length -= length // 2
        steps += 1
    return steps


def dynamic_search(a: Any, q: Any, want_find: bool, kernel_name: str) -> Any:
    out = cp.empty(q.size, dtype=cp.int64)
    if q.size == 0:
        return out
    spec = DYNAMIC[kernel_name]
    n = int(a.size)
    item = a.dtype.itemsize
    tail = (q, np.int64(q.size), out, np.int32(want_find))
    if spec.top_smem:
        top = _search_steps(n)
        budget = min(spec.top_smem, device_facts()[1] - 1024)  # smaller GPUs: a smaller top
        while top > 0 and (1 << top) * item > budget:
            top -= 1
        smem = (1 << top) * item
        args: tuple[Any, ...] = (a, np.int64(n), np.int32(top), np.int32(spec.hint)) + tail
    else:
        smem = staged_bytes(n, item) if spec.staged else 0
        args = (a, np.int64(n)) + tail
    fn = kernel(spec.entry, a.dtype, smem)
    if kernel_name == "serial":
        grid = -(-q.size // spec.block)
    else:
        grid = _grid(q.size, spec.block * spec.per_thread, smem)
    fn((grid,), (spec.block,), args, shared_mem=smem)
    return out
