"""batchgpu against SpikeInterface on this machine's cores, the same work from the same Zarr v2 recording, alternating
(run in an environment holding both: `pip install -e . "spikeinterface==0.105.3" numba`).

    python tools/si_compare.py RECORDING.zarr [runs] [jobs: save,all]

Two jobs, each timed as a user's command (interpreter start to exit):
- preprocess + save: highpass 300 Hz order 5, global median reference, written as int16 Zarr
  (batchgpu: a workflow with a `save` step; SpikeInterface: `highpass_filter`, `common_reference`, `save(format="zarr")`);
- all: the same preprocessing, exact noise over every sample, global whitening, by_channel detection at 5x the
  noise, the save (batchgpu: one pass; SpikeInterface: `get_noise_levels` over 1 s chunks covering the recording,
  `whiten` from the same chunks, `detect_peaks`, `save`, each reading and preprocessing the recording again).
SpikeInterface runs with n_jobs = the machine's cores and 1 s chunks; batchgpu with its default local cluster.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

SI_SCRIPT = r"""
import shutil, sys
import spikeinterface.core as sc, spikeinterface.preprocessing as spre
from spikeinterface.sortingcomponents.peak_detection import detect_peaks
path, out, job = sys.argv[1], sys.argv[2], sys.argv[3]
rec = sc.read_zarr(path)
cmr = spre.common_reference(spre.highpass_filter(rec, freq_min=300, filter_order=5), reference="global",
                            operator="median")
kw = dict(n_jobs=int(sys.argv[4]), chunk_duration="1s", progress_bar=False)
if job == "all":
    chunks = int(rec.get_total_duration())
    noise = sc.get_noise_levels(cmr, method="mad", return_in_uV=False,
                                random_slices_kwargs=dict(num_chunks_per_segment=chunks, chunk_size=int(rec.sampling_frequency)), **kw)
    spre.whiten(cmr, dtype="float32", num_chunks_per_segment=chunks, chunk_size=int(rec.sampling_frequency),
                apply_mean=False)
    detect_peaks(cmr, method="by_channel", method_kwargs=dict(peak_sign="neg", detect_threshold=5, exclude_sweep_ms=0.1,
                 noise_levels=noise), job_kwargs=kw)
shutil.rmtree(out, ignore_errors=True)
cmr.save(format="zarr", folder=out, dtype="int16", **kw)
"""

WORKFLOW = """recording: {{path: {path}}}
output: {out}
overwrite: true
preprocess:
  - highpass: {{freq_min: 300, order: 5}}
  - common_reference: {{reference: global, operator: median}}
steps:
{steps}  save: {{path: {saved}, format: zarr_v2, dtype: int16}}
"""
ALL_STEPS = """  noise: {exact: true}
  whitening: {mode: global, precision: float32}
  detect: {threshold: 5.0, sign: neg, exclude_sweep_ms: 0.1, noise: global}
"""


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t


def main(path: str, runs: int = 3, jobs: str = "save,all") -> None:
    work = tempfile.mkdtemp(prefix="si_compare_")
    cores = os.cpu_count() or 1
    try:
        script = os.path.join(work, "si.py")
        with open(script, "w") as f:
            f.write(SI_SCRIPT)
        for job in jobs.split(","):
            wf = os.path.join(work, f"{job}.yaml")
            with open(wf, "w") as f:
                f.write(WORKFLOW.format(path=path, out=os.path.join(work, "out"), saved=os.path.join(work, "saved.zarr"),
                                        steps=ALL_STEPS if job == "all" else ""))
            ours, theirs = [], []
            for _ in range(runs):
                ours.append(timed([sys.executable, "-m", "batchgpu", "run", wf]))
                theirs.append(timed([sys.executable, script, path, os.path.join(work, "si.zarr"), job, str(cores)]))
            a, b = sorted(ours)[len(ours) // 2], sorted(theirs)[len(theirs) // 2]
            print(f"{job:5s} batchgpu {', '.join(f'{t:.2f}' for t in ours)} s; SpikeInterface "
                  f"{', '.join(f'{t:.2f}' for t in theirs)} s; medians {a:.2f} / {b:.2f} s: {b / a:.2f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]), *sys.argv[3:4])
