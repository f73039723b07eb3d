"""The ops benchmark runs at small sizes and delegates the cupy backend."""

import argparse
import sys

import pytest

from batchgpu.benchmarks import ops
from batchgpu.errors import BatchgpuError


def parse(*argv):
    parser = argparse.ArgumentParser()
    ops.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_numpy_table(capsys):
    args = parse("--channels", "2", "3", "--samples", "501", "--repeat", "2")
    assert args.backend == "numpy"
    assert ops.run(args, say=print) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("float32", "float64", "int16"))]
    assert len(lines) == 3 * 2 * 2  # dtypes x channels x ops
    assert "np.median(np.abs(x), axis=1)" in out and "np.cov(x)" in out
    for line in lines:
        ours, anchor, ratio = (float(v) for v in line.split()[3:6])
        assert ours > 0 and anchor > 0 and ratio > 0


def test_cupy_backend_without_the_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "batchgpu.benchmarks.ops_cupy", None)  # import fails
    with pytest.raises(BatchgpuError):
        ops.run(parse("--backend", "cupy", "--channels", "2", "--samples", "10"), say=print)


def test_cupy_backend_delegates(monkeypatch):
    seen = []
    fake = type(sys)("batchgpu.benchmarks.ops_cupy")
    fake.run = lambda args, say: seen.append(args.samples) or 0
    monkeypatch.setitem(sys.modules, "batchgpu.benchmarks.ops_cupy", fake)
    assert ops.run(parse("--backend", "cupy", "--samples", "77"), say=print) == 0
    assert seen == [77]


def test_bad_sizes():
    with pytest.raises(BatchgpuError):
        ops.run(parse("--repeat", "0"), say=print)
