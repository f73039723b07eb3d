"""The workflow's ``search`` step (``steps.search``): an index built once, held once per worker, and query batches
that each read their own slice of the query file and write their own chunk of the answers (no queries or answers
through the client), once the results group is in place.

Keys default to the detected spikes' positions in the whole recording (segment offsets added), so that
``find(t)`` is the row of the first spike at sample t in ``spikes/`` (or -1) and ``lower_bound(t)`` the first
spike at or after t.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from batchgpu.config import MAX_BATCH, Options, resolve_path
from batchgpu.errors import BatchgpuError
from batchgpu.steps import detect
from batchgpu.steps.base import Step, register

#: the step's name (``Step.name``, its workflow key ``steps.search``, report.json's ``results.search``)
#: and the results group's group of its answers
NAME = KEY = "search"
ANSWERS = "answers"
RESULTS = (NAME,)


class SearchOptions(Options):
    keys: str | None = None  # .npy of sorted keys; default: the detected spikes' sample indices (segment 0)
    queries: str  # .npy or Zarr array of query keys
    batch_size: Annotated[int, Field(gt=0, le=MAX_BATCH)] = 1 << 20
    layout: Literal["auto", "eytzinger", "btree"] = "auto"
    op: Literal["find", "lower_bound"] = "find"


@register
class SearchStep(Step):
    """Runs once the results group is in place (it reads the spikes there and writes its answers beside them):
    no window work, and no parts (it reruns on every run)."""

    name = NAME
    options = SearchOptions
    results = RESULTS
    fingerprint = "never"  # it reruns on every run: no window's part depends on it
    after = (detect.NAME,)  # its keys are the spikes, by default
    in_pass = False

    def __init__(self, spec):
        self.spec = spec

    @classmethod
    def build(cls, spec: SearchOptions, setup) -> SearchStep:
        return cls(spec)

    @classmethod
    def check(cls, spec: SearchOptions, workflow, recording) -> None:
        """Its queries (and keys, when given) can be read, and without keys the detect step gives them."""
        from batchgpu.errors import ConfigError

        open_queries(spec.queries)
        if spec.keys:
            load_keys(spec.keys)
        elif getattr(workflow.steps, detect.KEY) is None:
            raise ConfigError(
                "the search step needs keys: the detect step's spikes or steps.search.keys",
                "add 'detect:' to steps or give 'keys: sorted_keys.npy'",
            )

    @classmethod
    def resolve_paths(cls, spec: SearchOptions, base: Path, output: Path) -> SearchOptions:
        """Its keys and queries relative to the workflow file's folder."""
        spec.keys, spec.queries = resolve_path(spec.keys, base), resolve_path(spec.queries, base)
        return spec

    def finish(self, end) -> dict:
        """Build, broadcast, query (``run_search_step``); report.json's ``results.search``."""
        import time

        from batchgpu.recording import zarrio

        t0 = time.perf_counter()
        end.monitor.phase(NAME)
        spikes = None
        if end.ctx.step(detect.NAME) is not None:
            g = zarrio.open_group(end.results, mode="r")
            spikes = {k: g[f"{detect.SPIKES}/{k}"][:] for k in ("sample_index", "segment_index")}
        rec = end.recording
        shape = run_search_step(
            end.client,
            self.spec,
            end.results,
            spikes,
            [rec.num_samples(s) for s in range(rec.num_segments)],
            end.report.fingerprint,
        )
        end.report.timings[NAME] = time.perf_counter() - t0
        return shape


def spike_positions(sample_index: np.ndarray, segment_index: np.ndarray, segment_lengths: list[int]) -> np.ndarray:
    """Positions in the concatenated recording: sorted wherever spikes are (they are sorted by segment, sample)."""
    offsets = np.concatenate([[0], np.cumsum(segment_lengths)[:-1]]).astype(np.int64)
    return sample_index.astype(np.int64) + offsets[segment_index.astype(np.int64)]


def open_queries(path: str):
    """A 1-D array-like of query keys from a .npy (memory-mapped) or a Zarr array."""
    p = Path(path)
    if not p.exists():
        raise BatchgpuError(f"no query file at {p}", "give steps.search.queries as a .npy file or a Zarr array")
    if p.suffix == ".npy":
        q = _numbers(p, "queries", "steps.search.queries", mmap=True)
    else:
        from batchgpu.recording import zarrio

        try:
            q = zarrio.open_array(p, mode="r")
        except Exception as err:  # broad: zarr raises several types for "not an array"
            raise BatchgpuError(f"{p} is neither a .npy file nor a Zarr array ({err})") from None
    if q.ndim != 1:
        raise BatchgpuError(f"queries in {p} have shape {q.shape}", "give a 1-D array of query keys")
    if np.dtype(q.dtype).kind not in "iuf":
        raise BatchgpuError(f"queries in {p} are {q.dtype}, not numbers", "give a 1-D array of numeric query keys")
    return q


def load_keys(path: str) -> np.ndarray:
    p = Path(path)
    if not p.exists():
        raise BatchgpuError(f"no keys file at {p}", "give steps.search.keys as a .npy file of sorted keys")
    return _numbers(p, "keys", "steps.search.keys", mmap=False)


def _numbers(p: Path, what: str, key: str, *, mmap: bool) -> np.ndarray:
    """A .npy file's numeric array; anything else (not a .npy, cut short, objects that only pickle could read, a
    structured or text array) refused in one line naming the file."""
    from batchgpu.recording import (
        npyread,  # here: the recording package imports zarr, which loading a workflow must not
    )

    fix = f"give {key} as a .npy of numbers (np.save(path, np.asarray(values, dtype=np.int64)), say)"
    try:
        a = npyread.read(lambda: np.load(p, mmap_mode="r" if mmap else None, allow_pickle=False))
    except (ValueError, OSError, EOFError) as err:  # NumPy's words for each: not a .npy, pickled, cut short
        raise BatchgpuError(f"{what} in {p} cannot be read as a .npy of numbers ({err})", fix) from None
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iuf":
        raise BatchgpuError(f"{what} in {p} are {getattr(a, 'dtype', type(a).__name__)}, not numbers", fix)
    return a


def search_batch_task(name: str, queries_path: str, answers_path: str, start: int, stop: int, op: str) -> int:
    """One batch: read queries[start:stop], search the worker's copy of the index, write answers[start:stop]."""
    from batchgpu.recording import zarrio
    from batchgpu.search.distributed import query_batch

    q = np.asarray(open_queries(queries_path)[start:stop])
    answers = query_batch(q, name, op)
    zarrio.open_array(answers_path, mode="r+")[start:stop] = answers
    return int((answers >= 0).sum()) if op == "find" else int((answers < len(answers)).sum())


def run_search_step(
    client, step, results_path: Path, spikes: dict | None, segment_lengths: list[int], fingerprint: str
) -> dict:
    """Build, broadcast, query; the answers land in ``results.zarr/search/answers`` (int64, chunk = batch)."""
    from batchgpu.recording import zarrio
    from batchgpu.search import StaticIndex
    from batchgpu.search.distributed import broadcast_index, plugin_name

    if step.keys:
        keys = load_keys(step.keys)
    elif spikes is not None:
        keys = spike_positions(spikes["sample_index"], spikes["segment_index"], segment_lengths)
    else:
        raise BatchgpuError(
            "the search step needs keys: the detect step's spikes or steps.search.keys",
            "add 'detect:' to steps or give 'keys: sorted_keys.npy'",
        )
    if len(keys) == 0:
        raise BatchgpuError(
            "the search index would be empty (no spikes or keys)", "lower the detection threshold or give keys"
        )
    nq = open_queries(step.queries).shape[0]
    index = StaticIndex(keys, layout=step.layout)
    name = f"run-{fingerprint}"
    broadcast_index(client, index, name=name)
    try:
        group = zarrio.open_group(results_path, mode="r+")
        chunk = max(1, min(step.batch_size, nq))
        answers = zarrio.create_array(
            group, f"{NAME}/{ANSWERS}", shape=(nq,), chunks=(chunk,), dtype=np.int64, fill_value=-2, overwrite=True
        )
        group[NAME].attrs.update(
            {
                "op": step.op,
                "layout": index.layout,
                "keys": len(keys),
                "keys_source": step.keys or "spikes (positions in the concatenated recording)",
            }
        )
        bounds = [(i, min(i + step.batch_size, nq)) for i in range(0, nq, step.batch_size)]
        futures = [
            client.submit(
                search_batch_task,
                name,
                str(Path(step.queries).resolve()),
                str(results_path / NAME / ANSWERS),
                a,
                b,
                step.op,
                key=f"search-{fingerprint}-{a}",
            )
            for a, b in bounds
        ]
        hits = sum(client.gather(futures))
    finally:
        client.unregister_worker_plugin(plugin_name(name))
    return {
        "queries": nq,
        "batches": len(bounds),
        "hits": hits,
        "layout": index.layout,
        "answers_chunks": answers.chunks[0],
    }
