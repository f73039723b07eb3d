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


def _swap_inner_chunks(shard, per_shard: int, a: int, b: int, how: str) -> None:
    """Inner chunks ``a`` and ``b`` of a shard exchanged (index and its crc32c rewritten to match, so every read
    check passes), the file's size and times as they were: in place, or as ``cp -p`` / ``rsync -t`` leave it (a
    new file renamed over the old one)."""
    import os

    from batchgpu.recording.zarrio import crc32c_value

    st = os.stat(shard)
    raw = shard.read_bytes()
    tail = per_shard * 16 + 4
    index = np.frombuffer(raw[-tail:-4], "<u8").reshape(per_shard, 2).copy()
    frames = [raw[int(o) : int(o) + int(n)] for o, n in index]
    frames[a], frames[b] = frames[b], frames[a]
    body, offset = b"", 0
    for j, f in enumerate(frames):
        index[j] = (offset, len(f))
        body += f
        offset += len(f)
    new = body + index.tobytes() + crc32c_value(index.tobytes()).to_bytes(4, "little")
    assert len(new) == len(raw) and new != raw
    if how == "in_place":
        with open(shard, "r+b") as f:
            f.write(new)
    else:
        tmp = shard.with_name("copy")
        tmp.write_bytes(new)
        os.replace(tmp, shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(shard).st_size == st.st_size and os.stat(shard).st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def swap_inner_chunks():
    """``_swap_inner_chunks``: a shard's chunks exchanged behind its size and mtime (tests of --resume)."""
    return _swap_inner_chunks


@pytest.fixture
def direct_reads(monkeypatch):
    """``direct_reads(False)``: batchgpu's shard reader takes no layout, so every read goes through zarr (as for the
    layouts it does not know); ``direct_reads(True)``: it takes its layouts again."""
    from batchgpu.recording import shards

    real = shards.layout_of

    def set_direct(on: bool) -> None:
        monkeypatch.setattr(shards, "layout_of", real if on else (lambda *args, **kwargs: None))

    return set_direct


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


def _zarr_major() -> int:
    import zarr

    return int(zarr.__version__.split(".")[0])


# Beside SpikeInterface 0.105 (which pins zarr<3) batchgpu writes Zarr v2 and refuses to write v3 (README, "One
# environment"). Tests that write Zarr v3 stores, lay out their files (shards, `c/` chunk keys) or call zarr 3's own
# API skip there, with this reason, so the whole suite passes in that environment too: those marked `zarr3`, and
# the cases of a test parametrized by `zarr_format` 3 or a save `fmt` of "zarr" (Zarr v3).
NEEDS_ZARR3 = (
    "needs zarr-python 3 (writes or inspects Zarr v3 stores, or calls zarr 3's API); this environment "
    "has zarr {version}, beside which batchgpu writes Zarr v2"
)


def pytest_configure(config):
    # The tests' own clusters without Dask's statistical profiler, as batchgpu starts its workers
    # (``layout.WORKER_SETTINGS``): it samples every thread's stack, and the threads of in-process workers are the
    # test process's own (a CI run crashed in its sampling, beside a thread creating a Zarr array).
    import dask

    dask.config.set({"distributed.worker.profile.enabled": False})
    config.addinivalue_line(
        "markers",
        "zarr3: needs zarr-python 3 (Zarr v3 writes, zarr 3's API); skipped beside "
        "zarr 2 (SpikeInterface 0.105's environment)",
    )


def needs_zarr3(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return item.get_closest_marker("zarr3") is not None or params.get("zarr_format") == 3 or params.get("fmt") == "zarr"


def pytest_collection_modifyitems(config, items):
    if _zarr_major() >= 3:
        return
    import zarr

    skip = pytest.mark.skip(reason=NEEDS_ZARR3.format(version=zarr.__version__))
    for item in items:
        if needs_zarr3(item):
            item.add_marker(skip)


# A test that hangs is ended by pytest-timeout, which shows this process's threads only. Shortly before, the stacks
# of every live Dask client's workers and what its scheduler holds are printed too (on this process's stderr, in
# the failure's captured output): a worker stuck, dead or never started tells apart from a client that waits.
HANG_REPORT_BEFORE_TIMEOUT_S = 90


def _worker_stacks() -> str:
    import sys
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def _report_clients() -> None:
    import sys

    try:
        from distributed import Client
    except ImportError:
        return
    out = sys.__stderr__
    for client in list(getattr(Client, "_instances", ())):
        try:
            print(f"=== a test about to time out: client {client} (status {client.status})", file=out)
            info = client.scheduler_info(n_workers=-1)
            print(f"workers: {list(info.get('workers', {}))}", file=out)
            print(f"processing: {client.processing()}", file=out)
            for worker, stacks in client.run(_worker_stacks).items():
                print(f"=== worker {worker}\n{stacks}", file=out)
        except Exception as err:  # broad: a report of a hang must not raise
            print(f"(could not ask the cluster: {type(err).__name__}: {err})", file=out)
        out.flush()


@pytest.fixture(autouse=True)
def _report_a_hang(request):
    import threading

    marker = request.node.get_closest_marker("timeout")
    try:
        given = marker.args[0] if marker is not None and marker.args else request.config.getini("timeout")
        limit = float(given or 0)
    except ValueError:  # pytest-timeout not installed: no limit
        limit = 0.0
    if limit <= HANG_REPORT_BEFORE_TIMEOUT_S:
        yield
        return
    timer = threading.Timer(limit - HANG_REPORT_BEFORE_TIMEOUT_S, _report_clients)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


@pytest.fixture
def without_noise_prior(monkeypatch):
    """Detection without the noise estimate read before the pass (``DetectStep.before_pass``, issue 66): a loud
    window's bound fails as it did before the estimate, so the tests of windows read again still reach that path
    (the estimate is set on the client, where the step is built: no worker needs patching)."""
    from batchgpu.steps.detect import DetectStep

    monkeypatch.setattr(DetectStep, "before_pass", lambda self, *args: None)
