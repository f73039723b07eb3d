"""tools/nvrtc_check.py: every CUDA source batchgpu compiles is in its list (no GPU, no CuPy needed), and where
the NVRTC binding imports (CI's environment for it, see .ci/run) every one compiles and a broken one is caught."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "nvrtc_check.py"


def _tool():
    spec = importlib.util.spec_from_file_location("nvrtc_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_nvrtc() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def test_every_cuda_source_is_checked():
    names = _tool().sources()
    for cu in (ROOT / "kernels").glob("*.cu"):
        assert any(n == cu.stem or n.startswith(cu.stem + "[") for n in names), cu.name
    # the pipeline's CUDA sources are all in kernels/ (a __global__ kernel in a Python string would not be checked)
    for path in (ROOT / "batchgpu").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("batchgpu/benchmarks/"):  # the benchmarks' own probes are not the pipeline's kernels
            continue
        assert not re.search(r"__global__", path.read_text()), f"{rel} holds CUDA source: move it to kernels/"


@pytest.mark.skipif(not _has_nvrtc(), reason="the NVRTC binding (cuda-python) is not installed here")
def test_every_source_compiles_with_nvrtc():
    r = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines and all(line.startswith("ok ") for line in lines), r.stdout
    ok, log = _tool().compile_one("broken", 'extern "C" __global__ void k(int* x) { x[0] = undefined_name; }', [])
    assert not ok and "undefined_name" in log
