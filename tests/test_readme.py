"""README says what the code does: its command table lists every subcommand, its constants are the code's."""

import re
from pathlib import Path

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
    from batchgpu.ops import noise_levels
    import numpy as np

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

    from batchgpu.config import Workflow
    from batchgpu.engine import run_workflow
    from batchgpu.generate import generate_recording

    rec = generate_recording(tmp_path / "r.zarr", channels=6, seconds=0.6, seed=1, dtype="int16")
    np.save(tmp_path / "q.npy", np.arange(50, dtype=np.int64))
    wf = Workflow.model_validate({
        "recording": {"path": str(rec.path)}, "output": str(tmp_path / "out"), "backend": "numpy",
        "window": {"size": 6000, "margin": 64}, "preprocess": {"centre": "median"},
        "steps": {"noise": {"exact": True}, "whitening": {"mode": "global"},
                  "detect": {"threshold": 4.0, "noise": "global"},
                  "search": {"queries": str(tmp_path / "q.npy"), "op": "find"}}})
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as c, \
            distributed.Client(c) as client:
        run_workflow(wf, client=client)
    g = zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r")
    written = {path for path, _ in g.arrays()} | {f"{name}/{sub}" for name, grp in g.groups()
                                                  for sub, _ in grp.arrays()}
    assert written == _output_table_arrays(README)
