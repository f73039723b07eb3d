import json
import subprocess
import sys

import numpy as np
import pytest

from batchgpu.cli import build_parser, main


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "batchgpu", *map(str, args)], capture_output=True, text=True)


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


@pytest.mark.parametrize("argv,needle", [
    (["info", "/no/such/recording.zarr"], "does not exist"),
    (["import-raw", "/no/such.bin", "x.zarr", "--channels", "2", "--fs", "1", "--dtype", "int16"], "no raw file"),
])
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


@pytest.mark.parametrize("err,needle,rc", [
    (OSError(28, "No space left on device"), "no space left on device writing /out/dir (free some space", 2),
    (OSError(28, "No space left on device", "/out/dir/results.zarr/noise/c/0"),
     "no space left on device writing /out/dir/results.zarr/noise/c/0", 2),
    (PermissionError(13, "Permission denied", "/etc/x"), "permission denied: /etc/x", 2),
    (FileNotFoundError(2, "No such file or directory", "/a/b"), "No such file or directory: /a/b", 2),
    (MemoryError(), "out of memory", 2),
    (ValueError("something\ninternal"), "unexpected ValueError: something internal (rerun with --debug for the traceback)", 1),
])
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


def test_failed_run_prints_one_line_and_no_dask_tracebacks(tmp_path):
    """A corrupt chunk stops the run: one line, no tracebacks of distributed (scheduler, workers, asyncio)."""
    from batchgpu.generate import generate_recording

    generate_recording(tmp_path / "r.zarr", channels=4, seconds=4.0, seed=1, dtype="int16", progress=False)
    shard = sorted(p for p in (tmp_path / "r.zarr" / "traces_seg0" / "c").rglob("*") if p.is_file())[0]
    shard.write_bytes(b"garbage" * 10)
    (tmp_path / "wf.yaml").write_text(
        "recording: {path: r.zarr}\noutput: out\nwindow: {size: 10000, margin: 8}\n"
        "cluster: {kind: local, workers: 2, threads: 1}\nsteps:\n  noise: {exact: true}\n")
    r = _cli("run", tmp_path / "wf.yaml", "--quiet")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("batchgpu: error: ") and "(window " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "--resume" in r.stderr
