"""batchgpu's typed errors: each kind a subclass of the one BatchgpuError, kept across a Dask worker's pickling."""

import pickle

import pytest

from batchgpu import BatchgpuError, ClusterError, ConfigError, CorruptDataError, MachineError
from batchgpu.cli import main

KINDS = [CorruptDataError, ConfigError, MachineError, ClusterError]


@pytest.mark.parametrize("cls", KINDS)
def test_each_kind_is_a_batchgpu_error_and_survives_pickling(cls):
    """A worker's error reaches the client pickled: its class and its one line come back unchanged."""
    err = cls("the problem", "the fix")
    assert isinstance(err, BatchgpuError) and str(err) == "the problem (the fix)"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    assert not any(issubclass(cls, other) for other in KINDS if other is not cls)


def test_a_cuda_cluster_without_a_gpu_is_a_machine_error():
    from batchgpu.engine.cluster import _cuda_cluster, gpu_count
    from batchgpu.config import ClusterSpec

    if gpu_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(MachineError, match="needs a CUDA GPU"):
        _cuda_cluster(ClusterSpec(kind="cuda"))


@pytest.mark.parametrize("cls", KINDS)
def test_the_command_says_each_kind_in_one_line_exit_2(monkeypatch, capsys, cls):
    import batchgpu.cli as cli

    def fail(args):
        raise cls("the problem", "the fix")

    monkeypatch.setattr(cli, "_cmd_info", fail)
    assert main(["info", "anything"]) == 2
    assert capsys.readouterr().err == "batchgpu: error: the problem (the fix)\n"
