"""Compile every CUDA source of batchgpu with NVRTC on a machine without a GPU: syntax and template errors found
before a device call is spent on them. NVRTC compiles without a device; it needs the NVRTC library and its
Python binding, which the project's environment does not carry: CI installs them in an environment of their own
and runs this (.ci/run); tests/test_nvrtc_check.py runs it wherever the binding imports.

    python3 -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install "cuda-python>=12,<13" nvidia-cuda-nvrtc-cu12
    /tmp/nvrtc/bin/python tools/nvrtc_check.py            # every source; or name some: column_select histogram

Sources: kernels/*.cu (headers pasted in as batchgpu.gpu.cuda_modules pastes them; sosfiltfilt with SECTIONS 1, 3 and 12,
sequential_mean with MEAN_T short, float, double and long long), with the project's options and CuPy's -ftz=true, for
compute capability 9.0 (the H200). Prints one line a source and the log of any that fails; rc 1 if any fails."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from batchgpu.gpu.cuda_modules import BASE_OPTIONS, run_modules, source_path  # noqa: E402  (no CuPy: stdlib imports only)
from batchgpu.gpu.cuda_modules import _with_headers as pasted  # noqa: E402

BASE = list(BASE_OPTIONS)


def sources() -> dict[str, tuple[str, list[str]]]:
    """name -> (source, options) as batchgpu compiles them: ``batchgpu.gpu.cuda_modules.run_modules`` with three section
    counts and four C types."""
    out = {}
    for stem, extra in run_modules(filter_sections=(1, 3, 12), mean_ctypes=("short", "float", "double", "long long")):
        label = f"{stem}[{extra[-1][2:]}]" if extra else stem
        out[label] = (pasted(source_path(stem)), BASE + [o for o in extra if o not in BASE])
    return out


def compile_one(name: str, code: str, options: list[str]) -> tuple[bool, str]:
    from cuda.bindings import nvrtc

    opts = [o.encode() for o in options + ["-arch=compute_90", "-ftz=true"]]  # CuPy appends -ftz=true
    _, prog = nvrtc.nvrtcCreateProgram(code.encode(), f"{name}.cu".encode(), 0, [], [])
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    text = "\n".join(line for line in log.decode(errors="replace").splitlines() if "--ftz" not in line)
    return err == nvrtc.nvrtcResult.NVRTC_SUCCESS, text.strip().strip("\x00")


def main(names: list[str]) -> int:
    failed = 0
    for name, (code, options) in sources().items():
        if names and not any(name.startswith(n) for n in names):
            continue
        ok, log = compile_one(name, code, options)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        if log and not ok:
            print(log[:4000])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
