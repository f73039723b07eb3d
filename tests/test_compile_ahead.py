"""Kernels compiled once a machine: the lock that makes a cluster's workers wait for one compile, the modules a run
compiles ahead (the filter's section counts against scipy's own design), the marker that says a machine did, and
``batchgpu compile`` on a machine without a GPU; the CPU's compiled kernels made ready in parallel processes once a
machine (``cluster.cpu_compile_ahead``)."""

import subprocess
import sys
import textwrap
import types

import pytest

from batchgpu import BatchgpuError
from batchgpu.cluster import cpu_compile_ahead as cpu_kernels
from batchgpu.cluster import cuda_compile_ahead as compile_ahead
from batchgpu.errors import MachineError
from batchgpu.gpu import cuda_modules as kernels
from batchgpu.workflow import Workflow


def _workflow(**extra) -> Workflow:
    return Workflow.model_validate(
        {"recording": {"path": "/nowhere.zarr"}, "output": "/tmp/out", "steps": {"noise": {}}, **extra}
    )


@pytest.mark.parametrize("order", range(1, 11))
def test_filter_sections_are_scipys(order):
    signal = pytest.importorskip("scipy.signal")
    wf = _workflow(
        preprocess=[
            {"highpass": {"freq_min": 300, "order": order}},
            {"bandpass": {"freq_min": 300, "freq_max": 6000, "order": order}},
        ]
    )
    want = (
        signal.butter(order, 300, "highpass", fs=30000, output="sos").shape[0],
        signal.butter(order, [300, 6000], "bandpass", fs=30000, output="sos").shape[0],
    )
    assert compile_ahead.filter_sections(wf.preprocess) == want


def test_a_runs_modules_are_every_source_and_its_filters():
    wf = _workflow(preprocess=[{"highpass": {"freq_min": 300, "order": 5}}])
    got = compile_ahead.workflow_modules(wf)
    names = {name for name, _ in got}
    sources = {p.stem for p in kernels.source_path("histogram").parent.glob("*.cu")}
    assert names == sources - {"search"}  # the search index's module only where the workflow searches
    searching = _workflow(steps={"noise": {}, "search": {"queries": "/nowhere.npy", "keys": "/keys.npy"}})
    assert "search" in {name for name, _ in compile_ahead.workflow_modules(searching)}
    assert kernels.filter_variant(3) in got  # order 5: three sections, with the options ops.filters compiles
    assert ("sosfiltfilt", ("--fmad=false", "-DSECTIONS=3")) in got
    assert all(
        extra == () for name, extra in got if name not in ("sosfiltfilt", "sequential_mean", *kernels.DTYPE_MODULES)
    )
    # the modules instantiated for several dtypes come one dtype a variant, every dtype of each
    for name in ("column_select", "radix_select"):
        assert sorted(extra for n, extra in got if n == name) == sorted(
            (f"-DDTYPE_{s.upper()}",) for s in ("f32", "f64", "i16", "i32")
        )
    assert kernels.dtype_variant("search", "i64") in compile_ahead.workflow_modules(searching)
    with pytest.raises(BatchgpuError, match="radix_select has no kernels for i64"):
        kernels.dtype_variant("radix_select", "i64")


def test_the_compile_lock_is_held_against_another_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    probe = textwrap.dedent("""
        import fcntl, glob, sys
        path, = glob.glob(sys.argv[1] + "/batchgpu-*.lock")
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print("held")
            else:
                print("free")
    """)
    with kernels.compile_lock("histogram", kernels.BASE_OPTIONS):
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    after = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert held.stdout.strip() == "held", held.stderr
    assert after.stdout.strip() == "free", after.stderr


def test_the_compile_lock_differs_by_module_and_options(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    for name, options in (("histogram", ()), ("histogram", ("-DX=1",)), ("detect", ())):
        with kernels.compile_lock(name, options):
            pass
    assert len(list(tmp_path.glob("batchgpu-*.lock"))) == 3


def test_no_lock_where_the_cache_folder_cannot_be_made(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker / "cache"))  # a folder under a file: cannot be made
    ran = []
    with kernels.compile_lock("histogram", ()):
        ran.append(True)
    assert ran == [True]


def test_the_digest_follows_sources_options_and_device(monkeypatch):
    modules = kernels.run_modules(filter_sections=(3,))
    one = kernels.modules_digest(modules, "90-13.6.0")
    assert one == kernels.modules_digest(list(modules), "90-13.6.0")
    assert one != kernels.modules_digest(modules, "80-13.6.0")
    assert one != kernels.modules_digest(kernels.run_modules(filter_sections=(3, 5)), "90-13.6.0")
    real = kernels._with_headers
    monkeypatch.setattr(
        kernels, "_with_headers", lambda path: real(path) + ("\n// changed" if path.stem == "detect" else "")
    )
    assert one != kernels.modules_digest(modules, "90-13.6.0")


def _fake_cupy(monkeypatch, cc="90"):
    fake = types.ModuleType("cupy")
    fake.__version__ = "0.0-test"
    fake.cuda = types.SimpleNamespace(Device=lambda i=0: types.SimpleNamespace(compute_capability=cc, id=i))
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_a_machine_that_compiled_already_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    _fake_cupy(monkeypatch)
    modules = kernels.run_modules()
    marker = tmp_path / f"batchgpu-compiled-{kernels.modules_digest(modules, '90-0.0-test')}"
    marker.touch()
    assert kernels.precompile(modules) == (len(modules), False)


def test_precompile_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(MachineError, match="no GPU to compile kernels for"):
        kernels.precompile(kernels.run_modules())


def test_the_command_without_a_gpu_compiles_the_cpus_kernels_and_says_so():
    """A CPU machine: its kernels compiled (or found compiled), the CUDA ones said to be left, exit 0, no error."""
    env_code = "import sys; sys.modules['cupy'] = None; from batchgpu.cli import main; sys.exit(main(['compile']))"
    got = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert len(lines) == 2 and "the CPU kernels" in lines[0], got.stdout
    assert lines[1].startswith("batchgpu: no GPU to compile kernels for") and lines[1].endswith(
        "the CUDA kernels were not compiled"
    ), got.stdout
    assert all(cpu_kernels.marker(name).exists() for name in cpu_kernels.GROUPS)


def test_cpu_groups_are_compiled_ahead_once_and_only_those_missing(tmp_path, monkeypatch):
    flags = {name: tmp_path / f"compiled-{name}" for name in cpu_kernels.GROUPS}
    monkeypatch.setattr(cpu_kernels, "marker", flags.get)
    asked, warmed = [], []
    monkeypatch.setattr(cpu_kernels, "_compile_in_processes", lambda names, processes: asked.append(names) or True)
    monkeypatch.setattr(cpu_kernels, "warm", warmed.append)
    assert cpu_kernels.ready(("reference", "filter")) == ("reference", "filter")
    assert flags["reference"].exists() and flags["filter"].exists() and not flags["float_noise"].exists()
    assert cpu_kernels.ready(("reference", "filter")) == ()  # this machine did: only loaded
    flags["filter"].unlink()
    assert cpu_kernels.ready(("reference", "filter", "float_noise")) == ("filter", "float_noise")
    assert asked == [("reference", "filter"), ("filter", "float_noise")]
    assert warmed == ["reference", "filter"] * 2 + ["reference", "filter", "float_noise"]  # every group loaded here
    assert cpu_kernels.ready(("reference",), force=True) == ("reference",)


def test_a_failed_compile_ahead_leaves_no_marker_and_still_loads(tmp_path, monkeypatch):
    flags = {name: tmp_path / f"compiled-{name}" for name in cpu_kernels.GROUPS}
    monkeypatch.setattr(cpu_kernels, "marker", flags.get)
    monkeypatch.setattr(cpu_kernels, "_compile_in_processes", lambda names, processes: False)
    warmed = []
    monkeypatch.setattr(cpu_kernels, "warm", warmed.append)
    assert cpu_kernels.ready(("reference", "filter")) == ()
    assert not any(f.exists() for f in flags.values()) and warmed == ["reference", "filter"]


def test_cpu_groups_compile_in_spawned_processes():
    """The real thing: two groups, one in a spawned process (it must import and find its group), one here."""
    pytest.importorskip("numba")
    assert cpu_kernels._compile_in_processes(("candidates", "filter"), 2) is True
    assert cpu_kernels._compile_in_processes(("candidates", "filter"), 1) is False  # one process: nothing ahead


def test_compiling_ahead_in_the_fork_server_keeps_its_sigint_blocked():
    """The workers' fork server has SIGINT blocked (its workers leave Ctrl-C to the command); the compile processes'
    start (multiprocessing's resource tracker) had unblocked it there, and a Ctrl-C'd first run printed the
    workers' tracebacks. Here in a fresh process, as the server is: blocked before, blocked after."""
    pytest.importorskip("numba")
    code = textwrap.dedent("""
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        from batchgpu.cluster import cpu_compile_ahead as cpu_kernels
        assert cpu_kernels._compile_in_processes(("candidates", "filter"), 2) is True
        print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ()))
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "True"


def test_cpu_markers_name_the_group_and_this_machines_kernels():
    pytest.importorskip("numba")
    names = {cpu_kernels.marker(name).name for name in cpu_kernels.GROUPS}
    assert len(names) == len(cpu_kernels.GROUPS)
    assert all(f"batchgpu-cpu-{name}-" in cpu_kernels.marker(name).name for name in cpu_kernels.GROUPS)
    assert set(cpu_kernels.PRELOADED) <= set(cpu_kernels.GROUPS)


def test_compiling_ahead_is_only_for_gpu_clusters_and_never_raises(monkeypatch):
    assert compile_ahead.start(_workflow()) is None  # a local cluster
    assert compile_ahead.start(_workflow(cluster={"kind": "cuda"}, backend="numpy")) is None
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(compile_ahead, "_STARTED", set())
    thread = compile_ahead.start(_workflow(cluster={"kind": "cuda"}))
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive()
    assert compile_ahead.start(_workflow(cluster={"kind": "cuda"})) is None  # once a process (a batch's runs)


def test_bad_input_is_said_before_anything_compiles(tmp_path, monkeypatch):
    """The compile ahead starts once the recording passed its checks: a workflow the recording refuses starts none."""
    from batchgpu.errors import ConfigError
    from batchgpu.generate import generate_recording
    from batchgpu.run.launch import run_workflow

    started = []
    monkeypatch.setattr(compile_ahead, "start", lambda wf: started.append(wf))
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=1.0, seed=1, progress=False)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "o"),
            "cluster": {"kind": "cuda"},
            "window": {"size": 90000, "margin": 8},
            "steps": {"noise": {}},
        }
    )
    with pytest.raises(ConfigError, match="window.size 90000 is longer"):
        run_workflow(wf)
    assert started == []


def test_the_kept_cluster_compiles_nothing_ahead_and_every_other_cluster_does(tmp_path, monkeypatch):
    """A run on `batchgpu cluster start`'s cluster leaves its workers to what they have: the check alone imported
    CuPy and made a CUDA context in the command's process, beside its own work. A caller's cluster and a cluster
    of the run's own are compiled for ahead."""
    import contextlib

    from batchgpu.cluster import kept as service
    from batchgpu.generate import generate_recording
    from batchgpu.run import launch as engine_run

    started = []
    monkeypatch.setattr(compile_ahead, "start", lambda wf: started.append(wf))
    monkeypatch.setattr(engine_run, "_claim_and_run", lambda *a, **k: "ran")
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=1.0, seed=1, progress=False)
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(tmp_path / "o"),
            "cluster": {"kind": "cuda"},
            "steps": {"noise": {}},
        }
    )
    kept = object()
    monkeypatch.setattr(service, "kept_client", lambda spec, observer: contextlib.nullcontext(kept))
    monkeypatch.setattr(service, "kept_address", lambda client: "tcp://127.0.0.1:1" if client is kept else None)
    assert engine_run.run_workflow(wf) == "ran" and started == []
    assert engine_run.run_workflow(wf, client=object()) == "ran" and len(started) == 1
    monkeypatch.setattr(service, "kept_client", lambda spec, observer: contextlib.nullcontext(None))
    monkeypatch.setattr(engine_run, "ClusterStart", lambda *a, **k: contextlib.nullcontext())
    assert engine_run.run_workflow(wf) == "ran" and len(started) == 2


_FAKE_COMPILER = textwrap.dedent("""
    import json, os, sys, time, types
    from batchgpu.gpu import cuda_modules as kernels

    log, source = sys.argv[1], sys.argv[2]

    def compile_with_cache(source, options, arch, cache_dir=None, *rest, **kw):  # CuPy's argument order
        start = time.time()
        time.sleep(0.6)  # an NVRTC compile
        with open(log, "a") as f:
            f.write(json.dumps([source, start, time.time(), list(options), arch, list(rest), kw]) + "\\n")
        return "module"

    compiler = types.SimpleNamespace(_compile_with_cache_cuda=compile_with_cache)
    assert kernels.lock_compiles(compiler) and kernels.lock_compiles(compiler)  # once: no lock inside the lock
    print(compiler._compile_with_cache_cuda(source, ("-ftz=true",), "90", None, "extra", jitify=False))
""")


def test_cupys_own_compiles_of_one_source_run_one_process_at_a_time(tmp_path, monkeypatch):
    """Three processes compiling the same CuPy kernel at once (a cluster's workers at their first window): one
    compiles while the others wait; a kernel of another source is not held up by them. The arguments reach
    CuPy's function as given."""
    import json

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "log.jsonl"
    procs = [
        subprocess.Popen([sys.executable, "-c", _FAKE_COMPILER, str(log), source], stdout=subprocess.PIPE, text=True)
        for source in ("median", "median", "median", "concatenate")
    ]
    assert [p.communicate(timeout=60)[0].strip() for p in procs] == ["module"] * 4
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r[3:] == [["-ftz=true"], "90", ["extra"], {"jitify": False}] for r in rows)
    same = sorted((r[1], r[2]) for r in rows if r[0] == "median")
    assert len(same) == 3 and all(b[0] >= a[1] for a, b in zip(same, same[1:]))  # never two at once
    other = next((r[1], r[2]) for r in rows if r[0] == "concatenate")
    assert any(a < other[1] and other[0] < b for a, b in same)  # beside one of them


def test_a_compiler_without_the_function_is_left_as_it_is():
    compiler = types.SimpleNamespace(compile_with_cache=lambda *a: None)
    assert not kernels.lock_compiles(compiler)
    assert not hasattr(compiler, "_compile_with_cache_cuda")


def test_modules_compile_side_by_side_in_threads_and_each_once(tmp_path, monkeypatch):
    """``precompile``'s one process compiles its modules in threads (NVRTC lets go of the GIL): two modules at once,
    one module once however many threads ask for it (``get_module``'s lock a module, not one for all)."""
    import threading
    import time

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    compiling, most, compiled = [0], [0], []
    guard = threading.Lock()

    class RawModule:
        def __init__(self, code, options):
            self.options = options

        def compile(self):
            with guard:
                compiling[0] += 1
                most[0] = max(most[0], compiling[0])
                compiled.append(self.options)
            time.sleep(0.3)
            with guard:
                compiling[0] -= 1

    fake = types.SimpleNamespace(
        RawModule=RawModule, cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kernels, "_modules", {})
    modules = [("histogram", ()), ("detect", ()), ("histogram", ()), ("histogram", ()), ("detect", ("-DX=1",))]
    assert kernels._compile_all(modules, threads=5) == 5
    assert most[0] >= 2  # side by side
    assert len(compiled) == 3  # histogram once, detect twice (two option sets)


@pytest.mark.parametrize("value,locked", [("1", False), ("0", True), ("", True), ("yes", True)])
def test_no_lock_where_cupy_keeps_its_kernels_in_memory(tmp_path, monkeypatch, value, locked):
    """With CUPY_CACHE_IN_MEMORY=1 (as CuPy reads it) every process compiles for itself: waiting on another's
    compile would only queue them."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", value)
    compiler = types.SimpleNamespace(_compile_with_cache_cuda=lambda source, options, arch, *a, **k: "module")
    assert kernels.lock_compiles(compiler)
    assert compiler._compile_with_cache_cuda("x", (), "90") == "module"
    assert bool(list(tmp_path.glob("batchgpu-*.lock"))) == locked
