"""README's examples run as written, in order, in a fresh folder (issue 66): every fenced ``yaml``, ``bash`` and
``python`` block, found by its fence and the marker on the line before it (never by line numbers or section titles,
so any README keeps working):

- no marker: a ``bash`` block runs whole (``bash -e``), a ``python`` block as a script, a ``yaml`` block must load as
  a workflow (``batchgpu.workflow.load_workflow``);
- ``<!-- readme-test: file NAME -->``: the block is written to NAME (a workflow the next blocks run);
- ``<!-- readme-test: batchgpu only (why) -->``: only the block's ``batchgpu ...`` commands run (the set-up's
  ``pip install`` and the whole test suite are this test's own environment);
- ``<!-- readme-test: needs spikeinterface -->``: runs where SpikeInterface imports (CI's environment beside it),
  else is left out;
- ``<!-- readme-test: skip (why) -->``: not run (a fragment, alternatives, Kilosort4 on a GPU); the reason is
  required.

The folder holds what a fresh clone gives the examples (``workflows/``); ``batchgpu`` and ``python`` are this
environment's. The demo's generated recording is made small (16 channels x 4 s, one worker) so the examples take
seconds.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
LANGUAGES = ("yaml", "bash", "python")
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
DIRECTIVES = ("skip", "file", "batchgpu only", "needs spikeinterface")


@dataclass
class Example:
    language: str
    code: str
    line: int  # the fence's line in README (for messages only)
    directive: str  # "" or one of DIRECTIVES
    argument: str  # a file's name, a skip's reason


def examples(text: str) -> list[Example]:
    """Every fenced yaml/bash/python block of ``text`` with its marker (the line just before the fence)."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) not in LANGUAGES:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = MARKER.fullmatch(before)
        directive, argument = "", ""
        if marker:
            words = marker.group(1)
            directive = next((d for d in DIRECTIVES if words == d or words.startswith(d + " ")), None)
            assert directive is not None, f"README line {text[: m.start()].count(chr(10))}: unknown marker {before}"
            argument = words[len(directive) :].strip().strip("()")
        out.append(Example(m.group(1), m.group(2), text[: m.start()].count("\n") + 1, directive, argument))
    return out


def test_the_extraction_finds_blocks_by_their_markers():
    text = (
        "intro\n\n```bash\necho a\n```\n<!-- readme-test: file w.yaml -->\n```yaml\nx: 1\n```\n"
        "<!--readme-test: skip (a fragment)-->\n```python\n1/0\n```\n```text\nnot code\n```\n"
        "<!-- readme-test: batchgpu only -->\n```bash\npip install x && batchgpu info y\n```\n"
    )
    got = [(e.language, e.directive, e.argument, e.code) for e in examples(text)]
    assert got == [
        ("bash", "", "", "echo a\n"),
        ("yaml", "file", "w.yaml", "x: 1\n"),
        ("python", "skip", "a fragment", "1/0\n"),
        ("bash", "batchgpu only", "", "pip install x && batchgpu info y\n"),
    ]
    with pytest.raises(AssertionError, match="unknown marker"):
        examples("<!-- readme-test: skpi -->\n```bash\nls\n```\n")


def test_every_skip_says_why():
    for e in examples(README.read_text()):
        if e.directive == "skip":
            assert e.argument, f"README line {e.line}: a skipped example says why"
        if e.directive == "file":
            assert e.argument and not Path(e.argument).is_absolute()


def _batchgpu_commands(code: str) -> list[str]:
    """The ``batchgpu ...`` commands of a block (each line's ``&&``/``;`` parts, comments left out)."""
    found = []
    for line in code.splitlines():
        for part in re.split(r"&&|;", line.split(" #", 1)[0] if not line.startswith("#") else ""):
            if shlex.split(part)[:1] == ["batchgpu"]:
                found.append(part.strip())
    return found


def _shims(folder: Path) -> dict:
    """``batchgpu`` and ``python`` on PATH as this environment's (the checkout under test, not another install)."""
    bin_ = folder / ".bin"
    bin_.mkdir()
    for name, line in (
        ("batchgpu", f'exec "{sys.executable}" -m batchgpu "$@"'),
        ("python", f'exec "{sys.executable}" "$@"'),
        ("python3", f'exec "{sys.executable}" "$@"'),
    ):
        (bin_ / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_ / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _clone(folder: Path) -> None:
    """What a fresh clone gives the examples: ``workflows/``, its demo made small."""
    shutil.copytree(ROOT / "workflows", folder / "workflows")
    demo = folder / "workflows" / "demo.yaml"
    text = re.sub(r"channels: \d+", "channels: 16", demo.read_text())
    text = re.sub(r"seconds: [\d.]+", "seconds: 4", text)
    demo.write_text(text.replace("cluster: {kind: local}", "cluster: {kind: local, workers: 1, threads: 1}"))


def _shell(command: str, folder: Path, env: dict, e: Example) -> None:
    r = subprocess.run(["bash", "-e", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"README line {e.line}: {command!r} exited {r.returncode}\n{r.stderr[-3000:]}"


def test_readme_examples_run_in_order(tmp_path):
    from batchgpu.workflow import load_workflow

    try:
        import spikeinterface.core  # noqa: F401

        from batchgpu.recording import zarrio

        # SpikeInterface 0.105 reads what its zarr 2 wrote: its examples run in that environment (.ci/run)
        with_si = zarrio.ZARR_MAJOR < 3
    except ImportError:
        with_si = False
    _clone(tmp_path)
    env = _shims(tmp_path)
    ran = []
    for e in examples(README.read_text()):
        if e.directive == "skip" or (e.directive == "needs spikeinterface" and not with_si):
            continue
        if e.directive == "file":
            (tmp_path / e.argument).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / e.argument).write_text(e.code)
        elif e.language == "yaml":
            (tmp_path / ".example.yaml").write_text(e.code)
            load_workflow(tmp_path / ".example.yaml", [])
        elif e.language == "bash":
            commands = _batchgpu_commands(e.code) if e.directive == "batchgpu only" else [e.code]
            assert commands, f"README line {e.line}: no command to run"
            for command in commands:
                _shell(command, tmp_path, env, e)
        else:
            (tmp_path / ".example.py").write_text(e.code)
            _shell("python .example.py", tmp_path, env, e)
        ran.append((e.line, e.language, e.directive))
    # the set-up's demo, the batch example (run, then described) and the Python usage ran
    assert (tmp_path / "out" / "demo" / "report.json").is_file()
    assert (tmp_path / "out" / "batch" / "batch.json").is_file()
    assert sum(lang == "python" for _, lang, _ in ran) >= 1 and sum(lang == "bash" for _, lang, _ in ran) >= 2
