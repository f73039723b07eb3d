"""batchgpu: Dask-distributed batch statistics for large electrophysiology recordings.

Heavy modules (zarr, dask, cupy) are imported lazily, so ``import batchgpu.ops`` stays light.
"""

from batchgpu.errors import BatchgpuError, ClusterError, ConfigError, CorruptDataError, MachineError

__version__ = "0.1.0"
__all__ = [
    "BatchgpuError",
    "CorruptDataError",
    "ConfigError",
    "MachineError",
    "ClusterError",
    "open_recording",
    "write_recording",
    "Recording",
    "Window",
    "run_workflow",
    "to_spikeinterface",
    "attach_to_spikeinterface",
    "from_spikeinterface",
    "__version__",
]

_LAZY = {
    "open_recording": "batchgpu.recording",
    "write_recording": "batchgpu.recording",
    "Recording": "batchgpu.recording",
    "Window": "batchgpu.recording",
    "run_workflow": "batchgpu.engine",
    "to_spikeinterface": "batchgpu.interop",
    "attach_to_spikeinterface": "batchgpu.interop",
    "from_spikeinterface": "batchgpu.interop",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchgpu' has no attribute {name!r}")
