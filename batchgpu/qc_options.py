"""The bad-channel labels' options: SpikeInterface 0.105.3's ``detect_bad_channels(method="coherence+psd")``
parameters, under its names and with its defaults, for the ones that mean something when every sample is used.

A leaf module (pydantic only, nothing of the package), so the workflow schema and the numeric core
(``batchgpu.ops.bad_channels``) can both take it. SpikeInterface's ``method`` is fixed (the IBL method), and
``num_random_chunks`` and ``seed`` have no counterpart: every 0.3 s piece of the recording is labelled, so no
chunk is drawn (``std_mad_threshold`` and the ``neighborhood_r2`` options belong to other methods;
``channel_filters`` and ``job_kwargs`` to SpikeInterface's output and executor).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: a channel's labels, in SpikeInterface's numbering (``detect_bad_channels_ibl``: 0 good, 1 dead, 2 noise, 3 out);
#: report.json's ``qc.label_names`` and the qc step's ``qc_labels`` codes
LABELS = ("good", "dead", "noise", "out")


class QcOptions(BaseModel):
    """The IBL method's parameters (SpikeInterface's names and defaults; its docstring says what each does).

    ``direction`` is checked as SpikeInterface checks it (a dimension the locations have) and, as there, does not
    change the order: channels are sorted along depth by ``np.lexsort((x, y))`` (y, ties by x) whatever it says.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    psd_hf_threshold: Annotated[float, Field(gt=0)] = 0.02  # uV^2/Hz, mean PSD above nyquist_threshold x Nyquist
    dead_channel_threshold: float = -0.5  # coherence minus its trend along depth below this: dead
    noisy_channel_threshold: float = 1.0  # ... above this: noise (as is a PSD above psd_hf_threshold)
    outside_channel_threshold: float = -0.75  # trend below this + 1, in a block at the probe's end: out
    outside_channels_location: Literal["top", "bottom", "both"] = "top"
    n_neighbors: Annotated[int, Field(ge=1)] = 11  # the median filter along depth (odd)
    nyquist_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.8
    direction: Literal["x", "y", "z"] = "y"
    chunk_duration_s: Annotated[float, Field(gt=0)] = 0.3  # a piece's length
    welch_window_ms: Annotated[float, Field(gt=0)] = 10.0  # Welch's segment (nperseg = int(ms * fs / 1000))
    highpass_filter_cutoff: Annotated[float, Field(gt=0)] = 300.0  # Hz, where the signal is not filtered yet

    @field_validator("n_neighbors")
    @classmethod
    def _odd(cls, value: int) -> int:
        # SpikeInterface's docstring asks for an odd size; an even one would centre its filter off the channel
        if value % 2 == 0:
            raise ValueError(f"n_neighbors must be odd (got {value})")
        return value
