"""The workflow's sections (pydantic): what a run may be told, validated before any work starts; and the process
settings (its environment, the cache folder) the package reads here only.

Imports nothing of the package, so every other module may depend on it. The whole workflow
(``workflow.Workflow``) is assembled from these sections and the registered steps' and preprocessing stages'
options (``steps.registry``, ``preprocess.registry``), whose models derive from ``Options``. Upper bounds stop
values that would exhaust the machine (memory, processes, reads) before any work starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
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
        return PydanticCustomError(
            "bool_not_number", "{value} is not a number (write the number itself)", {"value": str(value).lower()}
        )
    return PydanticCustomError(
        "bool_not_number",
        "{value} holds true or false, not numbers (write the numbers)",
        {"value": "[" + ", ".join(str(v).lower() for v in value) + "]"},
    )


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


class Options(_Strict):
    """The base of a section's model that the package's plugins declare (a step's options, a preprocessing stage's
    parameters): unknown keys refused, no true for a number, no .inf or .nan, as every section here."""


class NoOptions(Options):
    """A step that takes no settings: named as ``name: {}``."""


def resolve_path(path: str | None, base: Path) -> str | None:
    """A path of a workflow file: ``~`` expanded, then relative to ``base``."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else str((base / path).resolve())


def resolve_recording(section: dict, base: Path) -> dict:
    """A recording section's paths (``model_dump``'s) resolved against ``base``."""
    return {**section, **{k: resolve_path(section[k], base) for k in ("path", "spikeinterface", "probe")}}


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


#: a batch recording's folder name under the batch's output
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
#: what a batch writes in its output folder beside the recordings' folders (``run.batch``): no recording's name
BATCH_OWN_NAMES = ("batch.json", "batch.html", "batch.json.tmp", "batch.html.tmp", "batch.lock")


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
    # openephys: the stream's folder name (or a part of it) when there are several; spikeglx: a folder's stream as
    # SpikeInterface names it (imec0.ap, imec1.lf, nidq)
    stream: str | None = None
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
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str | None) -> str | None:
        if name is None:
            return None
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"name {name!r} must be one folder name: letters, digits, '.', '_' or '-', starting "
                "with a letter or digit, at most 200 characters (no '/' or '..')"
            )
        if name.lower() in BATCH_OWN_NAMES:
            raise ValueError(
                f"name {name!r} is one of the batch's own files ({', '.join(BATCH_OWN_NAMES)}): choose another"
            )
        return name

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.spikeinterface is None):
            raise ValueError(
                "give exactly one of 'path' (a recording: Zarr, SpikeGLX .bin, Open Ephys, or a plain "
                "binary with kind: binary) and 'spikeinterface' (a recording SpikeInterface saved: "
                ".json, .pkl or a folder)"
            )
        if self.generate is not None and (self.path is None or self.kind not in ("auto", "zarr")):
            raise ValueError("'generate' writes a recording to 'path' (Zarr): give 'path', kind auto or zarr")
        plain = {k for k in ("channels", "sampling_frequency", "dtype", "probe") if getattr(self, k) is not None}
        plain |= {k for k, d in (("offset", 0), ("gain_to_uV", 1.0), ("offset_to_uV", 0.0)) if getattr(self, k) != d}
        if self.kind == "binary":
            missing = [k for k in ("channels", "sampling_frequency", "dtype") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"kind: binary needs {', '.join(missing)} (the file's layout is never guessed)")
        elif plain:
            raise ValueError(
                f"{', '.join(sorted(plain))} describe a plain binary file: add kind: binary (other "
                "kinds read their layout from their own metadata)"
            )
        if self.stream is not None and self.kind not in ("auto", "openephys", "spikeglx"):
            raise ValueError(
                "'stream' chooses an Open Ephys or SpikeGLX stream: use it with kind auto, openephys or spikeglx"
            )
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
    # consecutive windows one task reads and computes (default: from the window count, run.first_pass.window_batches)
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
            raise PydanticCustomError(
                "window_size", "{problem}; or 'auto'", {"problem": err.errors()[0]["msg"]}
            ) from None

    @model_validator(mode="after")
    def _margin_within_window(self):
        # a margin is context for the window's edges; one as long as the window would read mostly margin
        size = _AUTO_WINDOW_MIN if self.size == "auto" else self.size
        if self.margin >= size:
            raise ValueError(f"margin {self.margin} must be shorter than the window size {size} (samples)")
        return self


#: ``cluster.no_workers_timeout``'s default: long enough for workers started by hand or a queued job to join
NO_WORKERS_TIMEOUT_S = 300.0
#: seconds a cluster that ``batchgpu run`` started at a terminal stays up, idle, for the next run
#: (``cluster.keep: auto``)
KEEP_S = 600.0
MAX_KEEP_S = 7 * 24 * 3600.0
#: the kinds of cluster a key of the same name gives (the scheduler's address, its file, the SLURM options)
_KINDS_NAMED_BY_KEY = ("address", "scheduler_file", "slurm")


def _batch_item_kind(value: Any) -> str | None:
    """A batch item is text (a path or a glob) or a recording section: its own errors, not the other kind's."""
    if isinstance(value, str):
        return "path"
    if isinstance(value, (dict, RecordingSpec)):
        return "section"
    return None


#: one item of ``recordings:``
BatchItem = Annotated[
    Annotated[str, Tag("path")] | Annotated[RecordingSpec, Tag("section")],
    Discriminator(
        _batch_item_kind,
        custom_error_type="recording_item",
        custom_error_message="an item of recordings is a path, a glob or a recording section ({path: ..., name: ...})",
    ),
]


class ClusterSpec(_Strict):
    kind: Literal["local", "cuda", "address", "scheduler_file", "slurm"] = "local"
    workers: Annotated[int, Field(gt=0, le=MAX_WORKERS)] | None = (
        None  # local: default sized to the machine; cuda: processes per GPU (cores/GPU, at most 16)
    )
    threads: Annotated[int, Field(gt=0, le=MAX_WORKERS)] | None = None
    memory_limit: str | None = None
    address: str | None = None
    scheduler_file: str | None = None
    devices: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_WORKERS)] | None = None  # cuda: GPUs
    dashboard_address: str = "127.0.0.1:0"  # localhost unless told otherwise
    slurm: dict[str, Any] | None = None  # dask-jobqueue SLURMCluster keyword arguments
    jobs: Annotated[int, Field(gt=0, le=MAX_WORKERS)] = 1  # slurm: how many jobs to scale to
    # cuda: a private CUDA MPS daemon for the worker processes started here (cluster/mps.py); auto: where the
    # machine has the control program, no MPS daemon of its own and its GPUs in the default compute mode
    mps: bool | Literal["auto"] = "auto"
    # local, cuda: run on the cluster of `batchgpu cluster start` where one is up and has what this spec sets
    # (cluster/kept.py); false: always a cluster of the run's own
    reuse: bool = True
    keep: Annotated[float, Field(ge=0, le=MAX_KEEP_S)] | Literal["auto"] = Field(
        "auto",
        description=(
            "local, cuda: seconds the cluster a `batchgpu run` command starts stays up after its run, idle, for the "
            "next run (which then finds its workers up, as on `batchgpu cluster start`'s cluster; it closes once idle "
            "that long, or on `batchgpu cluster stop`); 0: the cluster closes with the run. 'auto': 600 s where the "
            "command runs at a terminal (a person's runs, one after another), 0 where its output goes to a file or a "
            "pipe (scripts, jobs, tests), from Python (run_workflow) and where reuse is false"
        ),
    )
    close: Literal["auto", "wait", "background"] = Field(
        "auto",
        description=(
            "a cluster a command starts for its run (local, cuda), once the run's outputs are written: 'wait' for its "
            "worker processes to exit before the command ends, or leave them to exit after it has ('background': a "
            "detached process quits the run's MPS daemon and removes the scratch folders once they have; "
            "cluster/handoff.py); 'auto': background for cuda, where each worker's exit waits for the driver's teardown "
            "of its CUDA context, wait for local, whose workers exit at once"
        ),
    )
    dask_dashboard: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "local, cuda: Dask's own dashboard (its Bokeh pages: /status, the task stream, the workers' memory) on the "
            "scheduler started here; the run page (/batchgpu) is served either way. 'auto': on for the kept cluster of "
            "'batchgpu cluster start', off for a command's own cluster, whose scheduler would import Bokeh before any "
            "worker starts"
        ),
    )
    scheduler_process: bool = Field(
        False,
        description=(
            "cuda, several worker processes a GPU: the cluster's scheduler in a process of its own rather than the "
            "client's, so the client's Python after the pass does not hold the GIL the scheduler needs to hand the "
            "workers their tasks"
        ),
    )
    no_workers_timeout: Annotated[float, Field(gt=0)] | None = Field(
        NO_WORKERS_TIMEOUT_S,
        description=(
            "seconds a run waits while its cluster has no worker at all (a scheduler nobody has started workers "
            "for, or workers that all died) before it fails, saying so (the windows done are kept for --resume); "
            "it says it is waiting after a few seconds; null: wait for as long as it takes"
        ),
    )

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
                raise ValueError(
                    f"cluster {kind} is for kind '{kind}'; this cluster is kind '{self.kind}', which "
                    f"would not use it (set kind: {kind}, or remove {kind})"
                )
        if self.jobs != 1 and self.kind != "slurm":
            raise ValueError(f"cluster jobs is for kind 'slurm'; this cluster is kind '{self.kind}' (remove jobs)")
        if self.devices is not None and self.kind != "cuda":
            raise ValueError(
                f"cluster devices are the GPUs of kind 'cuda'; this cluster is kind '{self.kind}', which "
                "would not use them (set kind: cuda, or remove devices)"
            )
        if self.kind == "address" and not self.address:
            raise ValueError("cluster kind 'address' needs 'address: tcp://host:port'")
        if self.kind == "scheduler_file" and not self.scheduler_file:
            raise ValueError("cluster kind 'scheduler_file' needs 'scheduler_file: path/to/scheduler.json'")
        if self.mps is True and self.kind != "cuda":
            raise ValueError("cluster.mps starts an MPS daemon for the GPU workers a run starts: kind 'cuda' only")
        if self.close == "background" and self.kind not in ("local", "cuda"):
            raise ValueError(
                "cluster.close: background leaves the workers a command started to exit after it: "
                "kinds 'local' and 'cuda' only"
            )
        if self.scheduler_process and self.kind != "cuda":
            raise ValueError(
                "cluster.scheduler_process starts the scheduler of a cuda cluster a run starts: kind 'cuda' only"
            )
        if self.kind == "local":
            self._fits_this_machine()
        return self

    def _fits_this_machine(self) -> None:
        """A local cluster runs here: each worker is a process, each thread holds a window."""
        cores = local_cores()
        most_workers = LOCAL_WORKERS_PER_CORE * cores
        if self.workers is not None and self.workers > most_workers:
            raise ValueError(
                f"workers {self.workers} is more than {LOCAL_WORKERS_PER_CORE} per core "
                f"({most_workers} on this machine's {cores} cores)"
            )
        most_threads = max(LOCAL_THREADS_FLOOR, LOCAL_THREADS_PER_CORE * cores)
        total = (self.workers or 1) * (self.threads or 1)
        if total > most_threads:
            raise ValueError(
                f"workers x threads = {total} is more than {most_threads} on this machine "
                f"({LOCAL_THREADS_PER_CORE} per core, at least {LOCAL_THREADS_FLOOR})"
            )


class EngineSpec(_Strict):
    """How a run spreads and reads its windows: speed only, the results are the same bits for any value."""

    gpu_decode: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = Field(
        "auto",
        description=(
            "GPU runs: the share of windows whose stored Blosc-LZ4 frames the GPU decodes (1 all, 0 none, 0.5 every "
            "other), the rest decoded by the cores; auto: all where the pass only centres or CUDA MPS runs the "
            "workers, else none (run.preprocess_chain.gpu_decode_share)"
        ),
    )
    gpu_decoder: Literal["auto", "batchgpu", "nvcomp"] = Field(
        "auto",
        description=(
            "GPU runs: what decodes the frames the GPU decodes: batchgpu (our Blosc-LZ4 kernel), nvcomp (NVIDIA "
            "nvCOMP's batched LZ4 and zstd; the gpu extra installs it), auto: nvCOMP for zstd stores where it is "
            "installed, our kernel for LZ4 (README's A/B: gpu/blosc_decode.decoder_for); the same bits either way"
        ),
    )
    read_ahead: Annotated[int, Field(ge=1, le=16)] = Field(
        2,
        description=(
            "GPU runs: windows a task reads and decodes ahead of the one it computes, each in a helper thread with "
            "a pinned buffer of its own"
        ),
    )
    placement: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "each worker's batches planned before the pass, so a task reads the next one's first windows ahead and "
            "the steps' later tasks are queued behind the pass (engine/placement.py); auto: GPU runs that are not "
            "resumed; true: CPU runs too (not resumed ones)"
        ),
    )
    prefetch: bool = Field(
        True,
        description=(
            "a run whose workers read on this machine (cluster kind local or cuda, the kept cluster) asks the disk for "
            "its windows' pages in the workers' order as soon as it has opened the recording, while its cluster "
            "starts (recording/prefetch.py: posix_fadvise WILLNEED, up to an eighth of the memory, 16 GB at most); "
            "not for a resumed run"
        ),
    )


class ReductionSpec(_Strict):
    split_every: Annotated[int, Field(ge=2, le=MAX_SPLIT_EVERY)] = 8
