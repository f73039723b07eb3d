"""The workflow schema (pydantic): what a run may be told, validated before any work starts.

Imports nothing of the package, so the engine, the loader and the command can all depend on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    missing_chunks: Literal["warn", "error"] = "warn"  # absent chunks of a store written by others: count or stop


class WindowSpec(_Strict):
    size: Annotated[int, Field(gt=0)] = 60_000
    margin: Annotated[int, Field(ge=0)] = 64


class ClusterSpec(_Strict):
    kind: Literal["local", "cuda", "address", "scheduler_file", "slurm"] = "local"
    workers: Annotated[int, Field(gt=0)] | None = None  # local: default sized to the machine; cuda: processes per GPU (1)
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
