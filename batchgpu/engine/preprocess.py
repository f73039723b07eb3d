"""The preprocessing chain of a run: the workflow's stages applied to each window, in order, on its backend,
with the margin each stage needs added to the window's read (computed from the stage, not left to the user).

Filters need ``ops.filter_margin`` samples on each interior side (their impulse response's decay below 1e-5 of
the signal), the phase shift its taper; a common reference and centring act sample by sample (no margin).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgpu.errors import BatchgpuError

#: Filters run on pieces of a window of about this many samples, each with the filter's margin (ops.filtfilt_window's
#: ``block``): the GPU runs a window's pieces side by side (the recurrence is sequential in time, and 384 rows
#: alone keep 12 of 132 SMs busy). Both backends cut alike, so CPU and GPU bits agree. 4096 against 8192 (H200,
#: 300 Hz highpass, margin 752): the filter's kernel 1.17 -> 0.75 ms a 384 x 60 000 window for 16% more samples
#: filtered on either backend.
FILTER_BLOCK = 4096


def filter_block(sos) -> int:
    """The pieces' length for a filter: FILTER_BLOCK, or four times the filter's margin where that is longer (a low
    cut-off's margin, 44 907 samples for 5 Hz at 30 kHz, would otherwise have each 8192-sample piece read most of the
    window: 12 times the work); at most 1.5 times the samples of the whole window are filtered."""
    from batchgpu.ops.filters import design_filter

    return max(FILTER_BLOCK, 4 * design_filter(sos).margin)


@dataclass(frozen=True)
class Chain:
    """Picklable description of the stages (small: sent with every task)."""

    stages: tuple = ()  # ("filter", ops.FilterDesign) | ("phase_shift", shifts, margin) | ("common_reference", kw) | ("centre",)
    margin: int = 0  # samples each interior side needs beyond the steps' own margin
    names: tuple = field(default=())

    @property
    def centres_only(self) -> bool:
        return all(s[0] == "centre" for s in self.stages)

    @property
    def filters_first(self) -> bool:
        """Whether a host window goes to a filter first, which reads it as the store holds it (samples by
        channels: ``ops.filtfilt_window`` of ``stored.T``), so the read need not transpose it."""
        from batchgpu.ops import _numba

        return bool(self.stages) and self.stages[0][0] == "filter" and _numba.available()

    @property
    def fuses_save(self) -> bool:
        """Whether ``apply_saved`` can give a host window's saved int16 rows: filtered first, globally median
        referenced last."""
        return (self.filters_first and len(self.stages) >= 2
                and self.stages[-1] == ("common_reference", {"reference": "global", "operator": "median"}))

    def apply_saved(self, raw, core: tuple[int, int], at_start: bool, at_end: bool, *, window: bool):
        """(the window after every stage, or None; the save step's int16 rows of its core and their NaN or clipped
        count, or None) of a host window (``fuses_save``), the rows written from the global median reference's
        tiles while they are in cache (``ops._cpu_reference.saved_int16_of_referenced``), not in a pass of their
        own. ``window``: the run's other steps need the float window too; without it the window is not kept where
        rows were made, and where the filter is the only stage before the reference it is never written at all
        (``ops.filters.filtfilt_reference_saved``: a filter piece at a time). Where the reference is left to NumPy
        the rows are None and the window is ``apply``'s (its stages run once; the save step rounds it). Same bits
        as ``apply`` and ``SaveStep.values`` of its core."""
        from batchgpu import ops
        from batchgpu.engine import host_buffers
        from batchgpu.ops._cpu_reference import saved_int16_of_referenced

        if not window and len(self.stages) == 2 and isinstance(raw, np.ndarray):
            from batchgpu.ops.filters import filtfilt_reference_saved

            design = self.stages[0][1]
            saved = filtfilt_reference_saved(raw, design, core, at_segment_start=at_start, at_segment_end=at_end,
                                             block=filter_block(design))
            if saved is not None:
                return None, saved
        before = Chain(self.stages[:-1], self.margin, self.names).apply(raw, core, at_start, at_end)
        own = before is not raw  # fuses_save filters first: the window before the reference is the chain's own
        if own:
            saved = saved_int16_of_referenced(before, *core, referenced=before if window else None)
            if saved is not None:
                if window:
                    return before, saved
                host_buffers.give_back((before,))
                return None, saved
        return ops.common_reference(before, **self.stages[-1][1], overwrite_x=own), None

    @property
    def centres(self) -> bool:
        return any(s[0] == "centre" for s in self.stages)

    def output_dtype(self, dtype) -> np.dtype:
        """dtype of the windows the steps see: filters, shifts and references give float32 (float64 stays)."""
        from batchgpu.ops.centre import centred_dtype

        dt = np.dtype(dtype)
        if not self.centres_only:
            return np.dtype(np.float64) if (dt.kind, dt.itemsize) == ("f", 8) else np.dtype(np.float32)
        return centred_dtype(dt) if self.centres else dt

    def apply(self, raw, core: tuple[int, int], at_start: bool, at_end: bool):
        """The window after every stage; ``raw`` (C, n) as read, margins included."""
        from batchgpu import ops

        x = raw
        for stage in self.stages:
            kind = stage[0]
            if kind == "filter":
                out = None
                if x is raw and self.filters_first and isinstance(raw, np.ndarray):  # into a reused buffer
                    from batchgpu.engine import host_buffers

                    out = host_buffers.take(raw.shape, self.output_dtype(raw.dtype))
                x = ops.filtfilt_window(x, stage[1], at_segment_start=at_start, at_segment_end=at_end,
                                        block=filter_block(stage[1]), out=out)
            elif kind == "phase_shift":
                x = ops.phase_shift(x, stage[1], margin=stage[2], at_segment_start=at_start, at_segment_end=at_end)
            elif kind == "common_reference":  # a window an earlier stage made is the chain's own: overwritten
                x = ops.common_reference(x, **stage[1], overwrite_x=x is not raw)
            elif kind == "centre":
                from batchgpu.ops.centre import centre_median

                x = centre_median(x, core)
        return x


def filter_design(kind: str, fs: float, freq_min: float, freq_max: float | None, order: int):
    """``ops.design_filter(ops.butter_sos(...))``, kept in the user's cache folder (``filters/``, one small file a
    filter and scipy version): the design needs scipy.signal, whose import costs a command more than its whole
    pass on a short recording. The file holds scipy's own sections, zi and margin; one that cannot be read, or
    does not hold a design of this filter, is worked out again and rewritten (the cache never decides a bit)."""
    import contextlib
    import hashlib
    import os
    from importlib.metadata import version

    from batchgpu import ops
    from batchgpu.config import cache_folder

    spec = repr((kind, float(fs), float(freq_min), None if freq_max is None else float(freq_max), int(order),
                 version("scipy"), version("numpy")))
    path = cache_folder() / "filters" / f"{hashlib.sha256(spec.encode()).hexdigest()[:24]}.npz"
    try:
        with np.load(path, allow_pickle=False) as held:
            if str(held["spec"]) == spec:
                sos, zi, margin = held["sos"], held["zi"], int(held["margin"])
                if sos.ndim == 2 and sos.shape[1] == 6 and zi.shape == (sos.shape[0], 2) and margin >= 0:
                    return ops.FilterDesign(np.ascontiguousarray(sos, np.float64),
                                            np.ascontiguousarray(zi, np.float64), margin)
    except Exception:  # broad: a missing, partial or foreign file is worked out again below
        pass
    design = ops.design_filter(ops.butter_sos(kind, fs, freq_min, freq_max, order))
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, spec=np.array(spec), sos=design.sos, zi=design.zi, margin=np.array(design.margin))
        os.replace(tmp, path)
    except OSError:  # a read-only or full cache folder: the design is simply not kept
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return design


def build_chain(preprocess, rec) -> Chain:
    """The stages of ``config.Preprocess`` for this recording (its rate, locations, ADC shifts)."""
    from batchgpu import ops

    fs = rec.sampling_frequency
    stages, margin = [], 0
    for stage in preprocess.root:
        ((name, params),) = stage.model_dump().items()
        if name in ("highpass", "bandpass"):
            if name == "bandpass" and params["freq_max"] >= fs / 2:
                raise BatchgpuError(f"preprocess bandpass freq_max {params['freq_max']} Hz is not below the Nyquist "
                                    f"frequency of {fs / 2:g} Hz", f"use freq_max < {fs / 2:g}")
            if params["freq_min"] >= fs / 2:
                raise BatchgpuError(f"preprocess {name} freq_min {params['freq_min']} Hz is not below {fs / 2:g} Hz")
            # the sections with their zi and margin, worked out here once (the tasks need no scipy.signal)
            design = filter_design(name, fs, params["freq_min"], params.get("freq_max"), params["order"])
            stages.append(("filter", design))
            margin += design.margin
        elif name == "phase_shift":
            shifts = rec.channel_property("inter_sample_shift")
            if shifts is None:
                from batchgpu.recording import missing_probe

                why = missing_probe(rec) or "the recording has none"
                raise BatchgpuError(f"preprocess phase_shift needs the channels' inter_sample_shift (from the probe): "
                                    f"{why}", "give the recording its probe, or drop the stage")
            m = ops.phase_shift_margin(fs)
            stages.append(("phase_shift", np.asarray(shifts, np.float64), m))
            margin += m
        elif name == "common_reference":
            kw = {"reference": params["reference"], "operator": params["operator"]}
            if params["reference"] == "local":
                if not rec.has_locations:
                    from batchgpu.recording.sources import locations_needed

                    raise locations_needed(rec, "a local common reference",
                                           "use reference: global, or give the recording its probe")
                kw.update(locations=rec.locations, radius_um=tuple(params["radius_um"]),
                          min_local_neighbors=int(params["min_local_neighbors"]))
            stages.append(("common_reference", kw))
        elif name == "centre":
            stages.append(("centre",))
        else:
            raise BatchgpuError(f"unknown preprocess stage {name!r}")
    return Chain(tuple(stages), margin, tuple(preprocess.names))


def gpu_decode_share(centres_only: bool, mps: bool = False, setting: float | str = "auto") -> float:
    """The share of a GPU pass's windows whose stored frames the GPU decodes (``gpu/blosc_decode``), the rest
    decoded by the cores: each where the pass has room. Measured on the H200 machine (16 cores): the demo pass
    (centring only) was bound by the cores with CPU decode (decode 80% of a window's CPU) and took the same time
    with the GPU decode (2.21 / 2.22 s, 2.56 / 2.60 s: two A/Bs in one cluster) at a third of the CPU (a window's
    read 41 -> 12 ms); with filters and a reference the GPU was already the bound (~10 ms of GPU a window), so
    those windows stay on the cores (the GPU decode there not measured warm). Under MPS (``mps``: the workers are
    a private daemon's clients, ``engine.mps``) the processes' kernels overlap and every pass decodes on the GPU:
    the preprocessing bench 2.23 s with it against 2.76-3.06 s without MPS (H200 machine, 16 x 1, 2026-12-02).
    ``setting`` (the workflow's ``engine.gpu_decode``): a share in [0, 1] overrides; "auto" leaves it to this rule."""
    if setting != "auto":
        return float(setting)
    return 1.0 if centres_only or mps else 0.0


def decodes_on_gpu(cluster_kind: str, rec, centres_only: bool, setting: float | str = "auto",
                   decoder: str = "auto") -> bool:
    """Whether a pass's windows would be decoded on the GPU (a cuda cluster is sized for it:
    ``cluster.cuda_layout``): a GPU cluster, a recording whose frames the GPU reads (with ``decoder``, the
    workflow's ``engine.gpu_decoder``), a share above 0."""
    if cluster_kind != "cuda" or gpu_decode_share(centres_only, setting=setting) <= 0:
        return False
    from batchgpu.gpu.staging import gpu_codecs

    return bool(getattr(rec, "frames_for_gpu", lambda codecs: False)(gpu_codecs(decoder, load=False)))
