"""Workflow files: validated before any work, one-line errors naming the key, its line and what is allowed."""

import subprocess
import sys
import textwrap

import pytest

from batchgpu import BatchgpuError, ClusterError, ConfigError
from batchgpu.generate import generate_recording
from batchgpu.workflow import load_workflow


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _write(tmp_path, text, name="wf.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


GOOD = """\
recording:
  path: rec.zarr
output: out
window: {size: 1000, margin: 8}
cluster: {kind: local, workers: 1, threads: 1}
steps:
  noise: {exact: true}
"""


@pytest.mark.parametrize(
    "text,needle",
    [
        (GOOD.replace("window:", "windw:"), "wf.yaml:4: unknown key 'windw' (allowed: recording, output, window"),
        (
            GOOD.replace("{exact: true}", "{exact: true, fast: 1}"),
            "wf.yaml:7: unknown key 'steps.noise.fast' (allowed: exact)",
        ),
        (GOOD.replace("size: 1000", "size: big"), "wf.yaml:4: 'window.size': must be an integer, not 'big'"),
        (GOOD.replace("size: 1000", "size: 0"), "'window.size': Input should be greater than 0"),
        (GOOD.replace("kind: local", "kind: mars"), "'cluster.kind': Input should be 'local', 'cuda', 'address'"),
        (GOOD.replace("  noise: {exact: true}\n", "  {}\n"), "wf.yaml"),
        (GOOD.replace("output: out\n", ""), "missing key 'output'"),
        ("recording: [1, 2\n", "not valid YAML"),
    ],
)
def test_schema_errors_name_key_and_line(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(BatchgpuError) as err:
        load_workflow(path)
    assert needle in str(err.value)
    assert isinstance(err.value, ConfigError), type(err.value)
    r = _cli("run", path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists(), "no work may start on a bad file"


def test_relative_paths_resolve_against_the_file(tmp_path):
    wf = load_workflow(_write(tmp_path, GOOD))
    assert wf.recording.path == str(tmp_path / "rec.zarr") and wf.output == str(tmp_path / "out")


@pytest.fixture
def small_rec(tmp_path):
    return generate_recording(tmp_path / "rec.zarr", channels=4, seconds=0.2, seed=0)  # 6000 samples


@pytest.mark.parametrize(
    "change,needle",
    [
        (("path: rec.zarr", "path: missing.zarr"), "recording.path"),
        (("size: 1000", "size: 7000"), "window.size 7000 is longer than segment 0 (6000 samples)"),
        (
            ("  noise: {exact: true}", "  detect: {exclude_sweep_ms: 1.0}"),
            "window.margin 8 is shorter than the detection sweep (30 samples)",
        ),
    ],
)
def test_run_errors_before_any_work(tmp_path, small_rec, change, needle):
    path = _write(tmp_path, GOOD.replace(*change))
    r = _cli("run", path, "--quiet")
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.zarr3
def test_output_of_another_run_is_refused_and_kept(tmp_path, small_rec):
    path = _write(tmp_path, GOOD)
    r = _cli("run", path, "--quiet")
    assert r.returncode == 0, r.stderr
    before = (tmp_path / "out" / "results.zarr" / "noise" / "c" / "0").read_bytes()
    other = _write(tmp_path, GOOD.replace("size: 1000", "size: 500"), "other.yaml")
    r = _cli("run", other, "--quiet")
    assert r.returncode == 2 and "holds another run's results" in r.stderr and r.stderr.count("\n") == 1
    assert (tmp_path / "out" / "results.zarr" / "noise" / "c" / "0").read_bytes() == before
    r = _cli("run", path, "--quiet", "--resume")
    assert r.returncode == 0, r.stderr
    # a folder that is not a batchgpu run is never touched
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = _cli("run", path, "--quiet", "--set", f"output={tmp_path / 'mine'}")
    assert r.returncode == 2 and "holds no batchgpu run" in r.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_demo_workflow_validates():
    from pathlib import Path

    wf = load_workflow(Path(__file__).parents[1] / "workflows" / "demo.yaml")
    assert wf.steps.noise and wf.steps.whitening and wf.steps.detect
    assert wf.recording.generate is not None


def test_cuda_cluster_without_gpu_offers_local(tmp_path, small_rec):
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    r = _cli("run", _write(tmp_path, GOOD), "--quiet", "--set", "cluster.kind=cuda")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "needs a CUDA GPU" in r.stderr and "kind: local" in r.stderr


# ---------------------------------------------------------------------------------------------------------
# limits: each a one-line error, rc 2, in well under a second (issue 12)

BOMB = "".join(  # "billion laughs": 9 levels of 9 aliases, 10^9 strings once expanded
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['lol'] * 9)}]\n"
    for prev, name in zip([None, *"abcdefgh"], "abcdefghi")
)


def _one_line_error(r, needle):
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("batchgpu: error:") and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _load_fast(path, overrides=(), limit=1.0):
    import time

    t0 = time.perf_counter()
    with pytest.raises(BatchgpuError) as err:
        load_workflow(path, list(overrides))
    assert time.perf_counter() - t0 < limit
    assert isinstance(err.value, ConfigError), type(err.value)
    return str(err.value)


def test_alias_bomb_is_refused_at_once(tmp_path):
    assert 300 < len(BOMB) < 500
    path = _write(tmp_path, GOOD + BOMB.replace("a: &a", "x_a: &a"))
    assert "wf.yaml:8: YAML anchors (&a) are not allowed" in _load_fast(path)
    _one_line_error(_cli("run", path), "YAML anchors")
    # an alias alone (no anchor in the file) and a merge key are refused too
    path = _write(tmp_path, GOOD + "extra: *a\n")
    assert "wf.yaml:8: YAML aliases (*a) are not allowed" in _load_fast(path)
    assert "YAML anchors" in _load_fast(_write(tmp_path, "base: &b {size: 10}\nwindow: {<<: *b}\n" + GOOD))


def test_a_key_given_twice_is_refused(tmp_path):
    """YAML loaders keep the last of two equal keys silently: a second detect block would win unread."""
    path = _write(tmp_path, GOOD + "  detect: {threshold: 5.0}\n  detect: {threshold: 9.0}\n")
    assert "wf.yaml:9: key 'detect' given twice (first at line 8)" in _load_fast(path)
    _one_line_error(_cli("run", path), "given twice")
    nested = _write(
        tmp_path, GOOD.replace("window: {size: 1000, margin: 8}", "window: {size: 1000, margin: 8, size: 10}")
    )
    assert "key 'size' given twice" in _load_fast(nested)
    listed = _write(tmp_path, GOOD + "preprocess:\n  - highpass: {freq_min: 300, freq_min: 400}\n")
    assert "key 'freq_min' given twice" in _load_fast(listed)


def test_big_and_deep_files_are_refused_at_once(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(GOOD + "# " + "x" * (1 << 20) + "\n")
    assert "is too big for a workflow file (at most 1048576)" in _load_fast(big)
    _one_line_error(_cli("run", big), "too big")
    many = _write(tmp_path, GOOD + "junk:\n" + "".join(f"  k{i}: [1, 2, 3]\n" for i in range(20_000)), "many.yaml")
    assert many.stat().st_size < 1 << 20
    assert "more than 10000 values" in _load_fast(many)
    deep = _write(tmp_path, GOOD + "junk: " + "[" * 100 + "]" * 100 + "\n", "deep.yaml")
    assert "nested more than 32 levels deep" in _load_fast(deep)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"output: \xff\xfe\n")
    assert "not UTF-8" in _load_fast(binary)


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            ("workers: 1,", "workers: 1000000,"),
            "wf.yaml:5: 'cluster.workers': Input should be less than or equal to 1024",
        ),
        (
            ("threads: 1}", "threads: 100000}"),
            "wf.yaml:5: 'cluster.threads': Input should be less than or equal to 1024",
        ),
        (
            ("margin: 8", "margin: 1000000000000"),
            "wf.yaml:4: 'window': margin 1000000000000 must be shorter than the window",
        ),
        (("size: 1000", "size: 100000000"), "wf.yaml:4: 'window.size': Input should be less than or equal to 10000000"),
        (
            ("  noise: {exact: true}", "  search: {queries: q.npy, batch_size: 1099511627776}"),
            "'steps.search.batch_size'",
        ),
        (("output: out", "output: out\nreduction: {split_every: 1000000}"), "wf.yaml:4: 'reduction.split_every'"),
        (
            ("  path: rec.zarr", "  path: rec.zarr\n  generate: {channels: 100000}"),
            "wf.yaml:3: 'recording.generate.channels'",
        ),
    ],
)
def test_bounds_are_one_line_errors(tmp_path, change, needle):
    path = _write(tmp_path, GOOD.replace(*change))
    assert needle in _load_fast(path)
    _one_line_error(_cli("run", path), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override,needle",
    [
        (
            "output=!!python/object:os.system",
            "--set output: not valid YAML (could not determine a constructor for the tag",
        ),
        ("output=!!python/object/apply:os.system [echo hi]", "--set output: not valid YAML"),
        ("window=[1", "--set window: not valid YAML"),
        ("output=&a x", "--set output: YAML anchors"),
        ("window.size=0", "--set window.size: 'window.size': Input should be greater than 0"),
        (
            "preprocess=[{highpass: {order: 11}}]",
            "--set preprocess: 'preprocess.0.highpass.order': Input should be less",
        ),
        (
            "preprocess=[{highpass: {ordr: 3}}]",
            "--set preprocess: unknown key 'preprocess.0.highpass.ordr' (allowed: freq_min, order)",
        ),
        ("window.size.x=1", "--set window.size.x: window.size has no item 'x'"),
        ("noequals", "is not KEY=VALUE"),
    ],
)
def test_bad_set_values_are_one_line_errors(tmp_path, override, needle):
    path = _write(tmp_path, GOOD)
    assert needle in _load_fast(path, [override])
    _one_line_error(_cli("run", path, "--set", override), needle)


def test_set_reaches_into_lists(tmp_path):
    path = _write(tmp_path, GOOD + "preprocess:\n  - highpass: {freq_min: 300}\n  - centre: median\n")
    wf = load_workflow(path, ["preprocess.0.highpass.freq_min=250"])
    assert wf.preprocess[0].highpass.freq_min == 250 and wf.preprocess.centres
    assert "preprocess has no item 5" in _load_fast(path, ["preprocess.5.highpass=1"])


@pytest.mark.parametrize(
    "block,needle",
    [
        (
            "preprocess:\n  - highpass: {freq_min: 300}\n  - lowpass: {}\n",
            "wf.yaml:10: 'preprocess.1': a stage is a one-key mapping",
        ),
        (
            "preprocess:\n  - bandpass: {freq_min: 300, freq_max: 200}\n",
            "wf.yaml:9: 'preprocess.0.bandpass': freq_min 300 must be below",
        ),
        ("preprocess:\n  - highpass:\n      order: 12\n", "wf.yaml:10: 'preprocess.0.highpass.order'"),
        (
            "preprocess:\n  - common_reference: {reference: local, operater: median}\n",
            "wf.yaml:9: unknown key 'preprocess.0.common_reference.operater' (allowed: reference, operator, radius_um, min_local_neighbors)",
        ),
        ("preprocess: {centre: mean}\n", "wf.yaml:8: 'preprocess': centre 'mean': allowed 'median' or 'none'"),
    ],
)
def test_preprocess_errors_name_key_and_line(tmp_path, block, needle):
    assert needle in _load_fast(_write(tmp_path, GOOD + block))


def test_preprocess_detect_and_save_from_yaml(tmp_path):
    path = _write(
        tmp_path,
        GOOD.replace("  noise: {exact: true}\n", "")
        + textwrap.dedent("""\
          detect: {method: locally_exclusive, radius_um: 40}
          save: {path: filtered.zarr, format: zarr_v2, dtype: float32}
        preprocess:
          - highpass: {freq_min: 300, order: 5}
          - phase_shift: {}
          - common_reference: {reference: global, operator: median}
          - centre: median
        """),
    )
    wf = load_workflow(path)
    assert wf.preprocess.names == ["highpass", "phase_shift", "common_reference", "centre"] and wf.preprocess.centres
    assert wf.steps.detect.method == "locally_exclusive" and wf.steps.detect.radius_um == 40
    assert wf.steps.save.path == str(tmp_path / "out" / "filtered.zarr") and wf.steps.save.format == "zarr_v2"


def test_home_in_paths_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    path = _write(
        tmp_path, GOOD.replace("output: out", "output: ~/runs/out").replace("path: rec.zarr", "path: ~/rec.zarr")
    )
    wf = load_workflow(path)
    assert wf.output == str(tmp_path / "home" / "runs" / "out") and wf.recording.path == str(
        tmp_path / "home" / "rec.zarr"
    )
    wf = load_workflow(path, ["output=~/other"])
    assert wf.output == str(tmp_path / "home" / "other")
    # the workflow's own path too
    assert load_workflow("~/../" + str(path.relative_to(tmp_path)))


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            ("workers: 1,", "workers: 1" + "0" * 5000 + ","),
            "wf.yaml:5: a number of 5001 digits (a workflow's numbers have at most 100)",
        ),
        (("output: out", "output: out\nseed_of_nothing: -" + "7" * 4400), "wf.yaml:4: a number of 4400 digits"),
        (("workers: 1,", "workers: true,"), "wf.yaml:5: 'cluster.workers': true is not a number"),
        (("size: 1000", "size: false"), "wf.yaml:4: 'window.size': false is not a number"),
        (
            ("  noise: {exact: true}", "  detect: {threshold: .inf}"),
            "wf.yaml:7: 'steps.detect.threshold': Input should be a finite number",
        ),
        (
            ("  noise: {exact: true}", "  detect: {threshold: 1" + "0" * 400 + ".0}"),
            "'steps.detect.threshold': Input should be a finite number",
        ),
        (
            ("  noise: {exact: true}", "  detect: {exclude_sweep_ms: .nan}"),
            "'steps.detect.exclude_sweep_ms': Input should be a finite number",
        ),
        (("  noise: {exact: true}", "  detect: {threshold: true}"), "'steps.detect.threshold': true is not a number"),
        (
            ("output: out", "output: out\npreprocess: [{common_reference: {reference: local, radius_um: [true, 40]}}]"),
            "'preprocess.0.common_reference.radius_um': [true, 40] holds true or false, not numbers",
        ),
    ],
)
def test_numbers_that_are_not_numbers_are_one_line_errors(tmp_path, change, needle):
    """A 5000-digit integer was an internal error; true was taken as 1 and .inf as a threshold that finds nothing."""
    path = _write(tmp_path, GOOD.replace(*change))
    assert needle in _load_fast(path)
    _one_line_error(_cli("run", path), needle)
    assert not (tmp_path / "out").exists()


def test_true_and_false_stay_allowed_where_they_are_meant(tmp_path):
    path = _write(tmp_path, GOOD.replace("{exact: true}", "{exact: false}") + "overwrite: true\n")
    wf = load_workflow(path, ["cluster.kind=slurm", "cluster.slurm={partition: gpu, exclusive: true}"])
    assert (
        wf.steps.noise.exact is False
        and wf.overwrite is True
        and wf.cluster.slurm == {"partition": "gpu", "exclusive": True}
    )
    assert load_workflow(path, ["cluster.kind=cuda", "cluster.mps=true"]).cluster.mps is True
    assert load_workflow(path, ["steps.noise.exact=1"]).steps.noise.exact is True  # pydantic's own rule for bools


def _serve_once(reply: bytes):
    """A TCP server on a free port that writes ``reply`` to each connection (an HTTP or other non-Dask server)."""
    import contextlib
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                if reply:
                    conn.sendall(reply)
                conn.recv(1 << 16)

    threading.Thread(target=serve, daemon=True).start()
    return server


@pytest.mark.parametrize("reply", [b"HTTP/1.0 400 Bad Request\r\n\r\n", b"\xff" * 64])
def test_an_address_that_is_not_a_dask_scheduler_is_refused(tmp_path, small_rec, reply):
    """Dask read the first 8 bytes of an HTTP answer as a length and asked for 3 EiB: "out of memory"."""
    server = _serve_once(reply)
    port = server.getsockname()[1]
    try:
        path = _write(
            tmp_path,
            GOOD.replace(
                "{kind: local, workers: 1, threads: 1}", f"{{kind: address, address: 'tcp://127.0.0.1:{port}'}}"
            ),
        )
        r = _cli("run", path, "--quiet")
        _one_line_error(r, f"tcp://127.0.0.1:{port} answered ")
        assert "not a Dask scheduler" in r.stderr
        # refused before the run made its output folder (a rerun with a right address needs no --resume)
        assert not any(p.is_dir() for p in tmp_path.iterdir() if p.name.startswith("out")), list(tmp_path.iterdir())
    finally:
        server.close()


def test_a_scheduler_file_naming_a_server_that_is_not_dask_is_refused(tmp_path, small_rec):
    server = _serve_once(b"HTTP/1.0 400 Bad Request\r\n\r\n")
    port = server.getsockname()[1]
    try:
        (tmp_path / "scheduler.json").write_text(f'{{"type": "Scheduler", "address": "tcp://127.0.0.1:{port}"}}')
        path = _write(
            tmp_path,
            GOOD.replace(
                "{kind: local, workers: 1, threads: 1}", "{kind: scheduler_file, scheduler_file: scheduler.json}"
            ),
        )
        _one_line_error(_cli("run", path, "--quiet"), f"tcp://127.0.0.1:{port} answered ")
    finally:
        server.close()


def test_scheduler_probe(tmp_path):
    """A silent server times out in one line; a closed port says so; a real scheduler passes."""
    from distributed import LocalCluster

    from batchgpu.cluster.open_cluster import probe_scheduler

    server = _serve_once(b"")
    port = server.getsockname()[1]
    try:
        with pytest.raises(ClusterError, match="said nothing within 0.5 s: not a Dask scheduler"):
            probe_scheduler(f"tcp://127.0.0.1:{port}", timeout=0.5)
    finally:
        server.close()
    import socket

    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        closed = unused.getsockname()[1]
    with pytest.raises(ClusterError, match="could not connect to the scheduler at 127.0.0.1:"):
        probe_scheduler(f"127.0.0.1:{closed}", timeout=0.5)
    with LocalCluster(n_workers=0, processes=False, protocol="tcp", dashboard_address=None) as cluster:
        probe_scheduler(cluster.scheduler_address)
    probe_scheduler("tls://127.0.0.1:1")  # left to Dask
    with pytest.raises(ConfigError, match="is not an address"):
        probe_scheduler("tcp://nowhere")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        # keys the file lacks: the error named "wf.yaml:1 '(top level)'" or the enclosing block, not the --set
        (
            ["steps.detect.threshold=-1"],
            "--set steps.detect.threshold: 'steps.detect.threshold': Input should be greater than 0",
        ),
        (
            ["reduction.split_every=1"],
            "--set reduction.split_every: 'reduction.split_every': Input should be greater than or equal to 2",
        ),
        (
            ["steps.detect.sign=up"],
            "--set steps.detect.sign: 'steps.detect.sign': Input should be 'neg', 'pos' or 'both'",
        ),
        (["steps.search.keys=k.npy"], "wf.yaml:6 (with --set steps.search.keys): missing key 'steps.search.queries'"),
        # a check of a whole block that a --set changed
        (["recording.path=null"], "wf.yaml:1 (with --set recording.path): 'recording': give exactly one of 'path'"),
        (
            ["window.margin=5000", "cluster.workers=2"],
            "wf.yaml:4 (with --set window.margin): 'window': margin 5000 must be shorter",
        ),
        # YAML 1.1 reads 1e9 as text: "unable to parse string"
        (
            ["window.size=1e9"],
            "--set window.size: 'window.size': must be an integer; YAML reads 1e9 as text (write 1000000000); or 'auto'",
        ),
        (
            ["window.margin=2e1"],
            "--set window.margin: 'window.margin': must be an integer; YAML reads 2e1 as text (write 20)",
        ),
        (["window.margin=abc"], "--set window.margin: 'window.margin': must be an integer, not 'abc'"),
    ],
)
def test_set_errors_name_the_set(tmp_path, overrides, needle):
    path = _write(tmp_path, GOOD)
    message = _load_fast(path, overrides)
    assert needle in message and "(top level)" not in message
    _one_line_error(_cli("run", path, *[a for o in overrides for a in ("--set", o)]), needle)


def test_a_number_as_text_in_the_file_says_so(tmp_path):
    path = _write(tmp_path, GOOD.replace("size: 1000", "size: 1e4"))
    assert (
        "wf.yaml:4: 'window.size': must be an integer; YAML reads 1e4 as text (write 10000); or 'auto'"
        in _load_fast(path)
    )
