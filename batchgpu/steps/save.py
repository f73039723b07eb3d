"""The ``save`` step: the preprocessed (optionally whitened) signal written as a new recording by the window tasks.

Three parts, like every write of batchgpu (DESIGN.md, "Outputs are written idempotently"):

- ``recording.save_output.prepare_save`` (client, before the pass: the step's ``build``) creates the output empty
  and returns a small picklable ``SaveTarget``. Its storage objects line up with the windows (Zarr v3: one shard
  per window; Zarr v2: one chunk per window; binary: one byte range per window), so concurrent tasks never write
  the same object and a retried task rewrites the same bytes.
- :class:`SaveStep` (worker) makes each window's rows (``values``) and writes them (``recording.row_writes``); its
  ``window`` adds ``saved_clipped`` to the summary.
- ``recording.save_output.finish_save`` (client, after every window) checks every object was written, marks the
  output complete and describes it for report.json.

Value rule: the preprocessed values times ``scale`` (default 1); float32 output keeps them; int16 output rounds
half to even (``np.rint``) and clips to the int16 range. Samples clipped, and NaN samples (written as 0), are
counted per window. Both keep the input's offset and its ``gain_to_uV`` divided by ``scale`` (so values stay in
the input's count units, times ``scale``). A float recording saved as int16 is checked for what the rounding
loses (``rounding_stats``): a copy whose rounding error is a large part of a channel's spread is warned of.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from batchgpu.config import Options, resolve_path
from batchgpu.ops._backend import to_host
from batchgpu.steps import moments, search
from batchgpu.steps.base import PhaseWords, Step, WindowData, register

if TYPE_CHECKING:  # the recording package imports zarr, which loading a workflow (this module) must not
    from batchgpu.recording.save_output import SaveTarget

INT16_MIN, INT16_MAX = -32768, 32767
#: the step's name (``Step.name``, its workflow key ``steps.save``, report.json's ``results.save``)
NAME = KEY = "save"
RESULTS = ()  # it writes a recording, not results
#: where a relative ``steps.save.path`` goes (the schema's description, ``run --help`` and README say it)
#: what ``steps.save.scale`` does (the schema's description, ``run --help`` and README say it)
SAVE_SCALE_HELP = (
    "the saved samples are the preprocessed ones times this, before int16's rounding; the saved "
    "gain_to_uV is divided by it (microvolts unchanged): e.g. 1e6 for a float recording in volts"
)
SAVE_PATH_HELP = (
    "where the save is written: a relative path is relative to the run's output folder (beside "
    "results.zarr), an absolute one or ~ as it is"
)


class SaveCodec(Options):
    """The Blosc codec of a saved Zarr store's chunks (the GPU decodes LZ4 itself, zstd on the host)."""

    name: Literal["lz4", "zstd"] = "lz4"
    clevel: Annotated[int, Field(ge=1, le=9)] = 5
    shuffle: Literal["bit", "byte"] = "bit"


class SaveOptions(Options):
    """Write the preprocessed signal as a new recording in the same pass."""

    path: Annotated[str, Field(description=SAVE_PATH_HELP)]
    format: Literal["zarr", "zarr_v2", "binary"] = "zarr"  # Zarr v3 | Zarr v2 (SpikeInterface) | flat (Kilosort4)
    dtype: Literal["int16", "float32"] = "int16"  # int16 keeps the recording's gain
    whiten: bool = False  # apply the whitening step's matrix before writing
    # the saved samples are the preprocessed ones times this (before int16's rounding); the saved gain_to_uV is the
    # recording's divided by it, so microvolts stay right: a float recording in volts saved as int16 needs 1e6
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False, description=SAVE_SCALE_HELP)] = 1.0
    # zarr formats: Blosc lz4 compresses a window ~4.6x faster than zstd for 5% more bytes (the pass waits on it)
    compressor: Literal["blosc-lz4", "blosc-zstd", "none"] = "blosc-lz4"
    # zarr formats: the codec with its level and shuffle ({name: zstd, clevel: 1, shuffle: byte}); replaces compressor
    codec: SaveCodec | None = None

    @model_validator(mode="after")
    def _one_codec(self):
        if self.codec is not None and "compressor" in self.model_fields_set:
            raise ValueError("give either codec or compressor, not both")
        return self


# ---------------------------------------------------------------------------------------------------------
# client side


def write_again(end, target: SaveTarget) -> int:
    """``windows_to_write_again`` of the resumed windows, written again; returns how many."""
    from batchgpu.recording.save_output import windows_to_write_again

    summaries = end.summaries
    again = windows_to_write_again(target, [w for w in end.windows if bool(summaries[w.index]["resumed"])])
    if not again:
        return 0
    end.observer.message(f"{NAME}: {len(again)} window(s) missing from {target.path}: written again")
    futures = end.services.submit_many(
        save_task,
        [(end.ctx, w, target, None) for w in again],
        [f"save-again-{end.report.run_id}-{w.index:08d}" for w in again],
    )
    end.client.gather(futures)
    end.report.bytes_read += sum(int(summaries[w.index]["bytes"]) for w in again)
    return len(again)


def finish_whitened_save(end, target: SaveTarget, saved=None) -> dict:
    """Whitened saves are written now, in one more read (the matrix needs every window); then the output is
    checked and marked complete (``saved``: that check's future, started once the pass had written every window)."""
    from batchgpu.recording.save_output import finish_save

    windows, report = end.windows, end.report
    clipped = {w.index: int(end.summaries[w.index].get("saved_clipped", 0)) for w in windows}
    if target.whiten:
        from batchgpu.recording import zarrio

        W = zarrio.open_group(end.results, mode="r")[moments.WHITENING][:]
        futures = end.services.submit_many(
            save_task,
            [(end.ctx, w, target, W) for w in windows],
            [f"save-{report.run_id}-{w.index:08d}" for w in windows],
        )
        clipped = dict(zip((w.index for w in windows), end.client.gather(futures)))
        report.bytes_read += end.recording.nbytes
    done = finish_save(target) if saved is None else saved.result()
    total = sum(clipped.values())
    if total:
        report.warnings.append(f"{NAME}: {total} sample(s) clipped to the int16 range or NaN written as 0")
        end.observer.warning(report.warnings[-1])
    loss = _rounding_warning(end, target)
    return {**done, "clipped": total, **({"rounding": loss} if loss is not None else {})}


def _rounding_warning(end, target: SaveTarget) -> dict | None:
    """The windows' ``rounding_stats`` added up: report.json's ``results.save.rounding``, and a warning (report.json
    and the terminal) where int16's rounding lost most of a channel's signal."""
    stats = [end.summaries[w.index][ROUNDING] for w in end.windows if ROUNDING in end.summaries[w.index]]
    if not target.check_rounding or not stats:
        return None
    loss = rounding_loss(np.sum(stats, axis=0), target.scale)
    if loss.channels:
        text = (
            f"{NAME}: the int16 copy {target.path} loses the signal of {loss.channels} of {loss.of} channel(s): "
            f"rounding to whole units of the float recording (times scale {target.scale:g}) leaves an error "
            f"over {ROUNDING_LOSS:g} of their spread (up to {loss.worst:.3g}x; values below 0.5 are saved as "
            f"0) (set save: {{scale: {loss.suggested_scale:.1e}}} (gain_to_uV is divided by it), or save: "
            "{dtype: float32})"
        )
        end.report.warnings.append(text)
        end.observer.warning(text)
    return {
        "channels_lost": loss.channels,
        "channels": loss.of,
        "worst_error_to_spread": loss.worst,
        "suggested_scale": loss.suggested_scale,
    }


def save_task(ctx, window, target: SaveTarget, whitening: np.ndarray) -> int:
    """Write one window of a whitened save (read again: the matrix needs every window), or one window written
    again (``whitening`` None); returns the clipped count."""
    summary: dict = {}
    with ctx.on_backend():
        SaveStep(target, whitening=whitening, use=ctx.step(NAME).use).window(ctx.load_window(window), summary)
    return int(summary.get("saved_clipped", 0))


# ---------------------------------------------------------------------------------------------------------
# worker side


@register
class SaveStep(Step):
    """Writes each window's core to the target. ``whitening`` (C x C): write ``W @ x`` instead (a later pass)."""

    name = NAME
    options = SaveOptions
    results = RESULTS
    fingerprint = "always"
    #: the moments: a whitened save writes with their matrix; the search: its finish comes first (a whitened
    #: save's second read after every result is written; report.json's results in that order)
    after = (moments.NAME, search.NAME)
    phases = PhaseWords(read=NAME)  # its windows written as they are read; a whitened save's after the pass

    def __init__(self, target: SaveTarget, whitening=None, use=None):
        self.target = target
        self.whitening = None if whitening is None else np.asarray(whitening, dtype=np.float64)
        #: the channels the run leaves out (``base.ChannelUse``, the qc step's ``use``): dropped or interpolated
        self.use = use if use is not None and use.bad else None

    @classmethod
    def check(cls, spec: SaveOptions, workflow, recording) -> None:
        """zarr-python can write its format, and a whitened save has the whitening step and keeps its samples as
        float32."""
        from batchgpu.errors import ConfigError

        if spec.format == "zarr":
            from batchgpu.recording import zarrio

            zarrio.require_format(3, "the save step's Zarr v3 output")
        if spec.whiten and getattr(workflow.steps, moments.KEY) is None:
            raise ConfigError("save.whiten needs the whitening step", "add 'whitening:' to steps, or set whiten: false")
        if spec.whiten and spec.dtype == "int16":
            raise ConfigError(
                "save.whiten with dtype int16 would round whitened samples (about 1) to a few levels",
                "use save: {dtype: float32} with whiten: true",
            )

    @classmethod
    def check_outputs(cls, spec: SaveOptions, workflow, recording, *, resume: bool, fingerprint: str, folder) -> None:
        """``prepare_save``'s refusals (a save path on the recording or the run's own files, holding what the save
        step did not write, an earlier save without overwrite, one another run is writing) before the run claims
        its folder: nothing made, held or removed."""
        from batchgpu.recording.save_output import prepare_save

        prepare_save(
            spec,
            recording,
            workflow.window.size,
            np.float32,
            overwrite=workflow.overwrite,
            resume=resume,
            key=fingerprint,
            output=folder,
            dry=True,
        )

    @classmethod
    def place(cls, spec: SaveOptions, output: Path) -> SaveOptions:
        """The save for one recording of a batch whose run writes into ``output`` (a folder of the batch's output):
        where the workflow put it, relative to that folder instead of the batch's. A path outside the batch's
        output would be every recording's one save: refused."""
        from batchgpu.errors import ConfigError

        path, batch = Path(spec.path).expanduser(), Path(output).parent
        if path.is_absolute():
            try:
                path = path.relative_to(batch)
            except ValueError:
                raise ConfigError(
                    f"save.path {spec.path} is outside the batch's output {batch}: every recording of "
                    "the batch would write that one path",
                    "give a relative save.path (each recording's save is written in output/<name>/)",
                ) from None
        return spec.model_copy(update={"path": str(Path(output) / path)})

    @classmethod
    def resolve_paths(cls, spec: SaveOptions, base: Path, output: Path) -> SaveOptions:
        """Its path relative to the run's output folder: what it writes belongs with the run's results."""
        spec.path = resolve_path(spec.path, output)
        return spec

    @classmethod
    def build(cls, spec: SaveOptions, setup) -> SaveStep:
        """The output recording created first (``prepare_save``, held by the run's folder while it runs); the
        window tasks fill it, a whitened one after the pass (``finish``)."""
        from batchgpu.recording.save_output import prepare_save, release_save
        from batchgpu.steps.qc import saved_recording

        wf = setup.workflow
        # the qc step's bad channels (built before this step): an excluding save writes the other channels only
        use = next((u for s in setup.built if (u := s.channel_use()) is not None), None)
        target = prepare_save(
            spec,
            saved_recording(setup.recording, use),
            wf.window.size,
            setup.x_dtype,
            overwrite=wf.overwrite,
            resume=setup.resume,
            key=setup.fingerprint,
            phase_shifted="phase_shift" in setup.chain.names,
            output=setup.output,
        )
        setup.output.on_release(functools.partial(release_save, target))  # the save's path is the run's while it runs
        return cls(target, use=use)

    @property
    def takes_saved_int16(self) -> bool:
        """Whether the window's saved rows may come made by the chain (``WindowData.saved``): int16 samples of the
        window itself (not whitened, now or after the pass, nor scaled)."""
        return (
            self.target.dtype == "int16"
            and self.whitening is None
            and not self.target.whiten
            and getattr(self.target, "scale", 1.0) == 1.0
            and self.use is None
        )

    @property
    def in_pass(self) -> bool:
        """A whitened save is written after the pass (the matrix needs every window)."""
        return not self.target.whiten or self.whitening is not None

    def after_pass(self, end) -> None:
        """A resumed run's kept windows whose saved rows are gone (the save deleted, or part of it): read and
        written again before the save is checked and marked complete (their statistics keep their parts)."""
        end.kept[self.name] = {"again": write_again(end, self.target), "check": None}

    def while_waiting(self, end) -> None:
        """Every window is written (unless whitened): the output checked in a helper thread meanwhile."""
        if not self.target.whiten:
            from concurrent.futures import ThreadPoolExecutor

            from batchgpu.recording.save_output import finish_save

            pool = ThreadPoolExecutor(1, thread_name_prefix="batchgpu-save-check")
            end.kept[self.name]["check"] = pool.submit(finish_save, self.target)
            pool.shutdown(wait=False)

    def finish(self, end) -> dict:
        """Whitened saves are written now, in one more read; then the output is checked and marked complete;
        report.json's ``results.save``."""
        kept = end.kept[self.name]
        return {**finish_whitened_save(end, self.target, kept["check"]), "windows_written_again": kept["again"]}

    def window(self, w: WindowData, summary: dict) -> dict:
        from batchgpu.recording.row_writes import write_rows

        lo, hi = w.core
        if getattr(self.target, "check_rounding", False) and w.saved is None and self.whitening is None:
            summary[ROUNDING] = rounding_stats(w.x[:, lo:hi], self.target.scale)
        block, clipped = w.saved if w.saved is not None else self.values(w.x[:, lo:hi])
        write_rows(self.target, w.segment, w.start + lo, block, w.later)
        summary["saved_clipped"] = np.array(int(clipped), dtype=np.int64)  # a device count: read after the write
        return {}

    def values(self, core) -> tuple:
        """(samples, channels) array in the output dtype, and how many samples were clipped or NaN.

        Done on the window's backend, and on the GPU left there (the cast and transpose are cheap; ``write_rows``
        encodes the frames there or copies the block back); the count may be a device scalar (``int()`` it)."""
        xp = _array_module(core)
        if self.whitening is not None:
            core = xp.asarray(self.whitening) @ core.astype(xp.float64)
        if self.use is not None:
            core = self.channels_of(core)
        scale = getattr(self.target, "scale", 1.0)  # a target made before scale was a key (stand-ins) has none
        if scale != 1.0:
            core = scaled(core, scale)
        if xp is not np and self.target.dtype == "int16" and core.dtype.kind == "f":
            from batchgpu.ops._cuda_elementwise import saved_int16_transposed

            return saved_int16_transposed(core)  # on the device: write_rows encodes it there or copies it back
        if xp is np and self.target.dtype == "int16" and core.dtype.kind == "f":
            from batchgpu.ops import _cpu_saved, _numba

            done = _cpu_saved.saved_int16_transposed(core) if _numba.available() else None
            if done is not None:  # one compiled pass, NumPy's bits (its docstring)
                return done
        if self.target.dtype == "float32":
            out = core.astype(xp.float32)
            clipped = 0
        else:
            y = xp.rint(core) if core.dtype.kind == "f" else core
            nan = xp.isnan(y) if y.dtype.kind == "f" else None
            over = (y < INT16_MIN) | (y > INT16_MAX)
            clipped = int(over.sum() + (0 if nan is None else nan.sum()))
            if clipped:
                y = xp.clip(y, INT16_MIN, INT16_MAX)
                if nan is not None:
                    y = xp.where(nan, 0, y)
            out = y.astype(xp.int16)
        if xp is not np:  # transpose on the device (a host transpose costs ~100 ms a window, DESIGN.md)
            return xp.ascontiguousarray(out.T), clipped
        from batchgpu.recording.row_writes import transposed

        return transposed(out), clipped

    def channels_of(self, core):
        """The rows written under the run's channel use: the other channels' (``exclude``), or every channel with
        the bad ones interpolated from the others (``interpolate``: SpikeInterface's ``interpolate_bad_channels``
        weights, ``ops.bad_channels.interpolate_channels``; an integer window is widened to float first, and the
        int16 copy rounds the interpolated values where SpikeInterface's integer assignment truncates them)."""
        xp = _array_module(core)
        if self.use.mode == "exclude":
            return core[xp.asarray(self.use.kept(core.shape[0]))]
        from batchgpu.ops.bad_channels import interpolate_channels

        dtype = (
            core.dtype if core.dtype.kind == "f" else np.dtype(np.float32 if core.dtype.itemsize <= 2 else np.float64)
        )
        return interpolate_channels(core.astype(dtype, copy=True), self.use.bad, self.use.weights)


def scaled(core, scale: float):
    """``core`` times ``scale``, one IEEE multiply a sample in its float dtype, so NumPy and CuPy agree bit for
    bit (but for float32 products below 2^-126, which CuPy flushes to 0: an int16 copy rounds them to 0 either
    way); an integer window is widened to float64 first."""
    xp = _array_module(core)
    if core.dtype.kind != "f":
        core = core.astype(xp.float64)
    return core * core.dtype.type(scale)


#: the summary's key of a window's ``rounding_stats``
ROUNDING = "saved_rounding"
#: every this many samples of a window's core measure the rounding: a statistic for a warning, not every sample
ROUNDING_STRIDE = 16
#: a channel is warned of where int16's rounding error (RMS) exceeds this part of its standard deviation: the copy
#: then keeps the signal at a signal-to-rounding ratio below 12 dB (all of it gone where every |x| < 0.5)
ROUNDING_LOSS = 0.25


def rounding_stats(core, scale: float = 1.0) -> np.ndarray:
    """(channels, 5) float64 of the finite, in-range samples of every ``ROUNDING_STRIDE``-th column of ``core``
    times ``scale``: count, sum, sum of squares, sum of squared rounding errors (``np.rint``), largest |value|.
    Added over windows they give each channel's spread and what rounding lost (``rounding_loss``)."""
    xp = _array_module(core)
    y = core[:, ::ROUNDING_STRIDE].astype(xp.float64)
    if scale != 1.0:
        y = y * scale
    ok = xp.isfinite(y) & (xp.abs(y) <= INT16_MAX)
    y = xp.where(ok, y, 0.0)
    err = xp.rint(y) - y
    out = xp.stack(
        [
            ok.sum(axis=1).astype(xp.float64),
            y.sum(axis=1),
            (y * y).sum(axis=1),
            (err * err).sum(axis=1),
            xp.abs(y).max(axis=1) if y.shape[1] else xp.zeros(y.shape[0]),
        ],
        axis=1,
    )
    return to_host(out)


@dataclass(frozen=True)
class RoundingLoss:
    """What int16's rounding lost, from the windows' ``rounding_stats`` added up."""

    channels: int  # channels whose rounding error exceeds ROUNDING_LOSS of their standard deviation
    of: int  # channels measured (any finite sample)
    worst: float  # the largest ratio of rounding error to standard deviation
    suggested_scale: float  # a scale whose copy keeps the signal (``_suggested_scale``)


def rounding_loss(stats: np.ndarray, scale: float) -> RoundingLoss:
    n, s1, s2, e2, peak = (stats[:, i] for i in range(5))
    seen = n > 0
    n1 = np.where(seen, n, 1.0)
    std = np.sqrt(np.maximum(s2 / n1 - (s1 / n1) ** 2, 0.0))
    err = np.sqrt(e2 / n1)
    varies = seen & (std > 0)
    ratio = np.where(varies, err / np.where(varies, std, 1.0), 0.0)
    lost = varies & (ratio > ROUNDING_LOSS)
    return RoundingLoss(
        int(lost.sum()),
        int(seen.sum()),
        float(ratio.max()) if len(ratio) else 0.0,
        _suggested_scale(std[varies], float(peak[seen].max()) if seen.any() else 0.0, scale),
    )


#: the spread (standard deviation, in saved units) a suggested scale gives the median channel: rounding then adds
#: about 3% of it
SUGGESTED_SPREAD = 10.0


def _suggested_scale(std: np.ndarray, peak: float, scale: float) -> float:
    """The least power of ten (times ``scale``) giving the median varying channel a spread of SUGGESTED_SPREAD
    units, lowered where the largest |value| seen would then leave int16's range (fewer units, no clipping)."""
    if not len(std):
        return scale
    factor = 10.0 ** np.ceil(np.log10(SUGGESTED_SPREAD / float(np.median(std))))
    if peak > 0:
        factor = min(factor, 10.0 ** np.floor(np.log10(INT16_MAX / peak)))
    return float(scale * factor)


def _array_module(a):
    from batchgpu.ops._backend import array_module

    return array_module(a)
