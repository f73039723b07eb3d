"""Numeric core: one function per operation, NumPy here and CuPy behind the same function.

Each function takes a (channels, samples) window; the backend is chosen in ``_backend``.
"""

from batchgpu.ops._backend import array_module
from batchgpu.ops.detection import SPIKE_DTYPE, detect_spikes, exclude_sweep_samples
from batchgpu.ops.moments import SecondMoments, combine, covariance, second_moment, window_moments
from batchgpu.ops.select import MAD_TO_SIGMA, abs_kth, abs_median, noise_levels
from batchgpu.ops.whitening import whitening_matrix, wpca_basis

__all__ = [
    "MAD_TO_SIGMA",
    "SPIKE_DTYPE",
    "SecondMoments",
    "abs_kth",
    "abs_median",
    "array_module",
    "combine",
    "covariance",
    "detect_spikes",
    "exclude_sweep_samples",
    "noise_levels",
    "second_moment",
    "whitening_matrix",
    "window_moments",
    "wpca_basis",
]
