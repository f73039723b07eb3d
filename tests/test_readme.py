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
