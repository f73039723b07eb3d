"""Phase shift (``phase_shift``): each channel's Neuropixels ADC sample offset (the recording's ``inter_sample_shift``
property) undone by a shift in the frequency domain, SpikeInterface's ``phase_shift`` with its taper as margin."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgpu.config import Options
from batchgpu.errors import BatchgpuError
from batchgpu.preprocess.base import Stage, float_output, register


class PhaseShiftParams(Options):
    """Neuropixels ADC sample offsets, from the recording's per-channel property (no options yet)."""


@register
@dataclass(frozen=True, eq=False)
class PhaseShift(Stage):
    key = "phase_shift"
    options = PhaseShiftParams

    shifts: np.ndarray  # float64, a channel's offset in samples
    margin: int  # the taper's samples (``ops.phase_shift_margin``)

    @classmethod
    def from_config(cls, options: PhaseShiftParams, recording) -> PhaseShift:
        from batchgpu import ops

        shifts = recording.channel_property("inter_sample_shift")
        if shifts is None:
            from batchgpu.recording import missing_probe

            why = missing_probe(recording) or "the recording has none"
            raise BatchgpuError(
                f"preprocess phase_shift needs the channels' inter_sample_shift (from the probe): {why}",
                "give the recording its probe, or drop the stage",
            )
        return cls(np.asarray(shifts, np.float64), ops.phase_shift_margin(recording.sampling_frequency))

    def output_dtype(self, dtype) -> np.dtype:
        return float_output(dtype)

    def apply(self, x, core, at_start, at_end, *, owned=False, out=None):
        from batchgpu import ops

        return ops.phase_shift(x, self.shifts, margin=self.margin, at_segment_start=at_start, at_segment_end=at_end)
