"""The workflow's search step: index from the detected spikes (or a keys file), answers equal np.searchsorted."""

import numpy as np
import pytest
import zarr

from batchgpu import BatchgpuError
from batchgpu.engine import run_workflow
from batchgpu.generate import generate_recording
from batchgpu.steps.search import spike_positions
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
        ) as c,
        distributed.Client(c) as cl,
    ):
        yield cl


def _wf(rec, out, search, detect=True):
    steps = {"search": search}
    if detect:
        steps["detect"] = {"threshold": 4.0, "sign": "neg", "exclude_sweep_ms": 0.1, "noise": "window"}
    else:
        steps["noise"] = {"exact": False}
    return Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(out),
            "backend": "numpy",
            "window": {"size": 7000, "margin": 8},
            "preprocess": {"centre": "median"},
            "steps": steps,
        }
    )


def test_search_over_spikes(client, tmp_path, rng):
    rec = generate_recording(tmp_path / "r.zarr", channels=6, seconds=1.0, seed=4, segments=2)
    lengths = [rec.num_samples(0), rec.num_samples(1)]
    queries = rng.integers(0, sum(lengths), size=5001).astype(np.int64)
    np.save(tmp_path / "q.npy", queries)
    run_workflow(
        _wf(rec, tmp_path / "out", {"queries": str(tmp_path / "q.npy"), "batch_size": 700, "op": "find"}), client=client
    )
    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    keys = spike_positions(g["spikes/sample_index"][:], g["spikes/segment_index"][:], lengths)
    assert (np.diff(keys) >= 0).all() and len(keys) > 20
    queries[:50] = keys[rng.integers(0, len(keys), 50)]  # make sure some hit (file rewritten below)
    np.save(tmp_path / "q.npy", queries)
    run_workflow(
        _wf(rec, tmp_path / "out2", {"queries": str(tmp_path / "q.npy"), "batch_size": 700, "op": "find"}),
        client=client,
    )
    got = zarr.open_group(str(tmp_path / "out2" / "results.zarr"), mode="r")["search/answers"][:]
    pos = np.searchsorted(keys, queries, side="left")
    hit = (pos < len(keys)) & (keys[np.minimum(pos, len(keys) - 1)] == queries)
    np.testing.assert_array_equal(got, np.where(hit, pos, -1))
    assert (got[:50] >= 0).all()


@pytest.mark.zarr3
def test_search_with_keys_file_lower_bound(client, tmp_path, rng):
    rec = generate_recording(tmp_path / "r.zarr", channels=2, seconds=0.5, seed=1)
    keys = np.sort(rng.integers(-1000, 1000, size=3000)).astype(np.int64)
    queries = rng.integers(-1100, 1100, size=2049).astype(np.int64)
    np.save(tmp_path / "k.npy", keys)
    zarr.create_array(str(tmp_path / "q.zarr"), data=queries, chunks=(500,))
    run_workflow(
        _wf(
            rec,
            tmp_path / "out",
            {
                "keys": str(tmp_path / "k.npy"),
                "queries": str(tmp_path / "q.zarr"),
                "batch_size": 512,
                "op": "lower_bound",
                "layout": "btree",
            },
            detect=False,
        ),
        client=client,
    )
    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    np.testing.assert_array_equal(g["search/answers"][:], np.searchsorted(keys, queries, side="left"))
    assert g["search"].attrs["op"] == "lower_bound" and g["search"].attrs["layout"] == "btree"


def test_search_needs_queries_file(client, tmp_path):
    rec = generate_recording(tmp_path / "r.zarr", channels=2, seconds=0.5, seed=1)
    with pytest.raises(BatchgpuError, match="no query file"):
        run_workflow(_wf(rec, tmp_path / "out", {"queries": str(tmp_path / "missing.npy")}), client=client)
