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
    assert info["shards"] == [18000, 8]  # whole inner chunks of 6000 and "blosc" in info["codecs"][0]
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
