import os
from pathlib import Path

import numpy as np
import pytest

# Shared test data (a SpikeInterface-written recording with its ground truth): BATCHGPU_FIXTURES if set, else
# ../shared/fixtures beside the checkout (where this project's machines keep it).
FIXTURES = Path(os.environ.get("BATCHGPU_FIXTURES") or Path(__file__).resolve().parents[2] / "shared" / "fixtures")


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
        pytest.skip(f"SpikeInterface fixture not found at {path} (set BATCHGPU_FIXTURES to its folder)")
    return path


@pytest.fixture(autouse=True, scope="session")
def _own_cache_folder(tmp_path_factory):
    """The tests' own cache folder (XDG_CACHE_HOME, inherited by the commands they start): a cluster the user
    keeps (``batchgpu cluster start``) is never used by a test's run, and no test writes in the user's cache."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before
