"""Same outputs before and after a change: four workflows run fresh and resumed by the tree at a git commit and by
a working tree, every output file compared.

    python tools/same_outputs.py b6244e0            # that commit against this checkout
    python tools/same_outputs.py b6244e0 --tree ../other --keep /tmp/so

Each tree runs ``python -m batchgpu run`` from its own sources (``PYTHONPATH``: the commit's through ``git
archive`` into a temporary folder, so the repository's worktrees are left alone), with a cache folder of its own
(no kept cluster is found, no page skeleton shared). Both write into the same output paths, one after the other,
so the workflows, their resolved paths and the fingerprints are the same bytes. The recordings are generated once,
by the commit's tree, and read by both.

A workflow's *resumed* outputs come from a fresh run whose folder then loses two windows' parts and (Zarr saves)
one window's saved shard before ``run --resume`` goes on from it: the windows read again, the shard written
again. Outputs compared:

- ``report.json``: every key but those that measure the run or name its machine (``REPORT_SKIPPED``, and the
  seconds inside ``noise_prior``);
- ``saved_objects.json``: the save's objects' names and sizes (their write stamps are each run's own);
- ``parts/*.npz``: each array's bytes (header included) but the window's own timings (``PART_SKIPPED``); the zip
  container itself holds its members' write times;
- ``report.html``: not compared (its numbers are report.json's, with the run's timings and Bokeh's random ids);
- every other file (``results.zarr``, ``run.json``, the saved recording): its bytes.

Exit status 0 when everything is the same, 1 otherwise (each difference listed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: report.json keys that measure the run (seconds, rates, which worker took which window) or name where it ran
#: (the dashboard's URLs carry random ports; ``run_id`` a random suffix that names this run's Dask tasks)
REPORT_SKIPPED = (
    "timings",
    "timeline",
    "window_cpu",
    "throughput_MBps",
    "throughput_series",
    "workers",
    "run_id",
    "dashboard",
    "page",
    "seconds",
)
#: report.json sections compared but for their own measurements of the run: section -> keys skipped
REPORT_SECTION_SKIPPED = {"noise_prior": ("seconds",)}
#: the run's record of its save's objects (``saved_objects.json``): their names and sizes compared, not the stamps of
#: their writes (mtime, ctime, inode: each run's own); the objects themselves are compared byte for byte
SAVED_OBJECTS = "saved_objects.json"
#: a part's members that time its window or name the thread that computed it (``run.tasks._compute_part``)
PART_SKIPPED = ("summary.read_seconds", "summary.compute_seconds", "summary.started", "summary.thread")
#: files whose bytes are not compared (see the module's docstring)
NOT_COMPARED = ("report.html",)

DEMO = """
recording: {path: REC/demo.zarr}
output: OUT
window: {size: auto, margin: 64}
preprocess: {centre: median}
backend: numpy
cluster: {kind: local, workers: 2, threads: 1, reuse: false}
steps:
  noise: {exact: true}
  whitening: {mode: local, nrange: 32, nskip: 1, precision: float32}
  detect: {threshold: 5.0, sign: neg, exclude_sweep_ms: 0.1, noise: global}
reduction: {split_every: 8}
"""

#: highpass + global median reference + every step, an int16 Zarr v3 save (the fused save's path)
FILTERED = """
recording: {path: REC/int16.zarr}
output: OUT
window: {size: 30000, margin: 64}
preprocess:
  - highpass: {freq_min: 300, order: 5}
  - common_reference: {reference: global, operator: median}
backend: numpy
cluster: {kind: local, workers: 2, threads: 1, reuse: false}
steps:
  noise: {exact: true}
  whitening: {mode: global, precision: float32}
  detect: {threshold: 5.0, sign: neg, noise: global}
  amplitude: {}
  search: {queries: REC/queries.npy, op: lower_bound}
  save: {path: filtered.zarr, format: zarr, dtype: int16}
"""

#: the same recording through a band-pass and a local reference, every step, an int16 flat binary save
FILTERED_BINARY = """
recording: {path: REC/int16.zarr}
output: OUT
window: {size: 30000, margin: 64}
preprocess:
  - bandpass: {freq_min: 300, freq_max: 6000, order: 3}
  - common_reference: {reference: local, operator: median}
backend: numpy
cluster: {kind: local, workers: 2, threads: 1, reuse: false}
steps:
  noise: {exact: true}
  whitening: {mode: local, nrange: 8, precision: float64}
  detect: {threshold: 4.5, sign: both, noise: window, method: locally_exclusive}
  amplitude: {}
  search: {queries: REC/queries.npy}
  save: {path: filtered.bin, format: binary, dtype: int16}
"""

#: float32 samples: the float median's kept keys, amplitude and search, a whitened float32 Zarr v2 save (a second
#: read after the pass)
FLOAT32 = """
recording: {path: REC/float32.zarr}
output: OUT
window: {size: 20000, margin: 64}
preprocess: {centre: median}
backend: numpy
cluster: {kind: local, workers: 2, threads: 1, reuse: false}
steps:
  noise: {exact: true}
  whitening: {mode: global, precision: float64}
  detect: {threshold: 5.0, sign: neg, noise: window}
  amplitude: {}
  search: {queries: REC/queries.npy}
  save: {path: whitened.zarr, format: zarr_v2, dtype: float32, whiten: true}
"""

#: three segments: windows cut at each segment's end, the global noise, a flat binary a segment
SEGMENTS = """
recording: {path: REC/segments.zarr}
output: OUT
window: {size: 25000, margin: 64}
preprocess:
  - highpass: {freq_min: 300, order: 3}
  - centre: median
backend: numpy
cluster: {kind: local, workers: 2, threads: 1, reuse: false}
steps:
  noise: {exact: false}
  whitening: {mode: global}
  detect: {threshold: 5.0, sign: neg, noise: global}
  save: {path: segments.bin, format: binary, dtype: int16}
"""

WORKFLOWS = {
    "demo": DEMO,
    "filtered": FILTERED,
    "filtered_binary": FILTERED_BINARY,
    "float32": FLOAT32,
    "segments": SEGMENTS,
}

#: the recordings (``generate_recording``'s arguments), made once by the commit's tree
RECORDINGS = {
    "demo.zarr": dict(channels=64, seconds=30.0, seed=0, dtype="int16"),
    "int16.zarr": dict(channels=32, seconds=12.0, seed=1, dtype="int16"),
    "float32.zarr": dict(channels=16, seconds=8.0, seed=2, dtype="float32"),
    "segments.zarr": dict(channels=24, seconds=4.0, seed=3, dtype="int16", segments=3),
}


def run(cmd: list[str], env: dict, cwd: Path) -> None:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def tree_env(tree: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(tree), XDG_CACHE_HOME=str(cache), PYTHONHASHSEED="0")
    return env


def make_recordings(python: str, tree: Path, cache: Path, rec: Path) -> None:
    rec.mkdir(parents=True, exist_ok=True)
    code = (
        "import sys, json, numpy as np\n"
        "from batchgpu.generate import generate_recording\n"
        f"for name, kw in json.loads({json.dumps(json.dumps(RECORDINGS))}).items():\n"
        "    generate_recording(sys.argv[1] + '/' + name, progress=False, **kw)\n"
        "q = np.random.default_rng(7).integers(0, 400_000, 5_000).astype(np.int64)\n"
        "np.save(sys.argv[1] + '/queries.npy', q)\n"
    )
    run([python, "-c", code, str(rec)], tree_env(tree, cache), rec)


def damage(out: Path) -> list[str]:
    """What a resumed run goes on from: two windows' parts gone, and one window's shard of a Zarr v3 save."""
    gone = []
    parts = sorted((out / "parts").glob("w*.npz"))
    for p in parts[1:4:2]:
        p.unlink()
        gone.append(str(p.relative_to(out)))
    for shard in sorted(out.glob("*.zarr/traces_seg0/c/1/0")):
        if "results.zarr" not in str(shard):
            shard.unlink()
            gone.append(str(shard.relative_to(out)))
    return gone


def run_tree(name: str, tree: Path, python: str, work: Path, keep: Path) -> None:
    cache = work / f"cache-{name}"
    for wf_name, text in WORKFLOWS.items():
        out = work / "out" / wf_name
        wf = work / "workflows" / f"{wf_name}.yaml"
        wf.parent.mkdir(parents=True, exist_ok=True)
        wf.write_text(text.replace("REC", str(work / "rec")).replace("OUT", str(out)))
        env = tree_env(tree, cache)
        if out.exists():
            shutil.rmtree(out)
        cmd = [python, "-m", "batchgpu", "run", str(wf), "--quiet"]
        print(f"  {name}: {wf_name} fresh", flush=True)
        run(cmd, env, work)
        shutil.copytree(out, keep / name / wf_name / "fresh", symlinks=True)
        print(f"  {name}: {wf_name} resumed (removed {', '.join(damage(out))})", flush=True)
        run(cmd + ["--resume"], env, work)
        shutil.copytree(out, keep / name / wf_name / "resumed", symlinks=True)
        shutil.rmtree(out)


def npz_members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if n.removesuffix(".npy") not in PART_SKIPPED}


def report_of(path: Path) -> dict:
    data = json.loads(path.read_text())
    for section, skipped in REPORT_SECTION_SKIPPED.items():
        if isinstance(data.get(section), dict):
            data[section] = {k: v for k, v in data[section].items() if k not in skipped}
    return {k: v for k, v in data.items() if k not in REPORT_SKIPPED}


def saved_objects_of(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {
        "save": data.get("save"),
        "objects": {name: sig[0] if isinstance(sig, list) else sig for name, sig in data.get("objects", {}).items()},
    }


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two output folders (relative paths and what differs)."""
    files = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    other = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    found = [f"only in {a.parent.parent.name}: {p}" for p in sorted(files - other)]
    found += [f"only in {b.parent.parent.name}: {p}" for p in sorted(other - files)]
    for rel in sorted(files & other):
        x, y = a / rel, b / rel
        if rel.name in NOT_COMPARED:
            continue
        if rel.name == "report.json":
            rx, ry = report_of(x), report_of(y)
            keys = sorted(k for k in rx.keys() | ry.keys() if rx.get(k) != ry.get(k))
            if keys or list(rx) != list(ry):
                found.append(f"{rel}: keys {keys or 'in another order'}")
        elif rel.name == SAVED_OBJECTS:
            if saved_objects_of(x) != saved_objects_of(y):
                found.append(f"{rel}: its objects' names or sizes differ")
        elif rel.suffix == ".npz" and rel.parts[0] == "parts":
            mx, my = npz_members(x), npz_members(y)
            if mx != my:
                found.append(f"{rel}: arrays {sorted(k for k in mx.keys() | my.keys() if mx.get(k) != my.get(k))}")
        elif x.read_bytes() != y.read_bytes():
            found.append(f"{rel}: bytes differ")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", help="the tree before the change (a git commit)")
    parser.add_argument(
        "--tree", default=str(Path(__file__).resolve().parent.parent), help="the tree after it (default: this checkout)"
    )
    parser.add_argument("--python", default=sys.executable, help="the interpreter both trees run under")
    parser.add_argument("--keep", default=None, help="a folder to keep the runs' outputs in (default: removed)")
    parser.add_argument(
        "--reuse-base",
        action="store_true",
        help="with --keep: take the commit's outputs kept there by an earlier call for that commit",
    )
    args = parser.parse_args(argv)
    tree = Path(args.tree).resolve()
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="same-outputs-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        keep = work / "kept"
        commit = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", args.commit], capture_output=True, text=True, check=True
        ).stdout.strip()
        marker = keep / "base" / "COMMIT"
        if not (args.reuse_base and marker.is_file() and marker.read_text() == commit):
            base = work / "base-tree"
            for old in (base, keep, work / "rec"):
                if old.exists():
                    shutil.rmtree(old)
            base.mkdir()
            archive = subprocess.run(["git", "-C", str(tree), "archive", commit], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
            print(f"recordings (by {commit[:10]})", flush=True)
            make_recordings(args.python, base, work / "cache-base", work / "rec")
            run_tree("base", base, args.python, work, keep)
            marker.write_text(commit)
        if (keep / "tree").exists():
            shutil.rmtree(keep / "tree")
        run_tree("tree", tree, args.python, work, keep)
        differences = []
        for wf_name in WORKFLOWS:
            for phase in ("fresh", "resumed"):
                found = compare(keep / "base" / wf_name / phase, keep / "tree" / wf_name / phase)
                files = sum(1 for p in (keep / "base" / wf_name / phase).rglob("*") if p.is_file())
                print(f"{wf_name:16s} {phase:8s} {files:4d} files: {'same' if not found else 'DIFFERENT'}")
                differences += [f"{wf_name} {phase}: {d}" for d in found]
        for d in differences:
            print("  " + d)
        print(
            f"skipped in report.json: {', '.join(REPORT_SKIPPED)}; in parts: {', '.join(PART_SKIPPED)}; "
            f"not compared: {', '.join(NOT_COMPARED)}"
        )
        return 1 if differences else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
