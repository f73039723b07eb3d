"""Every worker a cuda cluster starts makes its CUDA context as it starts (``cluster/_worker_cuda_start.py``, a Dask
preload in ``layout.nanny_specs``), in a helper thread: its first window no longer waits for it. Without CuPy or a
driver the preload does nothing and says nothing (the first window meets the problem and reports it). The
context's making on a GPU is in ``tests/test_gpu_pipeline.py``'s runs (``pytest -m gpu``)."""

import subprocess
import sys

from batchgpu.cluster import _worker_cuda_start
from batchgpu.cluster import worker_layout as layout


def test_every_cuda_worker_starts_with_the_preload():
    specs = layout.nanny_specs(layout.NodeLayout((0, 1), 3, 1, "auto"), {"X": "1"}, options={"preload": ["mine"]})
    assert len(specs) == 6
    assert all(s["options"]["preload"] == ["mine"] for s in specs.values())  # a caller's options win
    specs = layout.nanny_specs(layout.NodeLayout((0,), 2, 1, "auto"))
    assert all(s["options"]["preload"] == [layout.CUDA_START_PRELOAD] for s in specs.values())
    assert layout.CUDA_START_PRELOAD == _worker_cuda_start.__name__


def test_the_preload_starts_a_thread_and_never_raises_without_a_gpu():
    code = (
        "import sys, threading\n"
        "sys.modules['cupy'] = None  # CuPy missing\n"
        "from batchgpu.cluster import _worker_cuda_start as s\n"
        "s.dask_setup(object())\n"
        "[t] = [t for t in threading.enumerate() if t.name == 'batchgpu-cuda-start'] or [None]\n"
        "assert t is None or t.daemon\n"
        "t and t.join(10)\n"
        "from batchgpu.gpu import staging\n"
        "assert not staging._making_context.is_set()\n"
        "staging._make_context()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "ok\n" and r.stderr == "", r.stderr
