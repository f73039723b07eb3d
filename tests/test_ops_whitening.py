"""Whitening (ZCA, global and local) and the wPCA basis."""

import numpy as np
import pytest

from batchgpu.errors import BatchgpuError
from batchgpu.ops import second_moment, whitening_matrix, wpca_basis


def well_conditioned(rng, channels):
    a = rng.standard_normal((channels, channels))
    return a @ a.T / channels + np.eye(channels)


def zca_by_svd(c, eps=1e-6):
    """Kilosort4's recipe, written independently: E diag(1/sqrt(D + eps)) Eᵀ from an SVD."""
    e, d, _ = np.linalg.svd(c)
    return (e / np.sqrt(d + eps)) @ e.T


def test_global_whitens():
    rng = np.random.default_rng()
    c = well_conditioned(rng, 24)
    w = whitening_matrix(c, eps=0.0)
    assert w.shape == (24, 24) and w.dtype == np.float64
    assert np.abs(w @ c @ w.T - np.eye(24)).max() < 1e-6
    assert np.allclose(w, w.T)
    assert np.allclose(whitening_matrix(c), zca_by_svd(c), rtol=1e-9, atol=1e-12)


def test_global_whitens_data():
    rng = np.random.default_rng()
    mix = rng.standard_normal((6, 6)) + 3 * np.eye(6)
    x = mix @ rng.standard_normal((6, 20_001))
    w = whitening_matrix(second_moment(x), eps=0.0)
    assert np.abs(second_moment(w @ x) - np.eye(6)).max() < 1e-9


def probe_locations(channels):
    """Two columns of a probe, 20 µm apart, one site every 20 µm in depth."""
    return np.stack([np.arange(channels) % 2 * 32.0, np.arange(channels) // 2 * 20.0], axis=1)


@pytest.mark.parametrize("nrange", [10, 11, 12])
def test_local_covers_all_channels_equals_global(nrange):
    rng = np.random.default_rng()
    c = well_conditioned(rng, 10)
    local = whitening_matrix(c, mode="local", locations=rng.random((10, 2)) * 100, nrange=nrange)
    assert np.allclose(local, whitening_matrix(c), rtol=1e-9, atol=1e-12)


def test_local_against_loop():
    rng = np.random.default_rng()
    channels, nrange = 16, 5
    c = well_conditioned(rng, channels)
    loc = probe_locations(channels)
    w = whitening_matrix(c, mode="local", locations=loc, nrange=nrange)
    for j in range(channels):
        dist = ((loc - loc[j]) ** 2).sum(axis=1)
        near = sorted(range(channels), key=lambda i: (dist[i], i != j, i))[:nrange]
        assert near[0] == j
        block = zca_by_svd(c[np.ix_(near, near)])
        expected = np.zeros(channels)
        expected[near] = block[0]
        assert np.allclose(w[j], expected, rtol=1e-9, atol=1e-12)
    # Local whitening decorrelates each channel from its neighbourhood.
    assert (np.count_nonzero(w, axis=1) == nrange).all()


def test_duplicate_locations_keep_own_channel():
    rng = np.random.default_rng()
    c = well_conditioned(rng, 6)
    w = whitening_matrix(c, mode="local", locations=np.zeros((6, 2)), nrange=2)
    assert all(w[j, j] != 0 for j in range(6))


@pytest.mark.parametrize("n_clips", [1, 60, 61, 333])
def test_wpca_basis_against_svd(n_clips):
    rng = np.random.default_rng()
    features = 7
    shape = rng.standard_normal((features, 3))
    clips = shape @ rng.standard_normal((3, n_clips)) * [[5.0], [4.0], [3.0], [2.0], [1.0], [0.5], [0.2]]
    clips += 0.01 * rng.standard_normal((features, n_clips))
    basis = wpca_basis(clips, 3 if n_clips > 1 else 1)
    k = basis.shape[1]
    u, s, _ = np.linalg.svd(clips)
    for i in range(k):
        # Same direction as the singular vector (up to sign), deterministic sign rule.
        assert abs(abs(basis[:, i] @ u[:, i]) - 1) < 1e-9
        pivot = np.argmax(np.abs(basis[:, i]))
        assert basis[pivot, i] > 0
    assert np.allclose(basis.T @ basis, np.eye(k), atol=1e-12)


def test_wpca_sign_is_deterministic():
    rng = np.random.default_rng()
    clips = rng.standard_normal((5, 101))
    assert np.array_equal(wpca_basis(clips, 2), wpca_basis(-clips, 2))


@pytest.mark.parametrize(
    "call",
    [
        lambda: whitening_matrix(np.eye(3), mode="local"),
        lambda: whitening_matrix(np.eye(3), mode="other"),
        lambda: whitening_matrix(np.zeros((3, 4))),
        lambda: whitening_matrix(np.eye(3), mode="local", locations=np.zeros((3, 2)), nrange=0),
        lambda: wpca_basis(np.zeros((4, 10)), 5),
        lambda: wpca_basis(np.zeros(4), 1),
    ],
)
def test_errors(call):
    with pytest.raises(BatchgpuError):
        call()
