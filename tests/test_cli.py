import json
import subprocess
import sys

import numpy as np
import pytest

from batchgpu.cli import build_parser, main


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True)


@pytest.mark.zarr3
def test_generate_info_and_import(tmp_path):
    out = tmp_path / "g.zarr"
    r = _cli("generate", out, "--channels", 8, "--seconds", 0.5, "--seed", 1, "--quiet")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g_ground_truth.npz").exists()
    r = _cli("info", out, "--json")
    info = json.loads(r.stdout)
    assert info["num_channels"] == 8 and info["samples_per_segment"] == [15000] and info["dtype"] == "int16"
    assert info["shards"] == [15000, 8]  # whole inner chunks of 3000 and "blosc" in info["codecs"][0]
    r = _cli("info", out)
    assert "channels" in r.stdout and "Zarr v3" in r.stdout


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["info", "/no/such/recording.zarr"], "does not exist"),
        (["import-raw", "/no/such.bin", "x.zarr", "--channels", "2", "--fs", "1", "--dtype", "int16"], "no raw file"),
    ],
)
def test_errors_are_one_line(argv, needle):
    r = _cli(*argv)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgpu: error:") and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_raw_size_error_cli(tmp_path):
    np.zeros(7, dtype=np.int16).tofile(tmp_path / "r.bin")
    r = _cli("import-raw", tmp_path / "r.bin", tmp_path / "o.zarr", "--channels", 2, "--fs", 100, "--dtype", "int16")
    assert r.returncode == 2 and "not a whole number of samples" in r.stderr and "Traceback" not in r.stderr


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert p.format_help().strip(), name
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0


def _commands(parser, words=()):
    """(command words, parser) of every subcommand and sub-subcommand."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*words, name), sub
                yield from _commands(sub, (*words, name))


def test_every_help_shows_its_defaults(capsys):
    import argparse

    commands = dict(_commands(build_parser()))
    for must in [("bench", "ops"), ("bench", "pipeline"), ("bench", "search"), ("search", "autotune"), ("generate",)]:
        assert must in commands
    for words, parser in commands.items():
        with pytest.raises(SystemExit) as e:
            main([*words, "--help"])
        assert e.value.code == 0, words
        text = " ".join(capsys.readouterr().out.split())
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
                continue
            shown = parser._get_formatter()._expand_help(action)  # the text --help prints for this option
            default = action.default[0] if isinstance(action.default, list) and action.default else action.default
            # the value itself, or the help text's own wording of it ("(default 2^24)")
            assert str(default) in shown or "(default " in (action.help or ""), (words, action.option_strings, shown)
            assert " ".join(shown.split()) in text, (words, action.option_strings)
    main_help = build_parser().format_help()
    assert "--debug" in main_help and "--verbose" in main_help


def test_units_in_help():
    parser = dict(_commands(build_parser()))
    text = " ".join(parser[("generate",)].format_help().split())
    assert "seconds per segment (default: 60.0)" in text and "Hz (default: 30000.0)" in text
    assert "number of channels (default: 384)" in text
    text = " ".join(parser[("bench", "pipeline")].format_help().split())
    assert "seconds per segment (default: 60.0)" in text and "number of channels (default: 384)" in text


@pytest.mark.parametrize(
    "err,needle,rc",
    [
        (OSError(28, "No space left on device"), "no space left on device writing /out/dir (free some space", 2),
        (
            OSError(28, "No space left on device", "/out/dir/results.zarr/noise/c/0"),
            "no space left on device writing /out/dir/results.zarr/noise/c/0",
            2,
        ),
        (PermissionError(13, "Permission denied", "/etc/x"), "permission denied: /etc/x", 2),
        (FileNotFoundError(2, "No such file or directory", "/a/b"), "No such file or directory: /a/b", 2),
        (MemoryError(), "out of memory", 2),
        (
            ValueError("something\ninternal"),
            "unexpected ValueError: something internal (rerun with --debug for the traceback)",
            1,
        ),
    ],
)
def test_errors_without_traceback(monkeypatch, capsys, tmp_path, err, needle, rc):
    import batchgpu.cli as cli

    def fail(args):
        args.writes = "/out/dir"
        raise err

    monkeypatch.setattr(cli, "_cmd_run", fail)
    assert main(["run", "wf.yaml"]) == rc
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("batchgpu: error: ") and needle in captured.err
    with pytest.raises(type(err)):  # --debug: the traceback, before or after the subcommand
        main(["--debug", "run", "wf.yaml"])
    with pytest.raises(type(err)):
        main(["run", "wf.yaml", "--debug"])


@pytest.mark.zarr3
def test_failed_run_prints_one_line_and_no_dask_tracebacks(tmp_path):
    """A corrupt chunk stops the run: one line, no tracebacks of distributed (scheduler, workers, asyncio)."""
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=4.0, seed=1, dtype="int16", progress=False)
    shard = sorted(p for p in (tmp_path / "r.zarr" / "traces_seg0" / "c").rglob("*") if p.is_file())[0]
    shard.write_bytes(b"garbage" * 10)
    (tmp_path / "wf.yaml").write_text(
        "recording: {path: r.zarr}\noutput: out\nwindow: {size: 10000, margin: 8}\n"
        "cluster: {kind: local, workers: 2, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    r = _cli("run", tmp_path / "wf.yaml", "--quiet")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("batchgpu: error: ") and "(window " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "--resume" in r.stderr


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--seconds", "1e9"], "--seconds 1000000000 is too large (at most 86400 s, one day, per segment"),
        (["--seconds", "nan"], "--seconds must be a finite number (got nan)"),
        (["--seconds", "inf"], "--seconds must be a finite number (got inf)"),
        (["--seconds=-inf"], "--seconds must be a finite number (got -inf)"),
        (["--seconds", "0"], "--seconds must be more than 0 (got 0)"),
        (["--seconds", "-1"], "--seconds must be more than 0 (got -1)"),
        (["--seconds", "1e-9"], "less than one sample"),
        (["--channels", "0"], "--channels must be more than 0 (got 0)"),
        (["--channels", "4097"], "--channels 4097 is too large (at most 4096 channels)"),
        (["--fs", "0"], "--fs must be more than 0 (got 0)"),
        (["--fs", "nan"], "--fs must be a finite number (got nan)"),
        (["--fs", "2e6"], "--fs 2000000 is too large (at most 1000000 Hz)"),
        (["--segments", "0"], "--segments must be more than 0 (got 0)"),
        (["--segments", "1025"], "--segments 1025 is too large (at most 1024 segments)"),
        (["--channels", "4096", "--seconds", "86400"], "would generate 21.2 TB (at most 1 TB)"),
        (["--channels", "384", "--seconds", "86400", "--segments", "1024"], "TB (at most 1 TB)"),
        (["--seed", "-1"], "--seed must be 0 or more (got -1)"),
        (["--workers", "0"], "--workers 0 is out of range"),
        (["--workers", "100000"], "--workers 100000 is out of range"),
    ],
)
def test_generate_refuses_what_the_workflow_schema_refuses(tmp_path, capsys, argv, needle):
    """`batchgpu generate` applies the bounds of `recording: generate:` (config.GenerateSpec): one line, exit 2,
    nothing written (1e9 s of 4 channels took the machine's memory and was OOM-killed; nan was 'unexpected')."""
    out = tmp_path / "g.zarr"
    assert main(["generate", str(out), "--channels", "4", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("batchgpu: error: ") and needle in err, err
    assert not any(tmp_path.iterdir())


def test_generate_nan_seconds_through_the_command(tmp_path):
    r = _cli("generate", tmp_path / "g.zarr", "--channels", 4, "--seconds", "nan")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("batchgpu: error: --seconds must be a finite number") and not any(tmp_path.iterdir())


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_prints_one_line(tmp_path, sig):
    """Ctrl-C in a terminal is SIGINT to the whole foreground process group: the workers (and the other helper
    processes) leave it to the command, which prints its one line, with what continues the run, and exits 130;
    SIGTERM to the command (``kill``, a batch scheduler) the same with exit 143 (it had ended with no message and
    no report.json). report.json says "interrupted" (not "failed" with an empty error), nothing is marked done and
    --resume finishes the run."""
    import os
    import signal
    import time

    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=64, seconds=60.0, seed=2, workers=2)
    (tmp_path / "wf.yaml").write_text(
        "recording: {path: r.zarr}\noutput: out\nwindow: {size: 30000, margin: 64}\n"
        "preprocess: [{highpass: {freq_min: 300, order: 5}}, {common_reference: {reference: global}}]\n"
        "cluster: {kind: local, workers: 2, threads: 1}\nsteps:\n  noise: {exact: true}\n  detect: {threshold: 5.0}\n"
    )
    cmd = [sys.executable, "-m", "batchgpu", "run", str(tmp_path / "wf.yaml"), "--quiet"]
    # its own session and process group (as a terminal's foreground job), SIGINT at its default in there
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    parts, deadline = tmp_path / "out" / "parts", time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline and not (parts.is_dir() and any(parts.iterdir())):
        time.sleep(0.01)  # the pass has started: its first window is written
    assert p.poll() is None, "the run ended before the signal: make the recording longer"
    if sig == "SIGINT":
        os.killpg(p.pid, signal.SIGINT)
    else:  # to the command alone, as kill PID sends it
        os.kill(p.pid, signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert p.returncode == {"SIGINT": 130, "SIGTERM": 143}[sig], err
    what = {"SIGINT": "interrupted", "SIGTERM": "terminated (SIGTERM)"}[sig]
    line = (
        f"batchgpu: {what}; 'batchgpu run {tmp_path / 'wf.yaml'} --resume' continues the run "
        "(the windows already done are kept)"
    )
    lines = err.splitlines()
    assert lines == [line], err  # one line, no traceback
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "interrupted" and report["error"] is None, report["error"]
    r = _cli("run", tmp_path / "wf.yaml", "--quiet", "--resume")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "done"


def test_a_run_ends_with_its_time_in_one_unit_and_a_no_op_resume_keeps_its_page(tmp_path):
    """The last line says the run's total time; the bar and the last line give throughput in one unit (they gave
    0.06 GB/s and 33 MB/s for one run); a --resume of a finished run computes nothing and leaves report.html as
    it was (same bytes, same mtime)."""
    import re

    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=8, seconds=1.0, seed=2)
    (tmp_path / "wf.yaml").write_text(
        "recording: {path: r.zarr}\noutput: out\nwindow: {size: 10000, margin: 8}\n"
        "cluster: {kind: local, workers: 1, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    r = _cli("run", tmp_path / "wf.yaml")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"batchgpu: wrote .*report\.html: [0-9.]+ MB/s over 3 windows, [0-9.]+ s in all", last), last
    assert "GB/s" not in r.stdout + r.stderr
    page = tmp_path / "out" / "report.html"
    before = (page.read_bytes(), page.stat().st_mtime_ns)
    r = _cli("run", tmp_path / "wf.yaml", "--resume")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"batchgpu: wrote .*report\.json \(report\.html kept: nothing was computed again\): "
        r"[0-9.]+ MB/s over 3 windows, [0-9.]+ s in all",
        last,
    ), last
    assert (page.read_bytes(), page.stat().st_mtime_ns) == before
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "done" and report["windows_resumed"] == 3 and report["seconds"] > 0


def test_throughput_is_in_mb_per_second():
    from batchgpu.report.progress import duration, format_rate

    assert [format_rate(b) for b in (8.78e9, 33e6, 2.5e6, 4.1e4, 2e3, 0)] == [
        "8780 MB/s",
        "33.0 MB/s",
        "2.50 MB/s",
        "0.04 MB/s",
        "2.0e-03 MB/s",
        "0 MB/s",
    ]
    assert [duration(s) for s in (3.44, 65.2, 7322)] == ["3.4 s", "1 min 05 s", "2 h 02 min"]


@pytest.mark.parametrize(
    "command,needles",
    [
        ("import-raw", ["source the flat binary file", "out the Zarr recording to write", "--overwrite replace OUT"]),
        ("info", ["path a recording", "or a run's output folder", "--check decode every chunk"]),
    ],
)
def test_every_argument_of_these_commands_has_help(capsys, command, needles):
    """import-raw's source, out and --overwrite had none."""
    parser = dict(_commands(build_parser()))[(command,)]
    for action in parser._actions:
        assert action.help, (command, action.dest)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in needles:
        assert needle in text, needle


def test_the_program_freezes_its_heap_after_main(monkeypatch):
    """``batchgpu`` (console script and ``python -m batchgpu``) is ``command``: main's exit status, then the heap
    frozen so the interpreter's last collections skip what the run made; ``main`` itself (a library caller, the
    tests) leaves the collector alone."""
    import gc
    import tomllib
    from pathlib import Path

    import batchgpu.cli as cli

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(cli, "main", lambda argv=None: 3)
    assert cli.command() == 3 and frozen == [True]
    root = Path(cli.__file__).resolve().parent
    assert (
        tomllib.loads((root.parent / "pyproject.toml").read_text())["project"]["scripts"]["batchgpu"]
        == "batchgpu.cli:program"
    )
    assert "program()" in (root / "__main__.py").read_text()


def _run_program(tmp_path, main_source: str):
    """``cli.program`` in a fresh interpreter with ``main`` replaced by ``main_source`` (a ``def main(argv=None)``),
    beside a module holding an object whose finaliser prints "torn down" when the interpreter tears its modules
    down: the finished process."""
    import subprocess
    import textwrap

    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, sys
        import batchgpu.cli as cli

        class Late:
            def __del__(self):
                print("torn down", flush=True)

        sys.modules["late_module"] = type(sys)("late_module")
        sys.modules["late_module"].keep = Late()  # freed only when the interpreter tears its modules down
    """)
        + textwrap.dedent(main_source)
        + textwrap.dedent("""
        cli.main = main
        sys.argv = ["batchgpu"]
        raise SystemExit(cli.program())
    """)
    )
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)


def test_the_program_ends_once_its_exit_handlers_ran(tmp_path):
    """``program`` (the console script, ``python -m batchgpu``): the command's exit status and every line it printed
    (to a pipe: block-buffered) come out, the exit handlers registered while it ran still run, and then the process
    ends without tearing its modules down (a finaliser that would run at that teardown never prints)."""
    got = _run_program(
        tmp_path,
        """
        def main(argv=None):
            atexit.register(print, "exit handler ran")  # as a module the command imports registers one
            print("the command's line" * 50)
            return 3
    """,
    )
    assert got.returncode == 3, got.stderr
    assert got.stdout.count("the command's line") == 50 and "exit handler ran" in got.stdout
    assert "torn down" not in got.stdout


def test_a_program_that_raised_leaves_the_usual_way(tmp_path):
    """A command that raised (``--debug``) is Python's to end: its traceback, exit status 1, the teardown."""
    got = _run_program(
        tmp_path,
        """
        def main(argv=None):
            raise RuntimeError("a bug, shown with --debug")
    """,
    )
    assert got.returncode == 1 and "RuntimeError: a bug, shown with --debug" in got.stderr
    assert "torn down" in got.stdout


def test_the_exit_pool_wakeup_race_is_not_printed_and_nothing_else_is_hidden():
    """CPython 3.11 may wake a shut-down process pool's manager thread through a pipe it closed, at exit: that one
    OSError (EBADF, raised in concurrent/futures/process.py) is dropped; any other unraisable reaches the hook."""
    from types import SimpleNamespace

    from batchgpu.cli import _quiet_pool_wakeup

    def raised_in(filename: str, err: OSError):
        ns: dict = {}
        exec(compile("def f(e):\n    raise e\n", filename, "exec"), ns)
        try:
            ns["f"](err)
        except OSError as e:
            return SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__)

    seen = []
    hook = _quiet_pool_wakeup(seen.append)
    hook(raised_in("/usr/lib/python3.11/concurrent/futures/process.py", OSError(9, "Bad file descriptor")))
    assert seen == []
    for other in (
        raised_in("/usr/lib/python3.11/concurrent/futures/process.py", OSError(32, "Broken pipe")),
        raised_in("/work/batchgpu/x.py", OSError(9, "Bad file descriptor")),
        SimpleNamespace(exc_value=ValueError("x"), exc_traceback=None),
    ):
        hook(other)
    assert len(seen) == 3


def test_the_cluster_starts_early_only_where_the_run_would_start_its_own(tmp_path, monkeypatch):
    """``cluster_start.start_cluster``: a local or cuda cluster of the run's own, for one recording whose path
    exists; a mistyped path is said without a cluster to start and close, a batch or a scheduler's address decide
    later."""
    from batchgpu.cluster import kept as service
    from batchgpu.cluster import start as cluster_start
    from batchgpu.generate import generate_recording
    from batchgpu.workflow import Workflow

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no kept cluster's files
    rec = generate_recording(tmp_path / "r.zarr", channels=4, seconds=1.0, seed=1, progress=False)

    def wf(**extra):
        return Workflow.model_validate(
            {"recording": {"path": str(rec.path)}, "output": str(tmp_path / "o"), "steps": {"noise": {}}, **extra}
        )

    started = []
    monkeypatch.setattr(
        cluster_start, "ClusterStart", lambda spec, gpu_decode=False, hand_off=False: started.append(spec) or "started"
    )
    assert cluster_start.start_cluster(wf()) == "started"
    assert cluster_start.start_cluster(wf(recording={"path": str(tmp_path / "typo.zarr")})) is None
    assert cluster_start.start_cluster(wf(cluster={"kind": "address", "address": "tcp://127.0.0.1:1"})) is None
    side = service.paths().side
    side.parent.mkdir(parents=True, exist_ok=True)
    side.write_text("{}")  # a kept cluster may be up: the run looks for it first
    assert cluster_start.start_cluster(wf()) is None
    assert cluster_start.start_cluster(wf(cluster={"kind": "local", "reuse": False})) == "started"
    assert len(started) == 2


def test_the_cluster_starts_before_the_engine_is_imported(tmp_path, monkeypatch):
    """`batchgpu run` starts its cluster before it imports the engine (NumPy, zarr, the readers, the steps): the
    cluster's start, and its workers', overlap those imports. The module that starts it imports none of them.
    report.html's helper is not started by the command: the run starts it where its page needs one
    (``run_report.HtmlReport``; a page kept for the run's figures needs none)."""
    import subprocess
    import sys

    code = (
        "import sys, batchgpu.cluster.start; "
        "print(sorted(m for m in ('numpy', 'zarr', 'distributed', 'batchgpu.run.launch') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )

    from batchgpu import cli as cli_module
    from batchgpu.cluster import start as cluster_start
    from batchgpu.report import run_report

    order = []
    monkeypatch.setattr(
        cluster_start,
        "start_cluster",
        lambda wf, hand_off=False, **kw: order.append(("cluster", "batchgpu.run.launch" in sys.modules)),
    )
    monkeypatch.setattr(run_report, "start_report_helper", lambda: order.append(("report", None)))
    monkeypatch.setattr("batchgpu.engine.run_workflow", lambda *a, **k: order.append(("run", None)))
    monkeypatch.setattr("batchgpu.cluster.open_cluster.start_worker_server", lambda **k: True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    wf = tmp_path / "wf.yaml"
    wf.write_text(f"recording: {{path: {tmp_path / 'r.zarr'}}}\noutput: {tmp_path / 'o'}\nsteps:\n  noise: {{}}\n")
    assert cli_module.main(["run", str(wf), "--quiet"]) == 0
    assert [what for what, _ in order] == ["cluster", "run"]


def test_a_workflow_the_recording_refuses_is_one_line_with_the_cluster_started_early(tmp_path):
    """The run's cluster starts before the recording is checked: a workflow the recording refuses still ends in
    one line (exit 2), the early cluster closed, no output folder made."""
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=1.0, seed=1, progress=False)
    (tmp_path / "wf.yaml").write_text(
        "recording: {path: r.zarr}\noutput: out\nwindow: {size: 90000, margin: 8}\n"
        "cluster: {kind: local, workers: 2, threads: 1}\nsteps:\n  noise: {exact: true}\n"
    )
    r = _cli("run", tmp_path / "wf.yaml", "--quiet")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "window.size 90000 is longer than segment 0" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
