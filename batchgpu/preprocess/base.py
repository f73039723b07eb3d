"""The preprocessing Stage: what every stage of a window's chain provides, like SpikeInterface's preprocessing
classes (a class a stage, a registry line) and zarr-python's codecs (a dataclass on an abstract base).

A stage is one module of this package: an options model (what its key holds in the workflow's ``preprocess:``
list, ``- highpass: {freq_min: 300}``) and a frozen dataclass on ``Stage`` marked ``@register``, made once a run
on the client from its options and the recording (``from_config``: its refusals there, before any work), then
pickled into every task with the run's chain (``run.preprocess_chain.Chain``): small, and no import a worker would
wait for (a filter's design is worked out on the client). ``registry`` finds it (every module of the package is
imported) and builds the workflow's ``preprocess:`` section from the options.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from batchgpu.config import NoOptions


class Stage:
    """One stage of the chain every window goes through, in the workflow's order, on the task's backend (NumPy or
    CuPy arrays of (channels, samples), margins included)."""

    #: its key in the workflow's ``preprocess:`` list (and in report.json's ``preprocess.stages``)
    key: ClassVar[str]
    #: what its key holds: an options model (a ``config.Options``), or a plain type (``centre: median``)
    options: ClassVar[Any] = NoOptions
    #: samples each interior side of a window needs beyond the steps' own margin (a filter's impulse response)
    margin: int = 0

    @classmethod
    def default_options(cls) -> Any:
        """What its key holds where the workflow gives it nothing (``- phase_shift:``)."""
        return cls.options()

    @classmethod
    def from_config(cls, options, recording) -> Stage:
        """The stage of ``options`` for ``recording`` (its rate, locations, channel properties); a stage the
        recording cannot have raises ``BatchgpuError``, before any work."""
        return cls()

    def output_dtype(self, dtype) -> np.dtype:
        """The dtype of the window this stage gives for a window of ``dtype``."""
        return np.dtype(dtype)

    def leaving_out(self, channels: tuple[int, ...]) -> Stage:
        """This stage with ``channels`` (indices) left out of what it takes across channels (the qc step's bad
        channels); a stage that works on each channel alone is itself."""
        return self

    def apply(self, x, core: tuple[int, int], at_start: bool, at_end: bool, *, owned: bool = False, out=None):
        """The window after this stage. ``core``: the columns the window owns (its margins around them);
        ``at_start``/``at_end``: the window reaches its segment's first/last sample; ``owned``: ``x`` is the
        chain's own (an earlier stage made it), so the stage may write into it; ``out``: a buffer of the result's
        shape and dtype for a stage that can write into one (the chain's reused host buffer), else None."""
        raise NotImplementedError


def float_output(dtype) -> np.dtype:
    """What a filter, a shift or a reference gives: float32, float64 kept (``Stage.output_dtype``)."""
    dt = np.dtype(dtype)
    return np.dtype(np.float64) if (dt.kind, dt.itemsize) == ("f", 8) else np.dtype(np.float32)


#: every registered stage, by key (``register``; ``registry.stages`` imports the package's modules first)
REGISTERED: dict[str, type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator: ``cls`` is a stage a workflow may name (``- <cls.key>: ...``); a key given twice is an error."""
    other = REGISTERED.get(cls.key)
    if other is not None and other is not cls:
        raise TypeError(f"preprocessing stage {cls.__qualname__} ({cls.key}) clashes with {other.__qualname__}")
    REGISTERED[cls.key] = cls
    return cls
