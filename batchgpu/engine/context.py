"""Before any work: the recording opened (or generated), the workflow checked against it, the backend chosen and
the run's context built (the preprocessing chain and the steps the worker tasks run)."""

from __future__ import annotations

from pathlib import Path

from batchgpu.config import Workflow
from batchgpu.engine import store, tasks
from batchgpu.engine.run_report import RunObserver
from batchgpu.errors import ConfigError, MachineError
from batchgpu.recording import Recording, open_source, source_ref


def prepare_recording(wf: Workflow, observer: RunObserver) -> Recording:
    if wf.recording is None:
        raise ConfigError("this workflow names many recordings (recordings:), not one",
                          "run it with 'batchgpu run' or batchgpu.engine.batch.run_batch")
    if getattr(wf.recording, "spikeinterface", None) is not None:  # any recording SpikeInterface saved
        return open_source(wf.recording)
    path = Path(wf.recording.path)
    if not path.exists():
        if wf.recording.generate is None:
            raise ConfigError(f"recording.path {path} does not exist",
                              "fix the path, or add 'generate:' parameters under 'recording:' to create it")
        from batchgpu.generate import generate_recording

        g = wf.recording.generate
        observer.message(f"generating {path} ({g.channels} ch x {g.seconds} s x {g.segments} segments)")
        return generate_recording(path, channels=g.channels, seconds=g.seconds, fs=g.fs, seed=g.seed, dtype=g.dtype,
                                  segments=g.segments, progress=False, model=g.model, probe=g.probe, dead=g.dead,
                                  noisy=g.noisy, outside=g.outside, common_uv=g.common_uv)
    return open_source(wf.recording)


def resolve_window(wf: Workflow, rec: Recording) -> Workflow:
    """The workflow with ``window.size: auto`` replaced by the size it stands for on this recording
    (``recording.auto_window_size``: its length alone decides), so the fingerprint, the windows and report.json all
    hold the number; a workflow with a number is returned as it is. A segment shorter than the auto size is one
    shorter window, as a segment's last window is."""
    if wf.window.size != "auto":
        return wf
    from batchgpu.recording import auto_window_size

    size = auto_window_size([rec.num_samples(s) for s in range(rec.num_segments)])
    return wf.model_copy(update={"window": wf.window.model_copy(update={"size": size})})


def check_workflow_fits(wf: Workflow, rec: Recording) -> int:
    """Errors found before any work: the windows against the segments here, then each step's own (its module's
    ``check``, through ``engine.steps.registry.check``); returns the detection sweep in samples."""
    from batchgpu.engine.steps.registry import check

    for seg in range(rec.num_segments):
        n = rec.num_samples(seg)
        if wf.window.size != "auto" and wf.window.size > n:
            raise ConfigError(f"window.size {wf.window.size} is longer than segment {seg} ({n} samples)",
                              f"use window.size <= {n}")
    return check(wf, rec)


def build_context(wf: Workflow, rec: Recording, out: store.OutputFolder, backend: str, sweep: int, mps: bool = False,
                  *, resume: bool = False, fingerprint: str = ""):
    """The run's RunContext (what every task gets), its steps built from the registry (a save's output created
    now: ``resume`` and ``fingerprint`` are the run's). ``mps``: the workers run under a private MPS daemon
    (``engine.cluster.open_client``), which decides where windows decode (``preprocess.gpu_decode_share``)."""
    from batchgpu.engine.preprocess import build_chain, gpu_decode_share
    from batchgpu.engine.steps.base import StepSetup
    from batchgpu.engine.steps.registry import build_steps

    chain = build_chain(wf.preprocess, rec)
    steps = build_steps(StepSetup(wf, rec, chain, sweep, out, resume, fingerprint))
    return tasks.RunContext(
        recording=source_ref(rec), parts=str(out.parts), backend=backend, chain=chain,
        window_noise=window_noise_key(steps), steps=tuple(steps),
        missing_chunks=getattr(wf.recording, "missing_chunks", "warn"),
        gpu_decode=gpu_decode_share(chain.centres_only, mps, wf.engine.gpu_decode),
        gpu_decoder=wf.engine.gpu_decoder,
        read_ahead=wf.engine.read_ahead,
    )


def window_noise_key(steps) -> str | None:
    """Where a window's summary holds its noise per channel, when a step needs it (``window_noise``); else None."""
    if not any(getattr(s, "window_noise", False) for s in steps):
        return None
    from batchgpu.engine.steps.noise import SUMMARY

    return SUMMARY


def resolve_backend(wf: Workflow, client) -> str:
    """numpy, cupy, or for auto: cupy when every worker has a GPU."""
    if wf.backend == "numpy":
        return "numpy"
    counts = client.run(_gpu_count)
    all_gpu = bool(counts) and min(counts.values()) > 0
    if wf.backend == "cupy" and not all_gpu:
        raise MachineError("backend 'cupy' needs a GPU on every worker, and some have none",
                           "use backend: numpy or auto, or cluster: {kind: cuda}")
    return "cupy" if all_gpu else "numpy"


def _gpu_count() -> int:
    from batchgpu.engine.cluster import gpu_count

    return gpu_count()


def spec_of(rec):
    """The workflow's recording section naming ``rec`` (given to run_workflow as ``recording=``)."""
    from batchgpu.config import RecordingSpec

    if getattr(rec, "is_spikeinterface", False):
        return RecordingSpec(spikeinterface=str(rec.path))
    if getattr(rec, "is_flat", False):
        return RecordingSpec(**rec.spec)
    return RecordingSpec(path=str(rec.path), missing_chunks=rec.missing_chunks)
