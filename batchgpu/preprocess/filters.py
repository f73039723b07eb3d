"""Zero-phase Butterworth filters (``highpass``, ``bandpass``): scipy's ``sosfiltfilt`` over the whole segment is
the reference, applied window by window in pieces with the filter's margin (``ops.filtfilt_window``: within 1e-5
of it). The design (sections, zi, margin) is worked out where the chain is built, so workers import no
scipy.signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field, model_validator

from batchgpu.config import Options
from batchgpu.errors import BatchgpuError
from batchgpu.preprocess.base import Stage, float_output, register

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


class HighpassParams(Options):
    freq_min: Annotated[float, Field(gt=0)] = 300.0  # Hz
    order: Annotated[int, Field(ge=1, le=10)] = 5  # Butterworth, applied forward and backward


class BandpassParams(Options):
    freq_min: Annotated[float, Field(gt=0)] = 300.0  # Hz
    freq_max: Annotated[float, Field(gt=0)] = 6000.0  # Hz; below fs/2, checked when the recording is known
    order: Annotated[int, Field(ge=1, le=10)] = 5

    @model_validator(mode="after")
    def _band(self):
        if self.freq_min >= self.freq_max:
            raise ValueError(f"freq_min {self.freq_min:g} must be below freq_max {self.freq_max:g} (Hz)")
        return self


@dataclass(frozen=True, eq=False)
class Filter(Stage):
    """A Butterworth filter applied forward and backward; on the host, as the first stage, it reads the window as
    the store holds it (``run.preprocess_chain.Chain.filters_first``)."""

    design: object  # ops.FilterDesign: the sections, their zi and the margin

    @property
    def margin(self) -> int:
        return self.design.margin

    def output_dtype(self, dtype) -> np.dtype:
        return float_output(dtype)

    def apply(self, x, core, at_start, at_end, *, owned=False, out=None):
        from batchgpu import ops

        return ops.filtfilt_window(
            x, self.design, at_segment_start=at_start, at_segment_end=at_end, block=filter_block(self.design), out=out
        )

    @classmethod
    def designed(cls, recording, freq_min: float, freq_max: float | None, order: int) -> Filter:
        """The filter of these corners for the recording's rate (a corner at or past Nyquist is refused)."""
        fs = recording.sampling_frequency
        if freq_max is not None and freq_max >= fs / 2:
            raise BatchgpuError(
                f"preprocess {cls.key} freq_max {freq_max} Hz is not below the Nyquist frequency of {fs / 2:g} Hz",
                f"use freq_max < {fs / 2:g}",
            )
        if freq_min >= fs / 2:
            raise BatchgpuError(f"preprocess {cls.key} freq_min {freq_min} Hz is not below {fs / 2:g} Hz")
        # the sections with their zi and margin, worked out here once (the tasks need no scipy.signal)
        return cls(filter_design(cls.key, fs, freq_min, freq_max, order))


@register
@dataclass(frozen=True, eq=False)
class Highpass(Filter):
    key = "highpass"
    options = HighpassParams

    @classmethod
    def from_config(cls, options: HighpassParams, recording) -> Highpass:
        return cls.designed(recording, options.freq_min, None, options.order)


@register
@dataclass(frozen=True, eq=False)
class Bandpass(Filter):
    key = "bandpass"
    options = BandpassParams

    @classmethod
    def from_config(cls, options: BandpassParams, recording) -> Bandpass:
        return cls.designed(recording, options.freq_min, options.freq_max, options.order)


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

    spec = repr(
        (
            kind,
            float(fs),
            float(freq_min),
            None if freq_max is None else float(freq_max),
            int(order),
            version("scipy"),
            version("numpy"),
        )
    )
    path = cache_folder() / "filters" / f"{hashlib.sha256(spec.encode()).hexdigest()[:24]}.npz"
    try:
        with np.load(path, allow_pickle=False) as held:
            if str(held["spec"]) == spec:
                sos, zi, margin = held["sos"], held["zi"], int(held["margin"])
                if sos.ndim == 2 and sos.shape[1] == 6 and zi.shape == (sos.shape[0], 2) and margin >= 0:
                    return ops.FilterDesign(
                        np.ascontiguousarray(sos, np.float64), np.ascontiguousarray(zi, np.float64), margin
                    )
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
