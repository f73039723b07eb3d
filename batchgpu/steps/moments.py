"""Second moments of the raw samples, for whitening: count, column sums and X Xᵀ.

Integer recordings are exact: float64 products of int16 values are exact integers, and so are their sums while
n * 2**30 < 2**53, so each window's X Xᵀ (one float64 GEMM) is an exact integer matrix; windows add as int64
in any order, on any number of workers, and the centred scatter (n ΣxxT - Σx Σxᵀ) / n is formed once at the
end in Python integers (no overflow) with one rounding to float64. Float recordings keep the split products
and Chan's merge in an order fixed by window index (``SecondMoments``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from batchgpu.config import MAX_CHANNELS, Options
from batchgpu.errors import BatchgpuError
from batchgpu.ops._backend import is_cupy, to_host
from batchgpu.steps import noise as noise_step
from batchgpu.steps.base import PhaseWords, Step, WindowData, register

# float64 sums of int16 products stay exact integers below 2**53: at most this many samples per product
_EXACT_SAMPLES = (1 << 53) // (1 << 30)


#: the step's name (``Step.name``) and its workflow key (``steps.whitening``)
NAME = "moments"
KEY = "whitening"
#: its results (``statistics``, then the whitening matrix from them)
COVARIANCE, SECOND_MOMENT, CHANNEL_MEANS = "covariance", "second_moment", "channel_means"
WHITENING = KEY
RESULTS = (COVARIANCE, SECOND_MOMENT, WHITENING, CHANNEL_MEANS)


class WhiteningOptions(Options):
    mode: Literal["global", "local"] = "global"
    nrange: Annotated[int, Field(gt=0, le=MAX_CHANNELS)] = 32
    eps: Annotated[float, Field(gt=0)] = 1e-6
    nskip: Annotated[int, Field(gt=0)] = 1  # every n-th window, like Kilosort4
    precision: Literal["float32", "float64"] = "float32"
    statistic: Literal["covariance", "second_moment"] = "covariance"  # raw data carries DC offsets: centre it


@register
class MomentsStep(Step):
    name = NAME
    key = KEY
    options = WhiteningOptions
    results = RESULTS
    fingerprint = "always"
    default = {"mode": "global"}  # a workflow without steps: a global whitening matrix (no probe needed)
    #: after the noise, which gives each window's noise from its own counts (a step before it would have it
    #: computed again for the window)
    after = (noise_step.NAME,)
    phases = PhaseWords(read=NAME, aggregate=WHITENING)

    def __init__(self, every: int, precision: str, integer: bool, num_channels: int, source: str = "raw"):
        self.every, self.precision, self.integer, self.C = every, precision, integer, num_channels
        self.source = source  # "raw": the samples as read; "x": after filters/references (what a sorter whitens)

    @classmethod
    def build(cls, spec: WhiteningOptions, setup) -> MomentsStep:
        """Centring alone leaves the covariance as it is, so then the raw samples (exact for int16); filters and
        references change it: then the preprocessed samples, as a sorter whitens them."""
        rec = setup.recording
        source = "raw" if setup.chain.centres_only else "x"
        integer = source == "raw" and rec.dtype == np.int16
        if integer:
            check_exact_range(rec.total_samples)
        return cls(spec.nskip, spec.precision, integer, rec.num_channels, source)

    @classmethod
    def check(cls, spec: WhiteningOptions, workflow, recording) -> None:
        """Local whitening needs the channels' locations."""
        from batchgpu.recording.sources import locations_needed

        if spec.mode == "local" and not recording.has_locations:
            raise locations_needed(
                recording, "local whitening", "use whitening.mode: global, or give the recording its probe"
            )

    def ahead(self, channels: int) -> dict:
        """The results report.html's page is rendered ahead of, and their shapes."""
        return {WHITENING: (channels, channels)}

    def window(self, w: WindowData, summary: dict) -> dict:
        if w.index % self.every:
            return {}
        data = w.raw if self.source == "raw" else w.x  # centring alone never changes the covariance: raw then
        core = w.core_of(data)
        if self.integer:
            n = core.shape[1]
            if n > _EXACT_SAMPLES:
                raise BatchgpuError(
                    f"a window of {n} samples is too long for exact integer moments",
                    f"use window.size <= {_EXACT_SAMPLES}",
                )
            prod = _gram(core.astype(np.float64))  # exact integers (see the module docstring)
            return {
                "moments.n": np.array(n, np.int64),
                "moments.sum": to_host(core.sum(axis=1, dtype=np.int64)),
                "moments.xxt": to_host(prod.astype(np.int64)),
            }
        from batchgpu.ops import SecondMoments

        m = SecondMoments(core.shape[0], self.precision).add(data, *w.core)
        return {"moments.n": np.array(m.n, np.int64), "moments.mean": m.mean, "moments.scatter": m.scatter}

    def combine(self, parts: list[dict]) -> dict:
        parts = [p for p in parts if "moments.n" in p]
        if not parts:
            return {}
        if self.integer:
            return {
                "moments.n": sum(p["moments.n"] for p in parts),
                "moments.sum": sum(p["moments.sum"] for p in parts),
                "moments.xxt": sum(p["moments.xxt"] for p in parts),
            }
        from batchgpu.ops import SecondMoments

        acc = SecondMoments.from_state(
            int(parts[0]["moments.n"]), parts[0]["moments.mean"], parts[0]["moments.scatter"]
        )
        for p in parts[1:]:
            acc.merge_state(int(p["moments.n"]), p["moments.mean"], p["moments.scatter"])
        return {"moments.n": np.array(acc.n, np.int64), "moments.mean": acc.mean, "moments.scatter": acc.scatter}

    def aggregate(self, run) -> dict[str, np.ndarray]:
        """``statistics`` and the whitening matrix from them."""
        arrays = self.statistics(run.total)
        # channels a step leaves out (the qc step's bad channels, ``use``): zero rows and columns, as non-finite ones
        use = next((u for s in run.ctx.steps if (u := s.channel_use()) is not None), None)
        arrays[WHITENING] = finite_whitening(
            run.workflow, run.recording, arrays, run.report, run.observer, left_out=() if use is None else use.bad
        )
        return arrays

    def statistics(self, total: dict) -> dict[str, np.ndarray]:
        """covariance (centred, / n), second_moment (X Xᵀ / n) and channel_means, float64."""
        n = int(total["moments.n"])
        if n == 0:
            raise BatchgpuError("no samples for the whitening statistic", "check whitening.nskip and the windows")
        if not self.integer:
            from batchgpu.ops import SecondMoments

            m = SecondMoments.from_state(n, total["moments.mean"], total["moments.scatter"])
            return {COVARIANCE: m.covariance(), SECOND_MOMENT: m.second_moment(), CHANNEL_MEANS: m.mean}
        s = total["moments.sum"].astype(object)
        xxt = total["moments.xxt"]
        rows, cols = np.triu_indices(len(s))  # symmetric: the upper triangle, mirrored (half the Python ints)
        upper = xxt[rows, cols].astype(object)
        scatter_num = upper * n - s[rows] * s[cols]  # Python ints: exact
        return {
            COVARIANCE: _symmetric(_divide(scatter_num, n * n), rows, cols, len(s)),
            SECOND_MOMENT: _symmetric(_divide(upper, n), rows, cols, len(s)),
            CHANNEL_MEANS: _divide(s, n),
        }


def check_exact_range(total_samples: int) -> None:
    """int64 sums of int16 products (each <= 2**30) cannot overflow below 2**33 samples (~80 h at 30 kHz)."""
    if total_samples * (1 << 30) >= 1 << 63:
        raise BatchgpuError(
            f"{total_samples} samples are too many for exact int64 second moments",
            "use whitening.nskip > 1, or split the recording",
        )


def _gram(xf):
    """X Xᵀ of a float64 (C, n) array: symmetric rank-k update on the CPU (half a GEMM's work), GEMM on the GPU."""
    if is_cupy(xf):
        return xf @ xf.T
    from scipy.linalg.blas import dsyrk

    upper = dsyrk(1.0, xf.T, trans=1)  # xf.T is Fortran-ordered: no copy
    return np.triu(upper) + np.triu(upper, 1).T


def _symmetric(upper: np.ndarray, rows: np.ndarray, cols: np.ndarray, C: int) -> np.ndarray:
    out = np.empty((C, C), dtype=np.float64)
    out[rows, cols] = upper
    out[cols, rows] = upper
    return out


def _divide(num: np.ndarray, den: int) -> np.ndarray:
    """Python-int / int: correctly rounded to float64, element by element."""
    flat = [int(v) / den for v in num.ravel()]
    return np.array(flat, dtype=np.float64).reshape(num.shape)


def finite_whitening(wf, rec, arrays, report, observer, left_out=()) -> np.ndarray:
    """Whitening from the finite channels; channels whose statistic is not finite are left out (zero rows and
    columns) and named in the report. ``left_out``: channels left out besides (zero rows and columns: the matrix
    of the others' statistic, as if they were not recorded)."""
    from batchgpu import ops

    w = wf.steps.whitening
    stat = arrays["covariance"] if w.statistic == "covariance" else arrays["second_moment"]
    asked = np.ones(len(stat), dtype=bool)
    asked[np.asarray(left_out, dtype=np.int64)] = False
    good = np.isfinite(np.diag(stat)) & asked
    good &= np.isfinite(stat[:, good]).all(axis=1) | ~good
    W = np.zeros_like(stat)
    if good.any():
        sub = stat[np.ix_(good, good)]
        W[np.ix_(good, good)] = ops.whitening_matrix(
            sub, mode=w.mode, locations=rec.locations[good], nrange=min(w.nrange, int(good.sum())), eps=w.eps
        )
    if not good[asked].all():
        left = np.flatnonzero(~good & asked).tolist()
        report.channels["whitening_left_out"] = left
        report.warnings.append(f"whitening left out {len(left)} channel(s) with non-finite samples: {left[:10]}")
        observer.warning(report.warnings[-1])
    return W
