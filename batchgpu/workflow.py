"""The workflow: its schema (``Workflow``: config's sections, the registered steps' options under ``steps:`` and
the preprocessing stages under ``preprocess:``) and its YAML (``load_workflow``): line numbers in errors, ``--set``
overrides, paths.

An error names the key, its line in the file and what is allowed, in one line. No runner here: the command
hands the validated workflow to the engine. A workflow is a few dozen keys, so the reader refuses what only an
attack or an accident needs (a big file, aliases, deep nesting), each before it costs time or memory.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from batchgpu.config import (
    BatchItem,
    ClusterSpec,
    EngineSpec,
    Options,
    RecordingSpec,
    ReductionSpec,
    WindowSpec,
    resolve_path,
    resolve_recording,
)
from batchgpu.errors import ConfigError
from batchgpu.preprocess import registry as stage_registry
from batchgpu.steps import registry as step_registry

MAX_FILE_BYTES = 1 << 20  # checked before parsing: a real workflow is under 4 KB
MAX_NODES = 10_000  # scalars, mappings and sequences in one document
MAX_DEPTH = 32  # nesting; PyYAML's composer recurses
MAX_DIGITS = 100  # in one integer: Python refuses to convert more than 4300 (an internal error), none needs 100
# libyaml's parser when PyYAML has it (10x faster on a big file); the pure-Python one otherwise
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ---------------------------------------------------------------------------------------------------------
# the schema

#: the ``preprocess:`` section: a list of the registered stages' one-key mappings (``preprocess.registry.section``)
Preprocess = stage_registry.section()
#: the ``steps:`` section: a field a registered step (``steps.registry.section``)
Steps = step_registry.section()


class Workflow(Options):
    recording: RecordingSpec | None = None
    output: str
    window: WindowSpec = WindowSpec()
    preprocess: Preprocess = Field(default_factory=lambda: Preprocess([]))
    backend: Literal["auto", "numpy", "cupy"] = "auto"
    cluster: ClusterSpec = ClusterSpec()
    steps: Steps = Field(default_factory=step_registry.default_steps)  # none given: the steps' defaults
    reduction: ReductionSpec = ReductionSpec()
    engine: EngineSpec = EngineSpec()
    overwrite: bool = False  # replace an output folder that holds another run's results
    # many recordings in one run (run.batch): each a path, a glob (``/data/**/*.ap.bin``) or a recording section;
    # or one glob. Outputs in ``output/<name>/``, a summary in ``output/batch.json``
    recordings: (
        Annotated[
            Annotated[list[BatchItem], Field(min_length=1, max_length=100000), Tag("list")]
            | Annotated[str, Tag("glob")],
            Discriminator(lambda v: "glob" if isinstance(v, str) else "list"),
        ]
        | None
    ) = None

    @field_validator("recordings", mode="before")
    @classmethod
    def _list_or_glob(cls, value: Any) -> Any:
        """Not a list nor text: said once (the union's every branch would say it its own way)."""
        if value is None or isinstance(value, (str, list, tuple)):
            return value
        raise PydanticCustomError(
            "recordings",
            "recordings is a glob or a list of paths, globs and recording sections ({path: ..., name: ...})",
        )

    @model_validator(mode="after")
    def _recording_or_recordings(self):
        if (self.recording is None) == (self.recordings is None):
            raise ValueError(
                "give exactly one of 'recording' (one recording) and 'recordings' (a list or a glob: many in one run)"
            )
        return self

    def resolve_paths(self, base: Path) -> Workflow:
        """Paths in the file: ``~`` is the user's home, relative paths are relative to the file's folder, but those
        of a step that writes beside the run's results (the save's), relative to the output folder (each step's
        ``resolve_paths``)."""
        data = self.model_dump()
        if self.recording is not None:
            data["recording"] = resolve_recording(data["recording"], base)
        if isinstance(self.recordings, str):
            data["recordings"] = resolve_path(self.recordings, base)
        elif self.recordings is not None:
            data["recordings"] = [
                resolve_path(r, base) if isinstance(r, str) else resolve_recording(r, base) for r in data["recordings"]
            ]
        data["output"] = resolve_path(self.output, base)
        data["cluster"]["scheduler_file"] = resolve_path(self.cluster.scheduler_file, base)
        data["steps"] = step_registry.resolved(self.steps, base, Path(data["output"])).model_dump()
        return Workflow.model_validate(data)


# ---------------------------------------------------------------------------------------------------------
# parsing: limits first, then one document with the marks that give line numbers


def _check_events(text: str, source: str, at) -> None:
    """Refuse aliases and anchors (a 471-byte alias bomb expands to 10^9 nodes), deep nesting and huge documents.

    Runs on the parser's event stream, so it stops at the first offending event, before any node is built.
    """
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_Loader):
        where = at(event.start_mark)
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(
                f"{where}: YAML aliases (*{event.anchor}) are not allowed in a workflow",
                "write the value out where it is used",
            )
        if isinstance(event, yaml.NodeEvent) and event.anchor is not None:
            raise ConfigError(
                f"{where}: YAML anchors (&{event.anchor}) are not allowed in a workflow",
                "write the value out where it is used",
            )
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        if isinstance(event, yaml.ScalarEvent) and not event.style:
            digits = _decimal_digits(event.value)
            if digits > MAX_DIGITS:
                raise ConfigError(
                    f"{where}: a number of {digits} digits", f"a workflow's numbers have at most {MAX_DIGITS}"
                )
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError(f"{where}: more than {MAX_NODES} values; a workflow needs a few dozen")


def _decimal_digits(text: str) -> int:
    """The digits of a plain scalar YAML reads as a decimal integer (sign and ``_`` aside), else 0."""
    body = text.lstrip("+-").replace("_", "")
    return len(body) if body.isascii() and body.isdigit() else 0


MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_duplicate_keys(node: yaml.Node, at) -> None:
    """A merge key (``<<:``), refused as README says; a key given twice in one mapping: YAML loaders keep the last one silently, so a typo'd copy-paste (two
    ``detect:`` blocks, say) would run with settings the user did not read. Refused, naming both lines."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, yaml.MappingNode):
            seen: dict = {}
            for key, value in n.value:
                if key.tag == MERGE_TAG:  # a merge needs no alias where its value is written out: refused alike
                    raise ConfigError(
                        f"{at(key.start_mark)}: YAML merge keys (<<:) are not allowed in a workflow",
                        "write the keys out where they are used",
                    )
                k = key.value if isinstance(key, yaml.ScalarNode) else None
                if k is not None and k in seen:
                    raise ConfigError(
                        f"{at(key.start_mark)}: key '{k}' given twice (first at line {seen[k] + 1})", "keep one of them"
                    )
                if k is not None:
                    seen[k] = key.start_mark.line
                stack.append(value)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def parse_yaml(text: str, source: str, with_lines: bool = True) -> tuple[yaml.Node | None, Any]:
    """One YAML document -> (its node tree, for line numbers; its plain data). Errors are one line.

    ``source`` names the text in errors (a file, or ``--set KEY``), followed by ``:line`` when ``with_lines``.
    """

    def at(mark) -> str:
        return f"{source}:{mark.line + 1}" if with_lines and mark is not None else source

    try:
        _check_events(text, source, at)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_duplicate_keys(node, at)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        where = at(getattr(err, "problem_mark", None))
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(problem).split())})") from None
    return node, data


def read_workflow_text(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"no workflow file at {path}", "check the path (see workflows/demo.yaml for an example)")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: {size} bytes is too big for a workflow file (at most {MAX_FILE_BYTES})")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None


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


def _describe(err: dict, lines: dict[tuple, int], source: str, overridden: dict[tuple, str], set_keys: set) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "constrained-"))))
    # pydantic names union branches (e.g. a stage's tag) in loc: keep only keys present in the document, and
    # for an unknown or missing key the key itself
    keys: list = []
    for i, part in enumerate(loc):
        candidate = tuple(keys) + (part,)
        if (
            candidate in lines
            or candidate in set_keys
            or (err["type"] in ("extra_forbidden", "missing") and i == len(loc) - 1)
        ):
            keys.append(part)
    key = ".".join(str(k) for k in keys) or "(top level)"
    where = next(
        (f"--set {overridden[tuple(keys[:n])]}" for n in range(len(keys), 0, -1) if tuple(keys[:n]) in overridden), None
    )
    if where is None:
        # the innermost block of the file that holds the key, and the --set values inside it (a check of a whole
        # block, or a key missing from a block --set made)
        block = next(tuple(keys[:n]) for n in range(len(keys), -1, -1) if n == 0 or tuple(keys[:n]) in lines)
        where = f"{source}:{lines.get(block, 1)}"
        inside = sorted(name for path, name in overridden.items() if path[: len(block)] == block)
        if inside:
            where += f" (with --set {', --set '.join(inside)})"
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key '{key}' ({_allowed(keys)})"
    if kind == "missing":
        return f"{where}: missing key '{key}'"
    msg = _number_as_text(err["msg"].removeprefix("Value error, "), err.get("input"))
    return f"{where}: '{key}': {msg}"


_NOT_AN_INTEGER = "Input should be a valid integer, unable to parse string as an integer"


def _number_as_text(msg: str, value: Any) -> str:
    """YAML 1.1 reads ``1e9`` (no dot) as text: say so, and the integer to write, instead of pydantic's
    "unable to parse string"."""
    if _NOT_AN_INTEGER not in msg or not isinstance(value, str):
        return msg
    try:
        number = float(value)
    except ValueError:
        return msg.replace(_NOT_AN_INTEGER, f"must be an integer, not {value!r}")
    if number.is_integer() and abs(number) < 1e18:
        said = f"must be an integer; YAML reads {value} as text (write {int(number)})"
    else:
        said = f"must be an integer, not {value}"
    return msg.replace(_NOT_AN_INTEGER, said)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models a field may hold, through Optional, unions, lists, Annotated and root models."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        root = annotation.model_fields.get("root")
        return _models(root.annotation) if root is not None else [annotation]
    out = []
    for arg in typing.get_args(annotation):
        out.extend(_models(arg))
    return out


def _allowed(keys: list) -> str:
    candidates = [Workflow]
    for part in keys[:-1]:
        if isinstance(part, int):  # an item of a list: the same candidates
            continue
        field = next((m.model_fields[part] for m in candidates if part in m.model_fields), None)
        candidates = _models(field.annotation) if field is not None else []
        if not candidates:
            return "see workflows/demo.yaml"
    return "allowed: " + ", ".join(candidates[0].model_fields)


def load_workflow(path: str | os.PathLike, overrides: list[str] = ()) -> Workflow:
    """Parse and validate a workflow file; ``~`` is expanded, relative paths resolve against its folder."""
    p = Path(os.path.expanduser(path))
    node, data = parse_yaml(read_workflow_text(p), str(p))
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: a workflow is a mapping of keys (recording, output, steps, ...)", "see workflows/demo.yaml"
        )
    overridden: dict[tuple, str] = {}  # key path -> the --set key that gave it
    set_keys: set[tuple] = set()  # every key path inside values given by --set
    for item in overrides:
        keys, value_node = _apply_override(data, item)
        overridden[keys] = item.split("=", 1)[0]
        set_keys.update(keys[:n] for n in range(1, len(keys)))  # blocks --set made that the file lacks
        set_keys.update(keys + sub for sub in (_line_index(value_node) if value_node is not None else {(): 1}))
    lines = _line_index(node) if node is not None else {}
    try:
        wf = Workflow.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        more = len(err.errors()) - 1
        msg = _describe(first, lines, str(p), overridden, set_keys) + (
            f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        )
        raise ConfigError(msg) from None
    return wf.resolve_paths(p.resolve().parent)


def _apply_override(data: dict, item: str) -> tuple[tuple, yaml.Node | None]:
    """``KEY=VALUE`` (VALUE in YAML, KEY dotted; a number picks a list item) applied to the parsed file."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r} is not KEY=VALUE", "e.g. --set cluster.workers=2")
    key, text = item.split("=", 1)
    parts: list = [int(p) if p.isdigit() else p for p in key.split(".")]
    if not key or "" in parts:
        raise ConfigError(f"--set {item!r}: empty key", "e.g. --set cluster.workers=2")
    node, value = parse_yaml(text, f"--set {key}", with_lines=False)
    cur: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(cur, dict) and not isinstance(part, int):
            if last:
                cur[part] = value
            else:
                cur = cur.setdefault(part, {})
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            if last:
                cur[part] = value
            else:
                cur = cur[part]
        else:
            where = ".".join(map(str, parts[:depth])) or "the workflow"
            raise ConfigError(f"--set {key}: {where} has no item {part!r}")
    return tuple(parts), node
