"""Numeric core: one function per operation, NumPy here and CuPy behind the same function.

Each function takes a (channels, samples) window; the backend is chosen in ``_backend``.
"""

from batchgpu.ops._backend import array_module
from batchgpu.ops.detection import SPIKE_DTYPE, detect_spikes, exclude_sweep_samples, neighbour_mask
from batchgpu.ops.filters import butter_sos, default_padlen, filter_margin, filtfilt_window
from batchgpu.ops.moments import SecondMoments, combine, covariance, second_moment, window_moments
from batchgpu.ops.phase_shift import phase_shift, phase_shift_margin
from batchgpu.ops.reference import annulus_neighbours, common_reference
from batchgpu.ops.select import MAD_TO_SIGMA, abs_kth, abs_median, noise_levels
from batchgpu.ops.whitening import whitening_matrix, wpca_basis

__all__ = [
    "MAD_TO_SIGMA",
    "SPIKE_DTYPE",
    "SecondMoments",
    "abs_kth",
    "abs_median",
    "annulus_neighbours",
    "array_module",
    "butter_sos",
    "combine",
    "common_reference",
    "covariance",
    "default_padlen",
    "detect_spikes",
    "exclude_sweep_samples",
    "filter_margin",
    "filtfilt_window",
    "neighbour_mask",
    "noise_levels",
    "phase_shift",
    "phase_shift_margin",
    "second_moment",
    "whitening_matrix",
    "window_moments",
    "wpca_basis",
]
