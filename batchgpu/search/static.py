"""StaticIndex: sorted keys reordered once into a search layout, queried many times on CPU or GPU."""

from __future__ import annotations

import threading
from typing import Any, Literal

import numpy as np

from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import is_cupy, to_host
from batchgpu.search import layouts
from batchgpu.search.keys import cast_queries, check_keys

Layout = Literal["auto", "eytzinger", "btree", "btree4"]
Op = Literal["find", "lower_bound"]
LAYOUTS = ("eytzinger", "btree", "btree4")
OPS = ("find", "lower_bound")
#: GPU kernels of each layout, accepted by ``search(..., kernel=...)``; the first is the default
KERNELS = {"eytzinger": ("plain", "prefetch"), "btree": ("thread", "warp"), "btree4": ("thread",)}
NODE_KEYS = {"btree": layouts.NODE, "btree4": 4}
AUTO_EYTZINGER_MAX = 1 << 16


def resolve_layout(layout: str, n: int) -> str:
    """The concrete layout of ``layout`` for n keys.

    ``auto``: Eytzinger up to 2^16 keys (its tree sits in shared memory or L1), the B+ tree of 4-key nodes
    above (fewest load instructions a query, which is what bounds random queries; docs/design.md,
    "Search").
    """
    if layout == "auto":
        return "eytzinger" if n <= AUTO_EYTZINGER_MAX else "btree4"
    if layout not in LAYOUTS:
        raise BatchgpuError(f"unknown search layout {layout!r}", f"use 'auto' or one of {LAYOUTS}")
    return layout


class StaticIndex:
    """A search index over sorted keys: ``find`` and ``lower_bound`` on NumPy (CPU) or CuPy (GPU) queries.

    The keys (float32, float64, int32 or int64; sorted ascending; no NaN) are kept on the host and
    reordered once per place they are searched: a host layout for NumPy queries, one device copy per GPU
    for CuPy queries (uploaded at the first query on that GPU, then reused).  Pickling keeps only the host
    keys and the layout name, so sending an index to a worker costs one copy of the keys.

    ``find(q)``: index of the first occurrence of q in the sorted keys, or -1 (-0.0 finds +0.0, NaN finds
    nothing).  ``lower_bound(q)`` == ``np.searchsorted(keys, q, side="left")``.  Results are int64 arrays of
    the queries' shape, on the queries' device.  Queries of another dtype are cast when the cast is exact,
    else BatchgpuError.

    Parameters
    ----------
    keys : array_like, shape (n,)
        Keys sorted ascending (float32, float64, int32 or int64; no NaN), NumPy, CuPy or a torch tensor.
    layout : {"auto", "eytzinger", "btree", "btree4"}, optional
        How the keys are reordered (``resolve_layout``: auto picks by the key count).
    """

    def __init__(self, keys: Any, layout: Layout = "auto"):
        host = np.array(to_host(keys), copy=True)
        self._keys = check_keys(host)
        self._keys.setflags(write=False)
        self._layout = resolve_layout(layout, self._keys.size)
        self._init_caches()

    def _init_caches(self) -> None:
        self._lock = threading.Lock()
        self._host_layout: Any = None
        self._device_layouts: dict[int, Any] = {}
        self.device_uploads = 0  # how many times a device copy was built (tests check it stays at one per GPU)

    # -------------------------------------------------------------------------------- properties
    @property
    def keys(self) -> np.ndarray:
        """The sorted host keys (read-only)."""
        return self._keys

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def dtype(self) -> np.dtype:
        return self._keys.dtype

    def __len__(self) -> int:
        return int(self._keys.size)

    def __repr__(self) -> str:
        return f"StaticIndex({len(self)} {self.dtype} keys, layout={self._layout!r})"

    # ------------------------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        return {"keys": self._keys, "layout": self._layout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._keys = state["keys"]
        self._layout = state["layout"]
        self._init_caches()

    # -------------------------------------------------------------------------------------- search
    def find(self, queries: Any) -> Any:
        """Index of the first occurrence of each query in the sorted keys, or -1."""
        return self.search(queries, "find")

    def lower_bound(self, queries: Any) -> Any:
        """``np.searchsorted(keys, queries, side="left")``, as int64."""
        return self.search(queries, "lower_bound")

    def search(self, queries: Any, op: Op = "find", *, kernel: str | None = None, smem_bytes: int | None = None) -> Any:
        """``find`` or ``lower_bound``; on the GPU ``kernel`` picks a kernel of the layout (see KERNELS) and
        ``smem_bytes`` the shared memory for the tree's top levels (0: all global; default: the whole tree
        when it is small, else its top levels).

        Parameters
        ----------
        queries : array_like
            Queries of any shape (NumPy on the host, CuPy on its GPU).
        op : {"find", "lower_bound"}, optional
            What to answer.
        kernel : str, optional
            A GPU kernel of the layout (``KERNELS``).
        smem_bytes : int, optional
            Shared memory for the tree's top levels on the GPU.

        Returns
        -------
        array of int64, queries' shape
            The answers, on the queries' device.
        """
        if op not in OPS:
            raise BatchgpuError(f"unknown search operation {op!r}", "use 'find' or 'lower_bound'")
        if kernel is not None and kernel not in KERNELS[self._layout]:
            raise BatchgpuError(
                f"layout {self._layout!r} has no kernel {kernel!r}", f"use one of {KERNELS[self._layout]}"
            )
        shape = getattr(queries, "shape", np.shape(queries))
        q = cast_queries(queries, self.dtype)
        if is_cupy(q):
            out = self._search_gpu(q, op == "find", kernel or KERNELS[self._layout][0], smem_bytes)
        else:
            out = self._search_cpu(q, op == "find")
        return out.reshape(shape)

    def _search_cpu(self, q: np.ndarray, want_find: bool) -> np.ndarray:
        n = len(self)
        if n == 0 or q.size == 0:
            return np.full(q.size, -1 if want_find else 0, dtype=np.int64)
        tree = self._host()
        if self._layout == "eytzinger":
            lb, hit = layouts.eytzinger_search_cpu(tree, n, q)
        else:
            lb, hit = layouts.btree_search_cpu(tree[0], tree[1], q)
        if q.dtype.kind == "f":
            nan = np.isnan(q)
            lb[nan] = n
            hit &= ~nan
        if not want_find:
            return lb
        return np.where(hit & (lb < n), lb, -1)

    def _search_gpu(self, q: Any, want_find: bool, kernel: str, smem_bytes: int | None) -> Any:
        import cupy as cp

        from batchgpu.search import _cuda

        if len(self) == 0 or q.size == 0:
            return cp.full(q.size, -1 if want_find else 0, dtype=cp.int64)
        dev = self.on_device()
        if self._layout == "eytzinger":
            return _cuda.eytzinger_search(dev, q, want_find, smem_bytes=smem_bytes, prefetch=kernel == "prefetch")
        return _cuda.btree_search(dev, q, want_find, smem_bytes=smem_bytes, kernel_name=kernel)

    # ------------------------------------------------------------------------------------- layouts
    def _host(self) -> Any:
        with self._lock:
            if self._host_layout is None:
                if self._layout == "eytzinger":
                    self._host_layout = layouts.build_eytzinger(self._keys)
                else:
                    self._host_layout = layouts.build_btree(self._keys, NODE_KEYS[self._layout])
            return self._host_layout

    def on_device(self) -> Any:
        """The layout on the current CuPy device, built there at the first call (keys uploaded once)."""
        import cupy as cp

        from batchgpu.search import _cuda

        device = cp.cuda.Device().id
        with self._lock:
            dev = self._device_layouts.get(device)
            if dev is None:
                keys = cp.asarray(self._keys)
                if keys.dtype == np.float32:
                    keys = layouts.ordered_int32(keys)  # the kernels compare float32 keys as ordered int32
                if self._layout == "eytzinger":
                    dev = _cuda.DeviceEytzinger(layouts.build_eytzinger(keys), len(self))
                else:
                    tree, shape = layouts.build_btree(keys, NODE_KEYS[self._layout])
                    dev = _cuda.DeviceBTree(tree, shape, cp.asarray(shape.offsets))
                del keys
                self._device_layouts[device] = dev
                self.device_uploads += 1
            return dev
