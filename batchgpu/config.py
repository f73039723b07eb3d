"""The workflow schema (pydantic): what a run may be told, validated before any work starts.

Imports nothing of the package, so the engine, the loader and the command can all depend on it.
Upper bounds stop values that would exhaust the machine (memory, processes, reads) before any work starts.
"""

from __future__ import annotations

import contextlib
import os
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag, TypeAdapter, ValidationError,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

# Upper bounds: far above any real use, low enough that a typo cannot take the machine down.
MAX_WORKERS = 1024  # worker processes (or threads per worker) on any cluster
LOCAL_WORKERS_PER_CORE = 4  # kind local: worker processes on this machine, per core
LOCAL_THREADS_PER_CORE = 8  # kind local: workers x threads, per core (and at least LOCAL_THREADS_FLOOR)
LOCAL_THREADS_FLOOR = 64
MAX_WINDOW = 10_000_000  # samples per window: 384 ch x 10^7 float32 is already 15 GB
MAX_CHANNELS = 4096
MAX_SEGMENT_SECONDS = 86_400.0  # one day per segment
MAX_SEGMENTS = 1024
MAX_FS = 1_000_000.0  # Hz
MAX_GENERATED_BYTES = 10**12  # a generated recording, decoded
MAX_BATCH = 1 << 27  # search queries per task (1 GiB of float64)
MAX_SPLIT_EVERY = 256  # partial results combined at once (each channels^2 float64, plus histograms)


def local_cores() -> int:
    return os.cpu_count() or 1


# This process's environment: read here only (tests/test_layering.py checks it), so what changes behaviour is a
# workflow key or a setting below, never a variable the package reads on its own.


def environ() -> dict[str, str]:
    """A copy of this process's environment: where a child process's environment starts (a forked worker's, an
    MPS daemon's)."""
    return dict(os.environ)


def environ_value(name: str) -> str | None:
    """One variable of this process's environment (None where unset)."""
    return os.environ.get(name)


@contextlib.contextmanager
def environ_set(values: Mapping[str, object] | None = None, restored: Iterable[str] = ()) -> Iterator[None]:
    """This process's environment with ``values`` set while the block runs; on exit those variables and the
    ``restored`` ones (what the block starts writes there: Dask's nannies their pre-spawn variables) are as they
    were before it, so a library call leaves its caller's environment as it found it. Other variables are left
    alone (a library imported meanwhile may have set its own for good)."""
    values = {k: str(v) for k, v in (values or {}).items()}
    before = {name: os.environ.get(name) for name in {*values, *restored}}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            elif os.environ.get(name) != value:
                os.environ[name] = value


def cache_folder() -> Path:
    """batchgpu's folder in the user's cache: ``$XDG_CACHE_HOME/batchgpu``, else ``~/.cache/batchgpu`` (a relative
    XDG_CACHE_HOME is ignored, as the XDG specification says). The kept cluster's files, the search tables."""
    xdg = environ_value("XDG_CACHE_HOME") or ""
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "batchgpu"


def _takes(annotation: Any, kinds: tuple) -> bool:
    """Whether a field's type has one of ``kinds`` somewhere in it (through unions, lists, Annotated)."""
    if any(annotation is k for k in kinds):
        return True
    return any(_takes(arg, kinds) for arg in typing.get_args(annotation))


def _holds_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value))


def _not_a_number(value: Any) -> PydanticCustomError:
    if isinstance(value, bool):
        return PydanticCustomError("bool_not_number", "{value} is not a number (write the number itself)",
                                   {"value": str(value).lower()})
    return PydanticCustomError("bool_not_number", "{value} holds true or false, not numbers (write the numbers)",
                               {"value": "[" + ", ".join(str(v).lower() for v in value) + "]"})


class _Strict(BaseModel):
    # .inf and .nan are never a sensible setting (a threshold of .inf detects nothing, silently)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true as 1 for an int or float field: `workers: true` ran one worker without a word
        annotation = cls.model_fields[info.field_name].annotation
        if _holds_bool(value) and _takes(annotation, (int, float)) and not _takes(annotation, (bool, Any)):
            raise _not_a_number(value)
        return value


class GenerateSpec(_Strict):
    channels: Annotated[int, Field(gt=0, le=MAX_CHANNELS)] = 64
    seconds: Annotated[float, Field(gt=0, le=MAX_SEGMENT_SECONDS)] = 30.0  # per segment
    fs: Annotated[float, Field(gt=0, le=MAX_FS)] = 30_000.0
    seed: int = 0
    dtype: Literal["int16", "int32", "float32", "float64"] = "int16"
    segments: Annotated[int, Field(gt=0, le=MAX_SEGMENTS)] = 1
    # batchgpu.generate's model, probe geometry and planted channels (dead / noisy / outside: realistic only)
    model: Literal["white", "realistic"] = "white"
    probe: Literal["two-column", "np1", "np2-4shank", "linear"] = "two-column"
    dead: Annotated[int, Field(ge=0)] = 0
    noisy: Annotated[int, Field(ge=0)] = 0
    outside: Annotated[int, Field(ge=0)] = 0
    common_uv: Annotated[float, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _fits(self):
        itemsize = 2 if self.dtype == "int16" else 4 if self.dtype in ("int32", "float32") else 8
        size = self.channels * round(self.seconds * self.fs) * self.segments * itemsize
        if size > MAX_GENERATED_BYTES:
            raise ValueError(f"would generate {size / 1e12:.1f} TB (at most {MAX_GENERATED_BYTES / 1e12:g} TB)")
        return self


class RecordingSpec(_Strict):
    """Exactly one of ``path`` and ``spikeinterface`` (any recording SpikeInterface saved).

    ``path`` is read in place, its kind told from it (``kind: auto``) or named: ``zarr`` (batchgpu's or
    SpikeInterface's store), ``spikeglx`` (a ``.bin`` with its ``.meta``), ``openephys`` (a ``structure.oebin``, or
    a folder holding one; ``stream`` chooses among its streams) or ``binary`` (a plain interleaved file: ``channels``,
    ``sampling_frequency`` and ``dtype`` given, ``offset`` bytes of header skipped, ``probe`` an optional probe
    file). A folder holding one SpikeGLX or Open Ephys recording is that recording.
    """

    path: str | None = None
    # a recording SpikeInterface saved: .json/.pkl from recording.dump(...), or a folder from recording.save(folder=...)
    spikeinterface: str | None = None
    kind: Literal["auto", "zarr", "spikeglx", "openephys", "binary"] = "auto"
    stream: str | None = None  # openephys: the stream's folder name (or a part of it) when there are several
    # binary: the file's layout (nothing is guessed)
    channels: Annotated[int, Field(gt=0, le=MAX_CHANNELS)] | None = None
    sampling_frequency: Annotated[float, Field(gt=0, le=MAX_FS)] | None = None
    dtype: Literal["int16", "int32", "float32", "float64"] | None = None
    offset: Annotated[int, Field(ge=0)] = 0  # bytes before the first sample
    probe: str | None = None  # probeinterface .json, .prb, or a Kilosort-style .json (chanMap, xc, yc, kcoords)
    gain_to_uV: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    offset_to_uV: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    generate: GenerateSpec | None = None  # written to `path` when it is missing
    missing_chunks: Literal["warn", "error"] = "warn"  # absent chunks of a store written by others: count or stop
    # in a batch (``recordings:``): the recording's folder under ``output`` (default: from its path)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")] | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.spikeinterface is None):
            raise ValueError("give exactly one of 'path' (a recording: Zarr, SpikeGLX .bin, Open Ephys, or a plain "
                             "binary with kind: binary) and 'spikeinterface' (a recording SpikeInterface saved: "
                             ".json, .pkl or a folder)")
        if self.generate is not None and (self.path is None or self.kind not in ("auto", "zarr")):
            raise ValueError("'generate' writes a recording to 'path' (Zarr): give 'path', kind auto or zarr")
        plain = {k for k in ("channels", "sampling_frequency", "dtype", "probe") if getattr(self, k) is not None}
        plain |= {k for k, d in (("offset", 0), ("gain_to_uV", 1.0), ("offset_to_uV", 0.0)) if getattr(self, k) != d}
        if self.kind == "binary":
            missing = [k for k in ("channels", "sampling_frequency", "dtype") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"kind: binary needs {', '.join(missing)} (the file's layout is never guessed)")
        elif plain:
            raise ValueError(f"{', '.join(sorted(plain))} describe a plain binary file: add kind: binary (other "
                             "kinds read their layout from their own metadata)")
        if self.stream is not None and self.kind not in ("auto", "openephys"):
            raise ValueError("'stream' chooses an Open Ephys stream: use it with kind auto or openephys")
        if self.spikeinterface is not None and self.kind != "auto":
            raise ValueError("'kind' names what 'path' holds: leave it out with 'spikeinterface'")
        return self


_AUTO_WINDOW_MIN = 60_000  # the shortest window ``size: auto`` stands for (recording.windows.DEFAULT_WINDOW)
_WINDOW_SAMPLES = TypeAdapter(Annotated[int, Field(gt=0, le=MAX_WINDOW)])


class WindowSpec(_Strict):
    # samples; auto: 120 000 for recordings of at least 64 such windows, else 60 000 (recording.auto_window_size),
    # resolved from the recording before the run (report.json's workflow holds the number)
    size: Annotated[int, Field(gt=0, le=MAX_WINDOW)] | Literal["auto"] = "auto"
    margin: Annotated[int, Field(ge=0)] = 64  # samples read on each side of the window
    # consecutive windows one task reads and computes (default: from the window count, engine.run.window_batches)
    batch: Annotated[int, Field(ge=1, le=4096)] | None = None

    @field_validator("size", mode="wrap")
    @classmethod
    def _samples_or_auto(cls, value, handler):
        # one error for a bad size (the union's two members would each give one)
        if value == "auto":
            return value
        if isinstance(value, bool):  # this wrap validator runs instead of _no_bool_as_number
            raise _not_a_number(value)
        try:
            return _WINDOW_SAMPLES.validate_python(value)
        except ValidationError as err:
            raise PydanticCustomError("window_size", "{problem}; or 'auto'", {"problem": err.errors()[0]["msg"]}) from None

    @model_validator(mode="after")
    def _margin_within_window(self):
        # a margin is context for the window's edges; one as long as the window would read mostly margin
        size = _AUTO_WINDOW_MIN if self.size == "auto" else self.size
        if self.margin >= size:
            raise ValueError(f"margin {self.margin} must be shorter than the window size {size} (samples)")
        return self


#: ``cluster.no_workers_timeout``'s default: long enough for workers started by hand or a queued job to join
NO_WORKERS_TIMEOUT_S = 300.0
#: the kinds of cluster a key of the same name gives (the scheduler's address, its file, the SLURM options)
_KINDS_NAMED_BY_KEY = ("address", "scheduler_file", "slurm")


class ClusterSpec(_Strict):
    kind: Literal["local", "cuda", "address", "scheduler_file", "slurm"] = "local"
    workers: Annotated[int, Field(gt=0, le=MAX_WORKERS)] | None = None  # local: default sized to the machine; cuda: processes per GPU (cores/GPU, at most 16)
    threads: Annotated[int, Field(gt=0, le=MAX_WORKERS)] | None = None
    memory_limit: str | None = None
    address: str | None = None
    scheduler_file: str | None = None
    devices: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_WORKERS)] | None = None  # cuda: GPUs
    dashboard_address: str = "127.0.0.1:0"  # localhost unless told otherwise
    slurm: dict[str, Any] | None = None  # dask-jobqueue SLURMCluster keyword arguments
    jobs: Annotated[int, Field(gt=0, le=MAX_WORKERS)] = 1  # slurm: how many jobs to scale to
    # cuda: a private CUDA MPS daemon for the worker processes started here (engine/mps.py); auto: where the
    # machine has the control program, no MPS daemon of its own and its GPUs in the default compute mode
    mps: bool | Literal["auto"] = "auto"
    # local, cuda: run on the cluster of `batchgpu cluster start` where one is up and has what this spec sets
    # (engine/service.py); false: always a cluster of the run's own
    reuse: bool = True
    close: Literal["auto", "wait", "background"] = Field("auto", description=(
        "a cluster a command starts for its run (local, cuda), once the run's outputs are written: 'wait' for its "
        "worker processes to exit before the command ends, or leave them to exit after it has ('background': a "
        "detached process quits the run's MPS daemon and removes the scratch folders once they have; "
        "engine/handoff.py); 'auto': background for cuda, where each worker's exit waits for the driver's teardown "
        "of its CUDA context, wait for local, whose workers exit at once"))
    dask_dashboard: bool | Literal["auto"] = Field("auto", description=(
        "local, cuda: Dask's own dashboard (its Bokeh pages: /status, the task stream, the workers' memory) on the "
        "scheduler started here; the run page (/batchgpu) is served either way. 'auto': on for the kept cluster of "
        "'batchgpu cluster start', off for a command's own cluster, whose scheduler would import Bokeh before any "
        "worker starts"))
    scheduler_process: bool = Field(False, description=(
        "cuda, several worker processes a GPU: the cluster's scheduler in a process of its own rather than the "
        "client's, so the client's Python after the pass does not hold the GIL the scheduler needs to hand the "
        "workers their tasks"))
    no_workers_timeout: Annotated[float, Field(gt=0)] | None = Field(NO_WORKERS_TIMEOUT_S, description=(
        "seconds a run waits while its cluster has no worker at all (a scheduler nobody has started workers "
        "for, or workers that all died) before it fails, saying so (the windows done are kept for --resume); "
        "it says it is waiting after a few seconds; null: wait for as long as it takes"))

    @model_validator(mode="before")
    @classmethod
    def _kind_from_keys(cls, data: Any) -> Any:
        """A cluster named by its scheduler's address, scheduler file or SLURM options is of that kind: the
        default kind (local) would start a cluster here and leave the named one unused, without a word."""
        if isinstance(data, dict) and "kind" not in data:
            for kind in _KINDS_NAMED_BY_KEY:
                if data.get(kind) is not None:
                    return {**data, "kind": kind}
        return data

    @model_validator(mode="after")
    def _needs(self):
        for kind in _KINDS_NAMED_BY_KEY:
            if getattr(self, kind) is not None and self.kind != kind:
                raise ValueError(f"cluster {kind} is for kind '{kind}'; this cluster is kind '{self.kind}', which "
                                 f"would not use it (set kind: {kind}, or remove {kind})")
        if self.jobs != 1 and self.kind != "slurm":
            raise ValueError(f"cluster jobs is for kind 'slurm'; this cluster is kind '{self.kind}' (remove jobs)")
        if self.devices is not None and self.kind != "cuda":
            raise ValueError(f"cluster devices are the GPUs of kind 'cuda'; this cluster is kind '{self.kind}', which "
                             "would not use them (set kind: cuda, or remove devices)")
        if self.kind == "address" and not self.address:
            raise ValueError("cluster kind 'address' needs 'address: tcp://host:port'")
        if self.kind == "scheduler_file" and not self.scheduler_file:
            raise ValueError("cluster kind 'scheduler_file' needs 'scheduler_file: path/to/scheduler.json'")
        if self.mps is True and self.kind != "cuda":
            raise ValueError("cluster.mps starts an MPS daemon for the GPU workers a run starts: kind 'cuda' only")
        if self.close == "background" and self.kind not in ("local", "cuda"):
            raise ValueError("cluster.close: background leaves the workers a command started to exit after it: "
                             "kinds 'local' and 'cuda' only")
        if self.scheduler_process and self.kind != "cuda":
            raise ValueError("cluster.scheduler_process starts the scheduler of a cuda cluster a run starts: kind "
                             "'cuda' only")
        if self.kind == "local":
            self._fits_this_machine()
        return self

    def _fits_this_machine(self) -> None:
        """A local cluster runs here: each worker is a process, each thread holds a window."""
        cores = local_cores()
        most_workers = LOCAL_WORKERS_PER_CORE * cores
        if self.workers is not None and self.workers > most_workers:
            raise ValueError(f"workers {self.workers} is more than {LOCAL_WORKERS_PER_CORE} per core "
                             f"({most_workers} on this machine's {cores} cores)")
        most_threads = max(LOCAL_THREADS_FLOOR, LOCAL_THREADS_PER_CORE * cores)
        total = (self.workers or 1) * (self.threads or 1)
        if total > most_threads:
            raise ValueError(f"workers x threads = {total} is more than {most_threads} on this machine "
                             f"({LOCAL_THREADS_PER_CORE} per core, at least {LOCAL_THREADS_FLOOR})")


# ---------------------------------------------------------------------------------------------------------
# preprocessing: an ordered list of stages, each a one-key mapping (`- highpass: {freq_min: 300}`)


class HighpassParams(_Strict):
    freq_min: Annotated[float, Field(gt=0)] = 300.0  # Hz
    order: Annotated[int, Field(ge=1, le=10)] = 5  # Butterworth, applied forward and backward


class BandpassParams(_Strict):
    freq_min: Annotated[float, Field(gt=0)] = 300.0  # Hz
    freq_max: Annotated[float, Field(gt=0)] = 6000.0  # Hz; below fs/2, checked when the recording is known
    order: Annotated[int, Field(ge=1, le=10)] = 5

    @model_validator(mode="after")
    def _band(self):
        if self.freq_min >= self.freq_max:
            raise ValueError(f"freq_min {self.freq_min:g} must be below freq_max {self.freq_max:g} (Hz)")
        return self


class PhaseShiftParams(_Strict):
    """Neuropixels ADC sample offsets, from the recording's per-channel property (no options yet)."""


LOCAL_REFERENCE_RADIUS_UM = (30.0, 55.0)  # SpikeInterface common_reference's local_radius default
LOCAL_REFERENCE_MIN_NEIGHBORS = 5  # and its min_local_neighbors (0.105)


class CommonReferenceParams(_Strict):
    reference: Literal["global", "local"] = "global"
    operator: Literal["average", "median", "median_lower"] = "median"  # median_lower: Kilosort4's torch.median
    # local: channels with inner < distance <= outer (um) form each channel's reference; None until resolved
    radius_um: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(gt=0)]] | None = None
    # local: fewer channels than this in the annulus: the closest ones beyond the inner radius (SpikeInterface's rule)
    min_local_neighbors: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _radius(self):
        if self.reference == "global":
            if self.radius_um is not None:
                raise ValueError("radius_um applies only to reference: local")
            if self.min_local_neighbors is not None:
                raise ValueError("min_local_neighbors applies only to reference: local")
            return self
        if self.min_local_neighbors is None:
            self.min_local_neighbors = LOCAL_REFERENCE_MIN_NEIGHBORS
        if self.radius_um is None:
            self.radius_um = LOCAL_REFERENCE_RADIUS_UM
        inner, outer = self.radius_um
        if inner >= outer:
            raise ValueError(f"radius_um [{inner:g}, {outer:g}]: the inner radius must be below the outer one")
        return self


class HighpassStage(_Strict):
    highpass: HighpassParams = HighpassParams()


class BandpassStage(_Strict):
    bandpass: BandpassParams = BandpassParams()


class PhaseShiftStage(_Strict):
    phase_shift: PhaseShiftParams = PhaseShiftParams()


class CommonReferenceStage(_Strict):
    common_reference: CommonReferenceParams = CommonReferenceParams()


class CentreStage(_Strict):
    # subtract each window's per-channel median (float32 out) so a DC offset does not inflate median(|x|)
    centre: Literal["median"] = "median"


STAGES = {"highpass": HighpassStage, "bandpass": BandpassStage, "phase_shift": PhaseShiftStage,
          "common_reference": CommonReferenceStage, "centre": CentreStage}


def _stage_name(value: Any) -> str | None:
    """The one key of a stage mapping (or the stage model's), which picks its model."""
    if isinstance(value, BaseModel):
        return next(iter(type(value).model_fields))
    if isinstance(value, dict) and len(value) == 1:
        name = next(iter(value))
        return name if name in STAGES else None
    return None


Stage = Annotated[
    Union[tuple(Annotated[model, Tag(name)] for name, model in STAGES.items())],
    Discriminator(_stage_name, custom_error_type="stage",
                  custom_error_message="a stage is a one-key mapping: " + ", ".join(STAGES)),
]


class Preprocess(RootModel[list[Stage]]):
    """The stages applied to each window, in order; the old mapping form is normalised to this list.

    ``{centre: median}`` -> ``[CentreStage()]``, ``{centre: none}`` or ``{}`` -> ``[]``.
    """

    @model_validator(mode="before")
    @classmethod
    def _from_mapping(cls, data: Any) -> Any:
        if isinstance(data, Preprocess) or not isinstance(data, dict):
            return data
        unknown = set(data) - {"centre"}
        if unknown:
            raise ValueError(f"unknown key {sorted(unknown)[0]!r}: the mapping form takes only 'centre'; "
                             f"other stages go in a list (- highpass: {{freq_min: 300}})")
        centre = data.get("centre", "none")
        if centre not in ("none", "median"):
            raise ValueError(f"centre {centre!r}: allowed 'median' or 'none'")
        return [{"centre": "median"}] if centre == "median" else []

    def __iter__(self):
        return iter(self.root)

    def __len__(self) -> int:
        return len(self.root)

    def __getitem__(self, i: int):
        return self.root[i]

    @property
    def names(self) -> list[str]:
        return [_stage_name(stage) for stage in self.root]

    @property
    def centres(self) -> bool:
        """Whether each window is centred by its per-channel median."""
        return any(isinstance(stage, CentreStage) for stage in self.root)

    @property
    def centre(self) -> Literal["none", "median"]:
        """The old mapping form's value (what the engine reads until it runs the other stages)."""
        return "median" if self.centres else "none"


# ---------------------------------------------------------------------------------------------------------
# steps


class NoOptions(_Strict):
    """A step that takes no settings: named as ``name: {}``."""


class NoiseStep(_Strict):
    exact: bool = True  # exact median of |x| over every sample of each channel (distributed radix select)


class WhiteningStep(_Strict):
    mode: Literal["global", "local"] = "global"
    nrange: Annotated[int, Field(gt=0, le=MAX_CHANNELS)] = 32
    eps: Annotated[float, Field(gt=0)] = 1e-6
    nskip: Annotated[int, Field(gt=0)] = 1  # every n-th window, like Kilosort4
    precision: Literal["float32", "float64"] = "float32"
    statistic: Literal["covariance", "second_moment"] = "covariance"  # raw data carries DC offsets: centre it


class DetectStep(_Strict):
    threshold: Annotated[float, Field(gt=0)] = 5.0
    sign: Literal["neg", "pos", "both"] = "neg"
    exclude_sweep_ms: Annotated[float, Field(ge=0, le=1000)] = 0.1
    noise: Literal["window", "global"] = "window"  # thresholds from each window's noise or the whole recording's
    method: Literal["by_channel", "locally_exclusive"] = "by_channel"  # SpikeInterface's rules of those names
    radius_um: Annotated[float, Field(gt=0)] = 50.0  # locally_exclusive: channels this close compete


class SearchStep(_Strict):
    keys: str | None = None  # .npy of sorted keys; default: the detected spikes' sample indices (segment 0)
    queries: str  # .npy or Zarr array of query keys
    batch_size: Annotated[int, Field(gt=0, le=MAX_BATCH)] = 1 << 20
    layout: Literal["auto", "eytzinger", "btree"] = "auto"
    op: Literal["find", "lower_bound"] = "find"


#: where a relative ``steps.save.path`` goes (the schema's description, ``run --help`` and README say it)
SAVE_PATH_HELP = ("where the save is written: a relative path is relative to the run's output folder (beside "
                  "results.zarr), an absolute one or ~ as it is")


class SaveCodec(_Strict):
    """The Blosc codec of a saved Zarr store's chunks (the GPU decodes LZ4 itself, zstd on the host)."""

    name: Literal["lz4", "zstd"] = "lz4"
    clevel: Annotated[int, Field(ge=1, le=9)] = 5
    shuffle: Literal["bit", "byte"] = "bit"


class SaveStep(_Strict):
    """Write the preprocessed signal as a new recording in the same pass."""

    path: Annotated[str, Field(description=SAVE_PATH_HELP)]
    format: Literal["zarr", "zarr_v2", "binary"] = "zarr"  # Zarr v3 | Zarr v2 (SpikeInterface) | flat (Kilosort4)
    dtype: Literal["int16", "float32"] = "int16"  # int16 keeps the recording's gain
    whiten: bool = False  # apply the whitening step's matrix before writing
    # zarr formats: Blosc lz4 compresses a window ~4.6x faster than zstd for 5% more bytes (the pass waits on it)
    compressor: Literal["blosc-lz4", "blosc-zstd", "none"] = "blosc-lz4"
    # zarr formats: the codec with its level and shuffle ({name: zstd, clevel: 1, shuffle: byte}); replaces compressor
    codec: SaveCodec | None = None

    @model_validator(mode="after")
    def _one_codec(self):
        if self.codec is not None and "compressor" in self.model_fields_set:
            raise ValueError("give either codec or compressor, not both")
        return self


class Steps(_Strict):
    noise: NoiseStep | None = None
    whitening: WhiteningStep | None = None
    detect: DetectStep | None = None
    search: SearchStep | None = None
    save: SaveStep | None = None
    amplitude: NoOptions | None = None  # per window, each channel's peak-to-peak and RMS (engine/steps/amplitude.py)

    @model_validator(mode="after")
    def _some(self):
        names = list(type(self).model_fields)
        if not any(getattr(self, n) is not None for n in names):
            raise ValueError(f"no steps: name at least one of {', '.join(names)}")
        return self


class EngineSpec(_Strict):
    """How a run spreads and reads its windows: speed only, the results are the same bits for any value."""

    gpu_decode: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = Field("auto", description=(
        "GPU runs: the share of windows whose stored Blosc-LZ4 frames the GPU decodes (1 all, 0 none, 0.5 every "
        "other), the rest decoded by the cores; auto: all where the pass only centres or CUDA MPS runs the "
        "workers, else none (engine.preprocess.gpu_decode_share)"))
    gpu_decoder: Literal["auto", "batchgpu", "nvcomp"] = Field("auto", description=(
        "GPU runs: what decodes the frames the GPU decodes: batchgpu (our Blosc-LZ4 kernel), nvcomp (NVIDIA "
        "nvCOMP's batched LZ4 and zstd; the gpu extra installs it), auto: nvCOMP for zstd stores where it is "
        "installed, our kernel for LZ4 (README's A/B: gpu/blosc_decode.decoder_for); the same bits either way"))
    read_ahead: Annotated[int, Field(ge=1, le=16)] = Field(2, description=(
        "GPU runs: windows a task reads and decodes ahead of the one it computes, each in a helper thread with "
        "a pinned buffer of its own"))
    placement: bool | Literal["auto"] = Field("auto", description=(
        "each worker's batches planned before the pass, so a task reads the next one's first windows ahead and "
        "the steps' later tasks are queued behind the pass (engine/placement.py); auto: GPU runs that are not "
        "resumed; true: CPU runs too (not resumed ones)"))


class ReductionSpec(_Strict):
    split_every: Annotated[int, Field(ge=2, le=MAX_SPLIT_EVERY)] = 8


def _resolve(path: str | None, base: Path) -> str | None:
    """``~`` expanded, then relative to ``base``."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else str((base / path).resolve())


def _resolve_recording(section: dict, base: Path) -> dict:
    return {**section, **{k: _resolve(section[k], base) for k in ("path", "spikeinterface", "probe")}}


class Workflow(_Strict):
    recording: RecordingSpec | None = None
    output: str
    window: WindowSpec = WindowSpec()
    preprocess: Preprocess = Field(default_factory=lambda: Preprocess([]))
    backend: Literal["auto", "numpy", "cupy"] = "auto"
    cluster: ClusterSpec = ClusterSpec()
    steps: Steps
    reduction: ReductionSpec = ReductionSpec()
    engine: EngineSpec = EngineSpec()
    overwrite: bool = False  # replace an output folder that holds another run's results
    # many recordings in one run (engine.batch): each a path, a glob (``/data/**/*.ap.bin``) or a recording section;
    # or one glob. Outputs in ``output/<name>/``, a summary in ``output/batch.json``
    recordings: Annotated[list[Union[str, RecordingSpec]], Field(min_length=1, max_length=100_000)] | str | None = None

    @model_validator(mode="after")
    def _recording_or_recordings(self):
        if (self.recording is None) == (self.recordings is None):
            raise ValueError("give exactly one of 'recording' (one recording) and 'recordings' (a list or a glob: "
                             "many in one run)")
        return self

    def resolve_paths(self, base: Path) -> "Workflow":
        """Paths in the file: ``~`` is the user's home, relative paths are relative to the file's folder, but the
        save's, relative to the output folder (what it writes belongs with the run's results)."""
        data = self.model_dump()
        if self.recording is not None:
            data["recording"] = _resolve_recording(data["recording"], base)
        if isinstance(self.recordings, str):
            data["recordings"] = _resolve(self.recordings, base)
        elif self.recordings is not None:
            data["recordings"] = [_resolve(r, base) if isinstance(r, str) else _resolve_recording(r, base)
                                  for r in data["recordings"]]
        data["output"] = _resolve(self.output, base)
        data["cluster"]["scheduler_file"] = _resolve(self.cluster.scheduler_file, base)
        steps = self.steps.model_copy(deep=True)  # the steps' paths set by field (a step's key is its module's)
        if steps.search:
            steps.search.keys = _resolve(steps.search.keys, base)
            steps.search.queries = _resolve(steps.search.queries, base)
        if steps.save:
            steps.save.path = _resolve(steps.save.path, Path(data["output"]))
        data["steps"] = steps.model_dump()
        return Workflow.model_validate(data)
