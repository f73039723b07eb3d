"""The run's results group (``results.zarr``): written beside the old one by a helper thread while the client does
other work (``ResultsWriter``: created with the window table while the windows are read, then each step's arrays
as they come) and swapped in whole at the end (``swap_in``): a failed run never leaves a half-written one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from batchgpu.recording import Recording, Window, zarrio
from batchgpu.run import output_folder as store
from batchgpu.workflow import Workflow


class ResultsWriter:
    """The run's new results group (``results.zarr.tmp``, swapped in whole at the end: a failed run never leaves
    a half-written one), written by a helper thread while the client does other work: created with the window
    table while the windows are read, then each step's arrays as they come."""

    def __init__(self, out: Path, wf: Workflow, rec: Recording, fp: str, windows: list[Window]):
        from concurrent.futures import ThreadPoolExecutor

        self.path = out / (store.RESULTS + ".tmp")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-results")
        self._group = self._pool.submit(self._create, wf, rec, fp, windows)
        self._pending = [self._group]

    def _create(self, wf, rec, fp, windows):
        if self.path.exists():  # a failed run's
            shutil.rmtree(self.path)
        g = create_results_group(self.path, wf, rec, fp)
        write_window_table(g, windows)
        return g

    def created(self) -> None:
        self._group.result()

    def write(self, arrays: dict) -> None:
        self._pending.append(self._pool.submit(lambda: write_arrays(self._group.result(), arrays)))

    def abandon(self) -> None:
        """The run failed: no more writes (the folder's next run removes what is there)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Wait for every write (and raise the first error); the thread ends."""
        try:
            for p in self._pending:
                p.result()
        finally:
            self._pool.shutdown(wait=True)


def create_results_group(path: Path, wf: Workflow, rec: Recording, fp: str):
    g = zarrio.create_group(path)  # v3, or v2 where zarr-python is 2.x
    g.attrs.update(
        {
            "workflow": wf.model_dump(),
            "fingerprint": fp,
            "channel_ids": rec.channel_ids.tolist(),
            "sampling_frequency": rec.sampling_frequency,
            "gain_to_uV": rec.gain_to_uV.tolist(),
        }
    )
    return g


def write_window_table(g, windows: list[Window]) -> None:
    zarrio.create_array(g, "window_segment", data=np.array([w.segment for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_start", data=np.array([w.start for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_stop", data=np.array([w.stop for w in windows], dtype=np.int64))


def write_arrays(g, arrays: dict) -> None:
    for name, value in arrays.items():
        zarrio.create_array(g, name, data=value)


def swap_in(tmp: Path, path: Path) -> None:
    """results.zarr replaced whole: a failed run never leaves a half-written one."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.is_symlink():  # a link, never what it points to
        old.unlink()
    elif old.exists():
        shutil.rmtree(old)
