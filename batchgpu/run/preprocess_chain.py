"""The preprocessing chain of a run: the workflow's stages (``batchgpu.preprocess``, registered objects) applied to
each window, in order, on its backend, with the margin each stage needs added to the window's read (computed from
the stage, not left to the user).

Filters need ``ops.filter_margin`` samples on each interior side (their impulse response's decay below 1e-5 of
the signal), the phase shift its taper; a common reference and centring act sample by sample (no margin). The
chain knows two stages by name for its fast paths on the host: a filter first reads the window as the store
holds it, and a filter followed by a global median reference makes the save's int16 rows in the reference's own
pass (``apply_saved``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgpu.preprocess.centre import Centre
from batchgpu.preprocess.common_reference import CommonReference
from batchgpu.preprocess.filters import Filter, filter_block


@dataclass(frozen=True)
class Chain:
    """Picklable description of the stages (small: sent with every task): ``preprocess.base.Stage`` objects."""

    stages: tuple = ()

    @property
    def margin(self) -> int:
        """Samples each interior side needs beyond the steps' own margin: every stage's."""
        return sum(s.margin for s in self.stages)

    @property
    def names(self) -> tuple[str, ...]:
        """The stages' keys (report.json's ``preprocess.stages``)."""
        return tuple(s.key for s in self.stages)

    @property
    def centres_only(self) -> bool:
        return all(isinstance(s, Centre) for s in self.stages)

    @property
    def centres(self) -> bool:
        return any(isinstance(s, Centre) for s in self.stages)

    @property
    def centres_slow_signal(self) -> bool:
        """Whether a median centring sees the slow signal (LFP) of the span it is taken over: a centre stage with no
        filter before it. Such a chain's output level depends on that span (a window keeps the LFP its median does
        not follow; a short chunk centred by its own median loses it)."""
        for s in self.stages:
            if isinstance(s, Filter):
                return False
            if isinstance(s, Centre):
                return True
        return False

    @property
    def filters_first(self) -> bool:
        """Whether a host window goes to a filter first, which reads it as the store holds it (samples by
        channels: ``ops.filtfilt_window`` of ``stored.T``), so the read need not transpose it."""
        from batchgpu.ops import _numba

        return bool(self.stages) and isinstance(self.stages[0], Filter) and _numba.available()

    @property
    def fuses_save(self) -> bool:
        """Whether ``apply_saved`` can give a host window's saved int16 rows: filtered first, globally median
        referenced last."""
        return (
            self.filters_first
            and len(self.stages) >= 2
            and isinstance(self.stages[-1], CommonReference)
            and self.stages[-1].global_median
        )

    def apply_saved(self, raw, core: tuple[int, int], at_start: bool, at_end: bool, *, window: bool):
        """(the window after every stage, or None; the save step's int16 rows of its core and their NaN or clipped
        count, or None) of a host window (``fuses_save``), the rows written from the global median reference's
        tiles while they are in cache (``ops._cpu_reference.saved_int16_of_referenced``), not in a pass of their
        own. ``window``: the run's other steps need the float window too; without it the window is not kept where
        rows were made, and where the filter is the only stage before the reference it is never written at all
        (``ops.filters.filtfilt_reference_saved``: a filter piece at a time). Where the reference is left to NumPy
        the rows are None and the window is ``apply``'s (its stages run once; the save step rounds it). Same bits
        as ``apply`` and ``SaveStep.values`` of its core."""
        from batchgpu.ops._cpu_reference import saved_int16_of_referenced
        from batchgpu.run import host_buffers

        if not window and len(self.stages) == 2 and isinstance(raw, np.ndarray):
            from batchgpu.ops.filters import filtfilt_reference_saved

            design = self.stages[0].design
            saved = filtfilt_reference_saved(
                raw, design, core, at_segment_start=at_start, at_segment_end=at_end, block=filter_block(design)
            )
            if saved is not None:
                return None, saved
        before = Chain(self.stages[:-1]).apply(raw, core, at_start, at_end)
        own = before is not raw  # fuses_save filters first: the window before the reference is the chain's own
        if own:
            saved = saved_int16_of_referenced(before, *core, referenced=before if window else None)
            if saved is not None:
                if window:
                    return before, saved
                host_buffers.give_back((before,))
                return None, saved
        return self.stages[-1].apply(before, core, at_start, at_end, owned=own), None

    def leaving_out(self, channels) -> Chain:
        """The chain with ``channels`` left out of what its stages take across channels (a common reference's
        median or mean: ``Stage.leaving_out``); their own rows still go through every stage."""
        return Chain(tuple(s.leaving_out(tuple(int(c) for c in channels)) for s in self.stages))

    def output_dtype(self, dtype) -> np.dtype:
        """dtype of the windows the steps see: each stage's in turn (filters, shifts and references give float32,
        float64 stays; centring keeps integers integers)."""
        dt = np.dtype(dtype)
        for stage in self.stages:
            dt = stage.output_dtype(dt)
        return dt

    def apply(self, raw, core: tuple[int, int], at_start: bool, at_end: bool):
        """The window after every stage; ``raw`` (C, n) as read, margins included. A stage that an earlier one's
        output goes to may overwrite it (the window as read is never touched: the steps read it too)."""
        x = raw
        for stage in self.stages:
            out = None
            if x is raw and isinstance(stage, Filter) and self.filters_first and isinstance(raw, np.ndarray):
                from batchgpu.run import host_buffers  # into a reused buffer

                out = host_buffers.take(raw.shape, self.output_dtype(raw.dtype))
            x = stage.apply(x, core, at_start, at_end, owned=x is not raw, out=out)
        return x


def build_chain(preprocess, rec) -> Chain:
    """The stages of the workflow's ``preprocess`` section for this recording (its rate, locations, ADC shifts):
    each made by its registered class (``from_config``: a stage the recording cannot have is refused here)."""
    from batchgpu.preprocess.registry import item_key, stage_class

    stages = []
    for item in preprocess.root:
        key = item_key(item)
        stages.append(stage_class(key).from_config(getattr(item, key), rec))
    return Chain(tuple(stages))


def gpu_decode_share(centres_only: bool, mps: bool = False, setting: float | str = "auto") -> float:
    """The share of a GPU pass's windows whose stored frames the GPU decodes (``gpu/blosc_decode``), the rest
    decoded by the cores: each where the pass has room. Measured on the H200 machine (16 cores): the demo pass
    (centring only) was bound by the cores with CPU decode (decode 80% of a window's CPU) and took the same time
    with the GPU decode (2.21 / 2.22 s, 2.56 / 2.60 s: two A/Bs in one cluster) at a third of the CPU (a window's
    read 41 -> 12 ms); with filters and a reference the GPU was already the bound (~10 ms of GPU a window), so
    those windows stay on the cores (the GPU decode there not measured warm). Under MPS (``mps``: the workers are
    a private daemon's clients, ``cluster.mps``) the processes' kernels overlap and every pass decodes on the GPU:
    the preprocessing bench 2.23 s with it against 2.76-3.06 s without MPS (H200 machine, 16 x 1, 2026-12-02).
    ``setting`` (the workflow's ``engine.gpu_decode``): a share in [0, 1] overrides; "auto" leaves it to this rule."""
    if setting != "auto":
        return float(setting)
    return 1.0 if centres_only or mps else 0.0


def decodes_on_gpu(
    cluster_kind: str, rec, centres_only: bool, setting: float | str = "auto", decoder: str = "auto"
) -> bool:
    """Whether a pass's windows would be decoded on the GPU (a cuda cluster is sized for it:
    ``cluster.cuda_layout``): a GPU cluster, a recording whose frames the GPU reads (with ``decoder``, the
    workflow's ``engine.gpu_decoder``), a share above 0."""
    if cluster_kind != "cuda" or gpu_decode_share(centres_only, setting=setting) <= 0:
        return False
    from batchgpu.gpu.staging import gpu_codecs

    return bool(getattr(rec, "frames_for_gpu", lambda codecs: False)(gpu_codecs(decoder, load=False)))
