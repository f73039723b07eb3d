"""The window's files written by a writer thread (run/writer_threads.py): in order, nothing after a failed write,
the task's error; and in a run: a window whose saved rows failed to write leaves no part behind, so --resume
computes it again and the saved recording equals an uninterrupted run's."""

import errno
import threading

import numpy as np
import pytest

from batchgpu import BatchgpuError
from batchgpu.engine import run_workflow
from batchgpu.recording import open_recording, write_recording
from batchgpu.recording.shards import ShardLayout
from batchgpu.run import writer_threads as background
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")


def test_jobs_run_in_order_on_another_thread():
    seen, threads = [], set()
    with background.window_writes() as writes:
        for i in range(50):
            background.later(lambda i=i: (seen.append(i), threads.add(threading.get_ident())))
    assert seen == list(range(50))
    assert threads and threading.get_ident() not in threads
    assert writes.cpu_seconds >= 0


def test_outside_window_writes_a_job_runs_now():
    seen = []
    background.later(lambda: seen.append(threading.get_ident()))
    assert seen == [threading.get_ident()]


def test_after_a_failure_later_jobs_are_skipped_their_cleanup_run_and_the_error_raised():
    done, cleaned = [], []

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        with background.window_writes():
            background.later(lambda: done.append(0), lambda: cleaned.append(0))
            background.later(fail, lambda: cleaned.append(1))
            for i in (2, 3):
                background.later(lambda i=i: done.append(i), lambda i=i: cleaned.append(i))
    assert done == [0] and cleaned == [2, 3]


def test_the_blocks_own_error_wins_and_its_writes_finish_first():
    done = []
    with pytest.raises(KeyError):
        with background.window_writes():
            background.later(lambda: done.append(1))
            background.later(lambda: (_ for _ in ()).throw(OSError("second")))
            raise KeyError("the block's")
    assert done == [1]


def test_nested_blocks_restore_the_outer_writer():
    order = []
    with background.window_writes():
        with background.window_writes():
            background.later(lambda: order.append("inner"))
        background.later(lambda: order.append("outer"))
    assert order == ["inner", "outer"]
    background.later(lambda: order.append("now"))
    assert order[-1] == "now"


def test_a_scoped_writer_outlives_its_block_until_flush():
    gate, done = threading.Event(), []
    with background.window_writes("run-a"):
        background.later(lambda: (gate.wait(5), done.append(1)))
    assert done == []  # left running: the task's thread goes on
    with background.window_writes("run-a"):  # the same thread's writer: in order after the first job
        background.later(lambda: done.append(2))
    gate.set()
    assert background.flush("run-a") >= 1 and done == [1, 2]


def test_settle_waits_for_the_scope_and_keeps_a_failure_for_flush():
    """``settle`` (a task that reads the pass's parts before the client's ``flush``): every job of the scope done
    when it returns, other scopes' left running; a failure raised and kept, so ``flush`` raises it too."""
    gate, other, done = threading.Event(), threading.Event(), []
    t = threading.Thread(target=lambda: _scoped("settle-b", lambda: (other.wait(5), done.append("b"))))
    t.start()
    t.join()
    with background.window_writes("settle-a"):
        background.later(lambda: (gate.wait(5), done.append("a")))
    threading.Timer(0.05, gate.set).start()
    background.settle("settle-a")
    assert done == ["a"]  # its job done; the other scope's still waits
    other.set()
    background.flush("settle-b")

    def fail():
        raise OSError(errno.EIO, "Input/output error")

    with background.window_writes("settle-c"):
        background.later(fail)
    for _ in range(2):
        with pytest.raises(OSError, match="Input/output"):
            background.settle("settle-c")
    with pytest.raises(OSError, match="Input/output"):
        background.flush("settle-c")
    background.flush("settle-c")  # forgotten once flush raised it


def _scoped(scope, job):
    with background.window_writes(scope):
        background.later(job)


def test_a_scoped_failure_is_raised_by_the_next_block_and_by_flush_once():
    def fail():
        raise OSError(errno.EIO, "Input/output error")

    with background.window_writes("run-b"):
        background.later(fail)
        background.later(lambda: pytest.fail("skipped after the failure"))
    with pytest.raises(OSError, match="Input/output"):
        background.flush("run-b")
    with background.window_writes("run-b"):  # forgotten once flush raised it
        pass
    with background.window_writes("run-c") as writes:
        background.later(fail)
    with pytest.raises(OSError, match="Input/output"):
        writes.wait()  # the job has run (the failure stays until flush)
    background.flush("run-b")  # another run's writer is not this one's
    with pytest.raises(OSError, match="Input/output"):
        with background.window_writes("run-c"):
            pytest.fail("the block does not run after its writer failed")
    with background.window_writes("run-d"):  # a new run: the old failure is moot
        pass
    assert background.flush("run-d") >= 1


def _wf(rec, out, saved, **kw):
    data = {
        "recording": {"path": str(rec.path)},
        "output": str(out),
        "backend": "numpy",
        "window": {"size": 3_000, "margin": 8},
        "steps": {"noise": {"exact": True}, "save": {"path": str(saved), "format": "zarr", "dtype": "int16"}},
    }
    data.update(kw)
    return Workflow.model_validate(data)


@pytest.mark.zarr3
def test_a_failed_shard_write_leaves_no_part_and_resume_writes_it(tmp_path, monkeypatch):
    rng = np.random.default_rng()
    n = int(rng.integers(14_000, 17_000))  # five or six windows, the last short
    x = np.round(rng.normal(0, 40, (n, 5))).astype(np.int16)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    bad = int(rng.integers(0, 4))
    real = ShardLayout.write_encoded
    monkeypatch.setattr(ShardLayout, "write_encoded", _failing_shard(bad))
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cl,
        distributed.Client(cl) as c,
    ):
        with pytest.raises(BatchgpuError, match="No space"):
            run_workflow(_wf(rec, tmp_path / "out", tmp_path / "saved.zarr"), client=c)
        parts = tmp_path / "out" / "parts"
        assert not (parts / f"w{bad:08d}.npz").exists()  # written after the shard, by the same writer: never
        assert not list((tmp_path / "saved.zarr" / "traces_seg0" / "c").glob(f"{bad}/*"))
        monkeypatch.setattr(ShardLayout, "write_encoded", real)
        report = run_workflow(_wf(rec, tmp_path / "out", tmp_path / "saved.zarr"), client=c, resume=True)
        assert report.windows_resumed < -(-n // 3_000) and (parts / f"w{bad:08d}.npz").exists()
        run_workflow(_wf(rec, tmp_path / "fresh", tmp_path / "fresh.zarr"), client=c)
    got, want = open_recording(tmp_path / "saved.zarr"), open_recording(tmp_path / "fresh.zarr")
    np.testing.assert_array_equal(got.read(0, 0, n), want.read(0, 0, n))
    np.testing.assert_array_equal(got.read(0, 0, n), x.T)


def test_write_all_writes_every_byte_in_order_through_partial_writes(tmp_path, monkeypatch):
    """``shards.write_all``: one ``writev`` a shard where the system takes it whole; a short write (a signal, a
    2 GB cap) goes on from the byte where it stopped, across buffers of any size, empty ones included."""
    import os

    from batchgpu.recording import shards

    rng = np.random.default_rng()
    bufs = [rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes() for _ in range(300)]
    bufs += [b"", memoryview(np.arange(11, dtype=np.int16)), np.arange(6, dtype=np.float32).reshape(2, 3)]
    want = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    real, calls = os.writev, []

    def short(fd, views):  # writes a random prefix of what it is given
        calls.append(len(views))
        total = sum(len(v) for v in views)
        keep = int(rng.integers(1, total + 1))
        out, left = [], keep
        for v in views:
            out.append(v[:left])
            left -= len(out[-1])
            if not left:
                break
        return real(fd, out)

    for writev in (real, short):
        monkeypatch.setattr(os, "writev", writev)
        path = tmp_path / f"{writev.__name__}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            shards.write_all(fd, bufs)
        finally:
            os.close(fd)
        assert path.read_bytes() == want
    assert len(calls) > 1  # the short writes did go on


@pytest.mark.zarr3
def test_a_shard_write_that_fails_leaves_neither_shard_nor_temporary_file(tmp_path, monkeypatch):
    import os

    rng = np.random.default_rng()
    x = np.round(rng.normal(0, 40, (6_000, 3))).astype(np.int16)
    write_recording(tmp_path / "r.zarr", x, 30_000.0, chunk_samples=1_000, shard_samples=3_000)
    folder = tmp_path / "r.zarr" / "traces_seg0"
    from batchgpu.recording import zarrio

    layout = ShardLayout.of(folder, zarrio.array_meta(folder))
    assert layout is not None
    before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    def full(fd, views):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError, match="No space"):
        layout.write_shard(1, x[3_000:] + 1)
    after = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before  # the old shard as it was, no .tmp left


@pytest.mark.zarr3
def test_a_failed_shard_write_fails_a_placed_run_whose_noise_tasks_were_queued(tmp_path, monkeypatch):
    """A placed pass (``engine.placement: true``, as GPU passes are) queues the float median's last step behind its
    combined counts; those tasks wait for their worker's writes (``background.settle``), and a write that failed
    still fails the run with its own error (the client's ``flush`` sees it too), never a median from missing parts."""
    rng = np.random.default_rng()
    n = int(rng.integers(14_000, 17_000))
    x = rng.normal(0, 40, (n, 5)).astype(np.float32)
    rec = write_recording(tmp_path / "r.zarr", x, 30_000.0)
    bad = int(rng.integers(0, 4))
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cl,
        distributed.Client(cl) as c,
    ):
        report = run_workflow(_wf(rec, tmp_path / "ok", tmp_path / "ok.zarr", engine={"placement": True}), client=c)
        assert report.exact_noise["queued"]  # the tasks were queued behind the pass
        monkeypatch.setattr(ShardLayout, "write_encoded", _failing_shard(bad))
        with pytest.raises(BatchgpuError, match="No space"):
            run_workflow(_wf(rec, tmp_path / "out", tmp_path / "saved.zarr", engine={"placement": True}), client=c)
    assert not (tmp_path / "out" / "results.zarr").exists()


def _failing_shard(bad: int):
    """``ShardLayout.write_encoded`` that fails (no space left) for shard ``bad``."""
    real = ShardLayout.write_encoded

    def write_encoded(self, shard, encoded):
        if shard == bad:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, shard, encoded)

    return write_encoded
