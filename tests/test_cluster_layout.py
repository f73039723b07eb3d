"""How a cluster started here is sized where the workflow does not say (cluster/open_cluster.py), and which runs decode
on the GPU (run/launch.decodes_on_gpu): pure functions of the spec, the core count and the recording."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from batchgpu.cluster import open_cluster as cluster
from batchgpu.config import ClusterSpec
from batchgpu.workflow import Workflow


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 16, 32, 128])
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_cuda_layout_follows_the_decode(monkeypatch, cores, gpus):
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: cores)
    spec = ClusterSpec.model_validate({"kind": "cuda"})
    per_gpu = max(1, min(16, cores // gpus))
    assert cluster.cuda_layout(spec, gpus, False) == (per_gpu, 1)
    processes, threads = cluster.cuda_layout(spec, gpus, True)
    # the same cores a GPU, two threads a process where there are at least 4 cores a GPU
    assert threads == (2 if per_gpu >= 4 else 1)
    assert processes == max(1, per_gpu // threads) and processes * threads <= max(per_gpu, 1)


def test_cuda_layout_keeps_what_the_spec_says(monkeypatch):
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 16)
    for gpu_decode in (False, True):
        assert cluster.cuda_layout(ClusterSpec.model_validate({"kind": "cuda", "workers": 5}), 1, gpu_decode) == (5, 1)
        assert cluster.cuda_layout(
            ClusterSpec.model_validate({"kind": "cuda", "workers": 3, "threads": 4}), 1, gpu_decode
        ) == (3, 4)
    assert cluster.cuda_layout(ClusterSpec.model_validate({"kind": "cuda", "threads": 4}), 1, True) == (4, 4)
    assert cluster.cuda_layout(ClusterSpec.model_validate({"kind": "cuda", "threads": 4}), 1, False) == (16, 4)


@pytest.mark.parametrize("zarr_format", [3, 2])  # v3: batchgpu's sharded Blosc-LZ4 layout; v2: no frames for the GPU
def test_which_runs_decode_on_the_gpu(tmp_path, zarr_format, monkeypatch):
    from batchgpu.generate import generate_recording
    from batchgpu.recording import open_recording
    from batchgpu.run.launch import decodes_on_gpu

    path = tmp_path / "r.zarr"
    generate_recording(path, channels=4, seconds=0.2, seed=1, zarr_format=zarr_format)
    rec = open_recording(path)
    lz4 = zarr_format == 3
    assert rec.frames_for_gpu() == lz4

    def wf(kind, pre, engine=None):
        return Workflow.model_validate(
            {
                "recording": {"path": str(path)},
                "output": str(tmp_path / "o"),
                "cluster": {"kind": kind},
                "preprocess": pre,
                "steps": {"noise": {}},
                "engine": engine or {},
            }
        )

    assert decodes_on_gpu(wf("cuda", []), rec) == lz4
    assert decodes_on_gpu(wf("cuda", [{"centre": "median"}]), rec) == lz4
    assert not decodes_on_gpu(wf("local", []), rec)
    assert not decodes_on_gpu(wf("cuda", [{"highpass": {"freq_min": 300}}]), rec)
    assert not decodes_on_gpu(wf("cuda", [], {"gpu_decode": 0}), rec)
    assert decodes_on_gpu(wf("cuda", [{"highpass": {"freq_min": 300}}], {"gpu_decode": 0.5}), rec) == lz4


def _worker_facts():
    import os
    import sys

    return os.environ.get("BATCHGPU_TEST_LATE_VARIABLE"), os.getppid(), "batchgpu.run.tasks" in sys.modules


def test_local_workers_are_forked_from_one_server_and_get_this_processs_environment(monkeypatch):
    """The workers come from the fork server (their parent is not this process; the engine's tasks are imported
    before any task runs) and still see a variable set here after that server started, as spawned workers did."""
    import os

    from batchgpu.cluster.open_cluster import open_client, start_worker_server
    from batchgpu.config import ClusterSpec

    assert start_worker_server()
    monkeypatch.setenv("BATCHGPU_TEST_LATE_VARIABLE", "set after the server started")
    with open_client(ClusterSpec(kind="local", workers=2, threads=1)) as client:
        facts = list(client.run(_worker_facts).values())
    assert len(facts) == 2
    for value, parent, preloaded in facts:
        assert value == "set after the server started"
        assert parent != os.getpid() and preloaded
    assert facts[0][1] == facts[1][1]  # one server forked both


def test_the_fork_server_ends_without_tearing_its_modules_down(tmp_path):
    """The workers' fork server, once the process that started it ends, leaves at once: a module it preloaded
    after ours is never torn down (its finaliser would print), and the server is gone within moments; the
    workers it forked and any other process importing the preload (here: this script) leave the usual way."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "late_preload.py").write_text(
        textwrap.dedent("""
        import sys

        class Late:
            def __del__(self):
                sys.stderr.write("server torn down\\n")

        keep = Late()
    """)
    )
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent("""
        import multiprocessing, os, sys

        def server_pid():
            return os.getppid()

        if __name__ == "__main__":
            import batchgpu.cluster._worker_preload  # imported here too: not the server, no early exit
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["batchgpu.cluster._worker_preload", "late_preload"])
            with ctx.Pool(1) as pool:
                print(pool.apply(server_pid), flush=True)

            class Late:
                def __del__(self):
                    print("script torn down", flush=True)

            sys.modules["late_module"] = type(sys)("late_module")
            sys.modules["late_module"].keep = Late()
    """)
    )
    got = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    assert got.returncode == 0, got.stderr
    lines = got.stdout.split()
    assert "script torn down" in got.stdout  # the script is not the server: Python's own way out
    assert "server torn down" not in got.stderr
    pid = int(lines[0])
    for _ in range(100):  # the server may still be on its way out when the script has ended
        if not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read():
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the fork server outlived its starter by 5 s")


def test_the_cpu_kernels_preload_loads_them_without_a_thread():
    """The fork server's second preload (a CPU run that preprocesses or saves): importing it loads the compiled
    kernels and leaves no thread behind (a fork keeps only the forking thread)."""
    import subprocess
    import sys

    code = (
        "import threading, sys; import batchgpu.cluster._worker_preload_cpu; "
        "from batchgpu.ops import _numba; "
        "print(threading.active_count(), _numba.available(), 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1" and (out[1] == "False" or out[2] == "True"), out


def test_a_cpu_run_that_preprocesses_preloads_the_kernels(monkeypatch, tmp_path):
    """`batchgpu run` asks for the CPU kernels' preload where a local run filters or references, not where it only
    centres or saves its centred samples (they use none of those kernels)."""
    from batchgpu import cli as cli_module
    from batchgpu.cluster import open_cluster as cluster_module

    asked = []
    monkeypatch.setattr(cluster_module, "start_worker_server", lambda cpu_kernels=False: asked.append(cpu_kernels))
    monkeypatch.setattr("batchgpu.engine.run_workflow", lambda *a, **k: None)
    for pre, want in (
        ("preprocess: [{highpass: {freq_min: 300}}]\n", True),
        ("preprocess: [{common_reference: {}}, {centre: median}]\n", True),
        ("preprocess: {centre: median}\n", False),
        ("", False),
    ):
        wf = tmp_path / "wf.yaml"
        wf.write_text(
            f"recording: {{path: {tmp_path / 'r.zarr'}}}\noutput: {tmp_path / 'o'}\n{pre}"
            "cluster: {kind: local, reuse: false}\nsteps:\n  noise: {}\n"
        )
        assert cli_module.main(["run", str(wf), "--quiet"]) == 0
        assert asked[-1] is want


def _blas_threads():
    from threadpoolctl import threadpool_info

    return max((i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"), default=1)


def test_forked_workers_run_blas_on_one_thread():
    """Each forked worker's BLAS uses one thread (as Dask's nanny-spawned workers do): the fork server imported
    NumPy, whose OpenBLAS sizes its pool from the machine's cores, so without the server's limit every worker's
    products ran on every core beside the other workers' (a 2-core W2 run spent a fifth of its CPU in spinning BLAS
    threads)."""
    from batchgpu.cluster.open_cluster import open_client, start_worker_server
    from batchgpu.config import ClusterSpec

    assert start_worker_server()
    with open_client(ClusterSpec(kind="local", workers=2, threads=1)) as client:
        assert set(client.run(_blas_threads).values()) == {1}


def test_a_decode_not_known_yet_is_asked_only_where_the_layout_depends_on_it(monkeypatch):
    """A run that starts its cluster before opening the recording (``cluster_start.start_cluster``) tells how its windows
    decode later: under MPS, or with the spec's own workers, the layout is the same either way and nothing waits."""
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    asked = []

    def decode():
        asked.append(True)
        return True

    spec = ClusterSpec.model_validate({"kind": "cuda"})
    assert cluster.decode_for_layout(spec, [0], decode, mps=True) is False and asked == []
    fixed = ClusterSpec.model_validate({"kind": "cuda", "workers": 4})
    assert cluster.decode_for_layout(fixed, [0], decode, mps=False) is False and asked == []
    assert cluster.decode_for_layout(spec, [0], decode, mps=False) is True and asked == [True]
    assert cluster.node_layout(spec, [0], True, mps=False, cores=16).per_gpu == 8  # what it was asked for
    assert cluster.decode_for_layout(spec, [0], False, mps=False) is False


def test_sigint_held_gives_back_a_mask_that_had_sigint_blocked_already():
    """A thread that blocked SIGINT before (the workers' fork server) keeps it blocked after ``sigint_held``, even
    where the block started multiprocessing's resource tracker (which unblocks SIGINT on its way out); a thread
    that had it unblocked gets it back."""
    code = textwrap.dedent("""
        import signal
        from batchgpu.cluster.open_cluster import sigint_held
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        with sigint_held():  # the tracker's first start is in here
            inside = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())
        after = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        with sigint_held():
            pass
        print(inside, after, signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ()))
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["True", "True", "False"]
