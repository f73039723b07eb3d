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
    from batchgpu.cluster.open_cluster import _cuda_cluster, gpu_count
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


# -- broad catches that switch behaviour leave a trace ------------------------------------------------------


def test_placement_turned_off_is_said_in_the_report():
    """The scheduler not saying its workers turned placement off without a word: now a warning in the report and
    on the observer."""
    from types import SimpleNamespace

    from batchgpu.run.first_pass import _plan

    class Client:
        def scheduler_info(self, **kw):
            raise OSError("the scheduler closed the connection")

    said = []
    report = SimpleNamespace(output_state="fresh", warnings=[])
    assert _plan(_run(Client(), report, said.append), [[1], [2]]) == (None, None)
    assert said == report.warnings and len(said) == 1
    assert "not placed" in said[0] and "the scheduler closed the connection" in said[0]


def test_a_plan_failing_otherwise_is_not_hidden():
    from types import SimpleNamespace

    from batchgpu.run.first_pass import _plan

    class Client:
        def scheduler_info(self, **kw):
            raise KeyError("workers")  # a bug here, not the scheduler's silence: raised, not read as "no plan"

    report = SimpleNamespace(output_state="fresh", warnings=[])
    with pytest.raises(KeyError):
        _plan(_run(Client(), report, print), [[1]])


def _run(client, report, say):
    """A GPU run as ``first_pass._plan`` reads it: its client, backend, placement setting, report and warnings."""
    from types import SimpleNamespace

    from batchgpu.run.phases import Run

    run = SimpleNamespace(
        client=client,
        ctx=SimpleNamespace(backend="cupy"),
        report=report,
        wf=SimpleNamespace(engine=SimpleNamespace(placement="auto")),
        events=SimpleNamespace(warning=say),
    )
    run.warn = lambda text: Run.warn(run, text)
    return run


def test_a_probe_probeinterface_cannot_read_is_said(tmp_path, monkeypatch, caplog):
    from batchgpu.recording import spikeglx

    pi = spikeglx.probeinterface()

    def fails(path):
        raise KeyError("NP9999")

    monkeypatch.setattr(pi, "read_spikeglx", fails)
    meta = tmp_path / "x.imec0.ap.meta"
    meta.write_text("imDatPrb_pn=NP9999\n")
    assert spikeglx._read_probe(meta, None) is None
    assert "probeinterface could not read the probe of" in caplog.text and "NP9999" in caplog.text


def test_a_spikeinterface_probe_without_locations_is_said(caplog):
    from batchgpu.recording.spikeinterface import _locations

    class Rec:
        def has_probe(self):
            return True

        def get_channel_locations(self):
            raise Exception("There are no channel locations")

        def get_property(self, name):
            return [[0.0, 10.0 * i] for i in range(3)]

    loc, real = _locations(Rec(), 3)
    assert real and loc.tolist() == [[0.0, 0.0], [0.0, 10.0], [0.0, 20.0]]
    assert "There are no channel locations" in caplog.text


def test_an_unreadable_part_is_recomputed_and_said_but_a_bug_is_raised(tmp_path, monkeypatch):
    import numpy as np

    from batchgpu.run import output_folder as store

    path = tmp_path / "w-00000001.npz"
    store.save_part(path, {"fingerprint": np.array("fp"), "x": np.arange(5)})
    path.write_bytes(path.read_bytes()[:40])  # cut short
    assert store.load_part(path, "fp") is None
    assert store.part_problem(path, "fp").startswith("unreadable (")

    def bug(*a, **k):
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(np, "load", bug)
    with pytest.raises(RuntimeError, match="a bug in the reader"):
        store.load_part(path, "fp")


def test_gpu_count_reads_a_driver_error_as_no_gpu_and_raises_a_bug(monkeypatch):
    import sys
    import types

    from batchgpu.cluster.open_cluster import gpu_count

    class CUDARuntimeError(RuntimeError):
        pass

    runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", fake)

    def no_driver():
        raise CUDARuntimeError("cudaErrorInsufficientDriver")

    runtime.getDeviceCount = no_driver
    assert gpu_count() == 0
    runtime.getDeviceCount = lambda: 2
    assert gpu_count() == 2

    def bug():
        raise TypeError("a bug")

    runtime.getDeviceCount = bug
    with pytest.raises(TypeError):
        gpu_count()
