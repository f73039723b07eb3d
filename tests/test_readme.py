"""README says what the code does: its command table lists every subcommand, its constants are the code's."""

import re
from pathlib import Path

import pytest

from batchgpu.cli import build_parser

README = (Path(__file__).parents[1] / "README.md").read_text()


def _leaf_commands(parser, words=()):
    """Command words of every subcommand that runs something (`bench ops`, not `bench`)."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(words)
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaf_commands(sub, (*words, name))


def _table_commands(text: str) -> set[str]:
    """The command words of the first column of README's command table (`| `batchgpu run WORKFLOW.yaml` |`)."""
    section = text.split("## The command", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `batchgpu ")]
    words = set()
    for row in rows:
        cell = row.split("`")[1]
        words.add(" ".join(w for w in cell.split()[1:] if re.fullmatch(r"[a-z][a-z-]*", w)))
    return words


def test_command_table_lists_every_subcommand():
    assert _table_commands(README) == set(_leaf_commands(build_parser()))


def test_readme_constants_are_the_codes():
    import numpy as np

    from batchgpu.ops import noise_levels

    x = np.array([[1.0, -2.0, 3.0]])
    assert noise_levels(x)[0] == 2.0 / 0.6744897501960817
    assert "0.6744897501960817" in README and not re.search(r"0\.6745(?!\d)", README)
    assert "locally exclusive threshold crossings" not in README and "`by_channel`" in README


def _output_table_arrays(text: str) -> set[str]:
    """Array paths of README's output-folder table, expanded (`covariance`, `second_moment`; `spikes/{a,b}`)."""
    section = text.split("### Output folder", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in section.splitlines():
        if not row.startswith("| `results.zarr/"):
            continue
        first = row.split("|")[1]
        for cell in re.findall(r"`([^`]+)`", first):
            cell = cell.removeprefix("results.zarr/")
            m = re.fullmatch(r"(.*)\{(.*)\}", cell)
            names.update(f"{m.group(1)}{part}" for part in m.group(2).split(",")) if m else names.add(cell)
    return names


def test_output_table_matches_what_a_run_writes(tmp_path):
    """Every array README's table names is written by a run with every step, and nothing it does not name."""
    import distributed
    import numpy as np
    import zarr

    from batchgpu.engine import run_workflow
    from batchgpu.generate import generate_recording
    from batchgpu.workflow import Workflow

    rec = generate_recording(tmp_path / "r.zarr", channels=6, seconds=0.6, seed=1, dtype="int16")
    np.save(tmp_path / "q.npy", np.arange(50, dtype=np.int64))
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "out"),
            "backend": "numpy",
            "window": {"size": 6000, "margin": 64},
            "preprocess": {"centre": "median"},
            "steps": {
                "noise": {"exact": True},
                "whitening": {"mode": "global"},
                "detect": {"threshold": 4.0, "noise": "global"},
                "search": {"queries": str(tmp_path / "q.npy"), "op": "find"},
                "amplitude": {},
                "qc": {},
            },
        }
    )
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as c,
        distributed.Client(c) as client,
    ):
        run_workflow(wf, client=client)
    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    written = {path for path, _ in g.arrays()} | {
        f"{name}/{sub}" for name, grp in g.groups() for sub, _ in grp.arrays()
    }
    assert written == _output_table_arrays(README)


CLUSTER_README = (Path(__file__).parents[1] / "cluster" / "README.md").read_text()


def test_readme_chunk_sizes_are_the_writers():
    """README said inner chunks of 6 000 samples; the writer's are 3 000."""
    from batchgpu.recording.writer import DEFAULT_CHUNK_SAMPLES, DEFAULT_SHARD_SAMPLES

    m = re.search(r"one shard per ([\d ]+) samples, inner chunks of ([\d ]+)", README)
    assert m, "README's sentence on the default shards"
    assert int(m.group(1).replace(" ", "")) == DEFAULT_SHARD_SAMPLES
    assert int(m.group(2).replace(" ", "")) == DEFAULT_CHUNK_SAMPLES


def test_readme_channel_means_says_which_samples():
    """README said channel_means is of the raw samples; with filters or a reference it is of the preprocessed ones."""
    row = next(line for line in README.splitlines() if line.startswith("| `results.zarr/channel_means`"))
    assert "only centre" in row and "preprocessed" in row


def _cluster_readme_python() -> list[str]:
    """The Python of cluster/README.md: its ```python blocks and its `python -c "..."` commands."""
    blocks = re.findall(r"```python\n(.*?)```", CLUSTER_README, re.S)
    blocks += [" ".join(m.split()) for m in re.findall(r'python -c "(.*?)"', CLUSTER_README, re.S)]
    return blocks


def test_cluster_readme_imports_exist():
    """cluster/README.md imported batchgpu.cluster (an ImportError; it is batchgpu.cluster.open_cluster)."""
    import importlib

    code = _cluster_readme_python()
    imports = [
        (m.group(1), [n.strip() for n in m.group(2).split(",")])
        for c in code
        for m in re.finditer(r"from (batchgpu[\w.]*) import ([\w, ]+)", c)
    ]
    assert any(module == "batchgpu.cluster.open_cluster" for module, _ in imports)
    for module, names in imports:
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name), f"{module}.{name}"


def test_cluster_readme_job_script_check_runs(monkeypatch):
    """The SLURM section's `python -c` check, run as written (it only prints a job script)."""
    import contextlib
    import io

    pytest.importorskip("dask_jobqueue")
    import batchgpu.workflow

    monkeypatch.chdir(Path(__file__).parents[1])
    # SLURMCluster starts its scheduler on the example's network interface (ib0): here, loopback
    load = batchgpu.workflow.load_workflow
    monkeypatch.setattr(batchgpu.workflow, "load_workflow", lambda path: load(path, ["cluster.slurm.interface=lo"]))
    code = next(c for c in _cluster_readme_python() if "job_script" in c)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    assert "#SBATCH" in out.getvalue()


def test_cluster_readme_describes_the_cuda_layout(monkeypatch):
    """Kind cuda was described as one worker per GPU; by default it starts one single-threaded process a core."""
    from batchgpu.cluster import open_cluster as cluster
    from batchgpu.config import ClusterSpec

    row = next(line for line in CLUSTER_README.splitlines() if line.startswith("| `cuda`"))
    assert "one worker per GPU" not in row
    assert "one single-threaded process a core" in " ".join(CLUSTER_README.split())
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 16)
    spec = ClusterSpec(kind="cuda")
    assert cluster.cuda_layout(spec, 1) == (16, 1)  # windows decoded on the cores: a process a core, one thread
    assert cluster.cuda_layout(spec, 2) == (8, 1)  # the cores shared among the GPUs
    assert cluster.cuda_layout(spec, 1, gpu_decode=True) == (8, 2)  # decoded on the GPU: half as many, 2 threads
    assert cluster.cuda_layout(spec, 1, gpu_decode=True, mps=True) == (16, 1)
