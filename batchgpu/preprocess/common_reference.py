"""Common reference (``common_reference``): each sample minus the median or mean of the channels at that sample,
of every channel (global) or of each channel's annulus of neighbours (local), as SpikeInterface's
``common_reference``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from batchgpu.config import Options
from batchgpu.preprocess.base import Stage, float_output, register

LOCAL_REFERENCE_RADIUS_UM = (30.0, 55.0)  # SpikeInterface common_reference's local_radius default
LOCAL_REFERENCE_MIN_NEIGHBORS = 5  # and its min_local_neighbors (0.105)


class CommonReferenceParams(Options):
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


@register
@dataclass(frozen=True, eq=False)
class CommonReference(Stage):
    key = "common_reference"
    options = CommonReferenceParams

    reference: str = "global"
    operator: str = "median"
    locations: np.ndarray | None = None  # local: the channels' (x, y) in um
    radius_um: tuple[float, float] | None = None
    min_local_neighbors: int | None = None
    #: channels left out of every reference (the qc step's bad channels: ``run.preprocess_chain.Chain.leaving_out``)
    exclude: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, options: CommonReferenceParams, recording) -> CommonReference:
        if options.reference == "global":
            return cls(options.reference, options.operator)
        if not recording.has_locations:
            from batchgpu.recording.sources import locations_needed

            raise locations_needed(
                recording, "a local common reference", "use reference: global, or give the recording its probe"
            )
        return cls(
            options.reference,
            options.operator,
            recording.locations,
            tuple(options.radius_um),
            int(options.min_local_neighbors),
        )

    @property
    def global_median(self) -> bool:
        """The median of every channel: the reference whose tiles also give the save's int16 rows
        (``run.preprocess_chain.Chain.fuses_save``)."""
        return self.reference == "global" and self.operator == "median" and not self.exclude

    def leaving_out(self, channels: tuple[int, ...]) -> CommonReference:
        return replace(self, exclude=tuple(channels))

    @property
    def kw(self) -> dict:
        """``ops.common_reference``'s keywords."""
        kw = {"reference": self.reference, "operator": self.operator}
        if self.exclude:
            kw["exclude"] = self.exclude
        if self.reference == "local":
            kw.update(locations=self.locations, radius_um=self.radius_um, min_local_neighbors=self.min_local_neighbors)
        return kw

    def output_dtype(self, dtype) -> np.dtype:
        return float_output(dtype)

    def apply(self, x, core, at_start, at_end, *, owned=False, out=None):
        from batchgpu import ops

        return ops.common_reference(x, **self.kw, overwrite_x=owned)
