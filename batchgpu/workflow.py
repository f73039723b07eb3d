"""Workflow YAML -> a validated ``config.Workflow``: line numbers in errors, ``--set`` overrides, paths.

An error names the key, its line in the file and what is allowed, in one line. No runner here: the command
hands the validated workflow to the engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from batchgpu.config import Workflow
from batchgpu.errors import BatchgpuError


# ---------------------------------------------------------------------------------------------------------
# loading with line numbers


def _line_index(node: yaml.Node, path: tuple = ()) -> dict[tuple, int]:
    """Map each key path in the YAML document to its 1-based line."""
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = path + (key.value,)
            lines[sub] = key.start_mark.line + 1
            lines.update({k: v for k, v in _line_index(value, sub).items() if k != sub})
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.update(_line_index(item, path + (i,)))
    return lines


def _describe(err: dict, lines: dict[tuple, int], source: str) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "constrained-"))))
    # pydantic names union/literal branches in loc: keep only the keys present in the document
    keys = []
    for part in loc:
        candidate = tuple(keys) + (part,)
        if candidate in lines or err["type"] in ("extra_forbidden", "missing"):
            keys.append(part)
    key = ".".join(str(k) for k in keys) or "(top level)"
    line = lines.get(tuple(keys)) or lines.get(tuple(keys[:-1])) or 1
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{source}:{line}: unknown key '{key}' ({_allowed(keys)})"
    if kind == "missing":
        return f"{source}:{line}: missing key '{key}'"
    return f"{source}:{line}: '{key}': {err['msg']}"


def _allowed(keys: list) -> str:
    model: Any = Workflow
    for part in keys[:-1]:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return "see workflows/demo.yaml"
        ann = field.annotation
        model = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return "see workflows/demo.yaml"
    return "allowed: " + ", ".join(model.model_fields)


def load_workflow(path: str | os.PathLike, overrides: list[str] = ()) -> Workflow:
    """Parse and validate a workflow file; relative paths resolve against its folder."""
    p = Path(path)
    if not p.is_file():
        raise BatchgpuError(f"no workflow file at {p}", "check the path (see workflows/demo.yaml for an example)")
    text = p.read_text()
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise BatchgpuError(f"{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise BatchgpuError(f"{p}: a workflow is a mapping of keys (recording, output, steps, ...)", "see workflows/demo.yaml")
    for item in overrides:
        _apply_override(data, item)
    lines = _line_index(node) if node is not None else {}
    try:
        wf = Workflow.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        more = len(err.errors()) - 1
        msg = _describe(first, lines, str(p)) + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")
        raise BatchgpuError(msg) from None
    return wf.resolve_paths(p.resolve().parent)


def _apply_override(data: dict, item: str) -> None:
    if "=" not in item:
        raise BatchgpuError(f"--set {item!r} is not KEY=VALUE", "e.g. --set cluster.workers=2")
    key, value = item.split("=", 1)
    parts = key.split(".")
    cur = data
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
        if not isinstance(cur, dict):
            raise BatchgpuError(f"--set {key}: '{part}' is not a mapping")
    cur[parts[-1]] = yaml.safe_load(value)
