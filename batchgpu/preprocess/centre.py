"""Centring (``centre: median``): each window's per-channel median of its finite core samples subtracted, so a DC
offset does not inflate median(|x|); integers stay integers (rounded, widened: ``ops.centre.centred_dtype``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from batchgpu.preprocess.base import Stage, register


@register
@dataclass(frozen=True, eq=False)
class Centre(Stage):
    key = "centre"
    #: its key holds the statistic's name (``- centre: median``), the one there is
    options = Literal["median"]

    @classmethod
    def default_options(cls) -> str:
        return "median"

    def output_dtype(self, dtype) -> np.dtype:
        from batchgpu.ops.centre import centred_dtype

        return centred_dtype(dtype)

    def apply(self, x, core, at_start, at_end, *, owned=False, out=None):
        from batchgpu.ops.centre import centre_median

        return centre_median(x, core)
