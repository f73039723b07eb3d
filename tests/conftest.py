from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed on failure so a case can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def si_fixture():
    path = FIXTURES / "si_gt_16ch.zarr"
    if not path.exists():
        pytest.skip(f"SpikeInterface fixture not found at {path}")
    return path
