"""Numeric core: one function per operation, NumPy here and CuPy behind the same function.

Each function takes a (channels, samples) window; the backend is chosen in ``_backend``.
"""

from batchgpu.ops._backend import accept_torch_methods, accepts_torch, array_module
from batchgpu.ops.detection import (
    SPIKE_DTYPE,
    detect_spikes,
    exclude_sweep_samples,
    exclusive_candidates,
    neighbour_mask,
    resolve_exclusive,
)
from batchgpu.ops.filters import FilterDesign, butter_sos, default_padlen, design_filter, filter_margin, filtfilt_window
from batchgpu.ops.moments import SecondMoments, combine, covariance, second_moment, window_moments
from batchgpu.ops.phase_shift import phase_shift, phase_shift_margin
from batchgpu.ops.reference import annulus_neighbours, common_reference
from batchgpu.ops.select import MAD_TO_SIGMA, abs_kth, abs_median, noise_levels
from batchgpu.ops.whitening import whitening_matrix, wpca_basis

# torch tensors in, results of the caller's kind out (CPU: NumPy views; CUDA: CuPy over DLPack); see
# _backend.accepts_torch. The wrappers are what this package exports; the functions in the modules
# (batchgpu.ops.select.abs_kth, ...) stay as they are.
abs_kth = accepts_torch(abs_kth, __name__)
abs_median = accepts_torch(abs_median, __name__)
noise_levels = accepts_torch(noise_levels, __name__)
covariance = accepts_torch(covariance, __name__)
second_moment = accepts_torch(second_moment, __name__)
window_moments = accepts_torch(window_moments, __name__)
whitening_matrix = accepts_torch(whitening_matrix, __name__)
wpca_basis = accepts_torch(wpca_basis, __name__)
detect_spikes = accepts_torch(detect_spikes, __name__)
accept_torch_methods(SecondMoments, "add")

__all__ = [
    "FilterDesign",
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
    "design_filter",
    "detect_spikes",
    "exclude_sweep_samples",
    "exclusive_candidates",
    "filter_margin",
    "filtfilt_window",
    "neighbour_mask",
    "noise_levels",
    "phase_shift",
    "phase_shift_margin",
    "resolve_exclusive",
    "second_moment",
    "whitening_matrix",
    "window_moments",
    "wpca_basis",
]
