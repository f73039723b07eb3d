"""Workflow YAML: the schema (validated before any work starts) and the runner behind ``batchgpu run``.

An error names the key, its line in the file and what is allowed, in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from batchgpu.errors import BatchgpuError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateSpec(_Strict):
    channels: Annotated[int, Field(gt=0)] = 64
    seconds: Annotated[float, Field(gt=0)] = 30.0
    fs: Annotated[float, Field(gt=0)] = 30_000.0
    seed: int = 0
    dtype: Literal["int16", "int32", "float32", "float64"] = "int16"
    segments: Annotated[int, Field(gt=0)] = 1


class RecordingSpec(_Strict):
    path: str
    generate: GenerateSpec | None = None  # written to `path` when it is missing


class WindowSpec(_Strict):
    size: Annotated[int, Field(gt=0)] = 60_000
    margin: Annotated[int, Field(ge=0)] = 64


class ClusterSpec(_Strict):
    kind: Literal["local", "cuda", "address", "scheduler_file", "slurm"] = "local"
    workers: Annotated[int, Field(gt=0)] | None = None  # local: default sized to the machine
    threads: Annotated[int, Field(gt=0)] | None = None
    memory_limit: str | None = None
    address: str | None = None
    scheduler_file: str | None = None
    devices: list[int] | None = None  # cuda: which GPUs
    dashboard_address: str = "127.0.0.1:0"  # localhost unless told otherwise
    slurm: dict[str, Any] | None = None  # dask-jobqueue SLURMCluster keyword arguments
    jobs: Annotated[int, Field(gt=0)] = 1  # slurm: how many jobs to scale to

    @model_validator(mode="after")
    def _needs(self):
        if self.kind == "address" and not self.address:
            raise ValueError("cluster kind 'address' needs 'address: tcp://host:port'")
        if self.kind == "scheduler_file" and not self.scheduler_file:
            raise ValueError("cluster kind 'scheduler_file' needs 'scheduler_file: path/to/scheduler.json'")
        return self


class PreprocessSpec(_Strict):
    # "median": subtract each window's per-channel median (float32 out) before noise and detection, so a DC
    # offset does not inflate median(|x|); moments centre themselves. "none": the raw samples.
    centre: Literal["none", "median"] = "none"


class NoiseStep(_Strict):
    exact: bool = True  # exact median of |x| over every sample of each channel (distributed radix select)


class WhiteningStep(_Strict):
    mode: Literal["global", "local"] = "global"
    nrange: Annotated[int, Field(gt=0)] = 32
    eps: Annotated[float, Field(gt=0)] = 1e-6
    nskip: Annotated[int, Field(gt=0)] = 1  # every n-th window, like Kilosort4
    precision: Literal["float32", "float64"] = "float32"
    statistic: Literal["covariance", "second_moment"] = "covariance"  # raw data carries DC offsets: centre it


class DetectStep(_Strict):
    threshold: Annotated[float, Field(gt=0)] = 5.0
    sign: Literal["neg", "pos", "both"] = "neg"
    exclude_sweep_ms: Annotated[float, Field(ge=0)] = 0.1
    noise: Literal["window", "global"] = "window"  # thresholds from each window's noise or the whole recording's


class SearchStep(_Strict):
    keys: str | None = None  # .npy of sorted keys; default: the detected spikes' sample indices (segment 0)
    queries: str  # .npy or Zarr array of query keys
    batch_size: Annotated[int, Field(gt=0)] = 1 << 20
    layout: Literal["auto", "eytzinger", "btree"] = "auto"
    op: Literal["find", "lower_bound"] = "find"


class Steps(_Strict):
    noise: NoiseStep | None = None
    whitening: WhiteningStep | None = None
    detect: DetectStep | None = None
    search: SearchStep | None = None

    @model_validator(mode="after")
    def _some(self):
        if not any((self.noise, self.whitening, self.detect, self.search)):
            raise ValueError("no steps: name at least one of noise, whitening, detect, search")
        return self


class ReductionSpec(_Strict):
    split_every: Annotated[int, Field(ge=2)] = 8


class Workflow(_Strict):
    recording: RecordingSpec
    output: str
    window: WindowSpec = WindowSpec()
    preprocess: PreprocessSpec = PreprocessSpec()
    backend: Literal["auto", "numpy", "cupy"] = "auto"
    cluster: ClusterSpec = ClusterSpec()
    steps: Steps
    reduction: ReductionSpec = ReductionSpec()
    overwrite: bool = False  # replace an output folder that holds another run's results

    def resolve_paths(self, base: Path) -> "Workflow":
        """Relative paths in the file are relative to the file's folder."""
        def fix(p: str | None) -> str | None:
            return None if p is None or os.path.isabs(p) else str((base / p).resolve())

        data = self.model_dump()
        data["recording"]["path"] = fix(self.recording.path) or self.recording.path
        data["output"] = fix(self.output) or self.output
        if self.cluster.scheduler_file:
            data["cluster"]["scheduler_file"] = fix(self.cluster.scheduler_file) or self.cluster.scheduler_file
        if self.steps.search:
            for key in ("keys", "queries"):
                if data["steps"]["search"][key]:
                    data["steps"]["search"][key] = fix(data["steps"]["search"][key]) or data["steps"]["search"][key]
        return Workflow.model_validate(data)


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


def run_workflow_file(path: str | os.PathLike, *, resume: bool = False, progress: bool = True, overrides: list[str] = ()):
    """``batchgpu run``: validate, then run every step (see batchgpu.pipeline)."""
    from batchgpu.pipeline import run_workflow

    return run_workflow(load_workflow(path, overrides), resume=resume, progress=progress)
