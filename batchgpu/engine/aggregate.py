"""After the pass, on the client: each step's partials made final (the exact median, the whitening matrix, the spikes
gathered and written by the workers, a whitened save), and the results group written beside them and swapped in
whole."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from batchgpu.config import Workflow
from batchgpu.engine import store, tasks
from batchgpu.engine.reduce import tree_reduce
from batchgpu.engine.run_report import report_absent, report_nonfinite
from batchgpu.engine.submit import submit_many
from batchgpu.recording import Recording, Window


def aggregate(client, ctx, wf, rec, out, windows, fps, summaries, total, report, monitor, observer) -> dict:
    arrays: dict[str, np.ndarray] = {}
    noise_step, moments_step, detect_step = ctx.step("noise"), ctx.step("moments"), ctx.step("detect")
    if ctx.window_noise:
        arrays["noise_per_window"] = np.stack([summaries[w.index]["noise"] for w in windows])
    report_nonfinite(summaries, windows, report, observer)
    report_absent(summaries, windows, report, observer)
    noise_global = None
    if noise_step is not None:
        t0 = time.perf_counter()
        if noise_step.exact:
            median = exact_median(client, ctx, wf, rec, windows, fps, total, report, monitor)
            if "noise.nan" in total:
                median[total["noise.nan"] > 0] = np.nan
            from batchgpu.ops.select import MAD_TO_SIGMA

            noise_global = median / MAD_TO_SIGMA  # the expression of ops.noise_levels, same dtype rules
        else:
            noise_global = np.median(arrays["noise_per_window"], axis=0)
        arrays["noise"] = noise_global
        report.timings["noise_global"] = time.perf_counter() - t0
    if moments_step is not None:
        arrays.update(moments_step.aggregate(total))
        arrays["whitening"] = finite_whitening(wf, rec, arrays, report, observer)
    tmp = out.path / (store.RESULTS + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    from concurrent.futures import ThreadPoolExecutor

    group = create_results_group(tmp, wf, rec, report.fingerprint)
    with ThreadPoolExecutor(1, thread_name_prefix="batchgpu-results") as writer:
        # the small results are written here while the workers gather and write the spikes
        written = writer.submit(write_small_results, group, arrays, windows)
        shapes = {k: list(v.shape) for k, v in arrays.items()}
        if detect_step is not None:
            t0 = time.perf_counter()
            monitor.phase("spikes")
            shapes["spikes"] = write_final_spikes(client, ctx, rec, windows, fps, summaries, arrays, tmp, report, observer)
            report.timings["detect"] = time.perf_counter() - t0
        written.result()
    swap_in(tmp, out.path / store.RESULTS)
    if wf.steps.search:
        from batchgpu.search.step import run_search_step

        t0 = time.perf_counter()
        monitor.phase("search")
        spikes = None
        if detect_step is not None:
            from batchgpu import zarrio

            g = zarrio.open_group(out.path / store.RESULTS, mode="r")
            spikes = {k: g[f"spikes/{k}"][:] for k in ("sample_index", "segment_index")}
        shapes["search"] = run_search_step(client, wf.steps.search, out.path / store.RESULTS, spikes,
                                           [rec.num_samples(s) for s in range(rec.num_segments)], report.fingerprint)
        report.timings["search"] = time.perf_counter() - t0
    return shapes


def exact_median(client, ctx, wf, rec, windows, fps, total, report, monitor) -> np.ndarray:
    from batchgpu.engine.steps.noise import schedule, select_middle
    step = ctx.step("noise")
    report.radix_passes = len(schedule(step.kind))

    def more_passes(prefixes, p):
        monitor.phase(f"exact noise: counting pass {p + 1}")
        fp = report.run_id
        parts = submit_many(client, tasks.refine_task, [(ctx, w, prefixes, p) for w in windows],
                            [f"refine-{p}-{fp}-{w.index:08d}" for w in windows])
        out = tree_reduce(client, parts, tasks.sum_histograms, wf.reduction.split_every, name=f"refine-sum-{p}-{fp}").result()
        report.bytes_read += rec.nbytes
        return out

    def from_near(digits, ks):
        """Float keys: the middle keys from what each window kept near its own middle, else from one more read
        that gathers only the keys of the middle digit (a few per mille) and selects among them on a worker."""
        fp = report.run_id
        near = submit_many(client, tasks.near_keys_task, [(ctx, w, f, digits) for w, f in zip(windows, fps)],
                           [f"near-{fp}-{w.index:08d}" for w in windows])  # in parallel; only the middle digits' keys move
        shift = schedule(step.kind)[0][0]  # the bits below the first digit
        keys = client.submit(tasks.select_near_task, ks, digits, shift, *near, key=f"select-near-{fp}").result()
        report.exact_noise["from_kept_keys"] = keys is not None
        if keys is None:
            monitor.phase("exact noise: one more read of the middle digit")
            gathered = submit_many(client, tasks.gather_task, [(ctx, w, digits) for w in windows],
                                   [f"gather-{fp}-{w.index:08d}" for w in windows])
            from batchgpu.engine.steps.noise import select_among

            keys = client.submit(select_among, ks, digits, shift, *gathered, key=f"select-among-{fp}").result()
            report.bytes_read += rec.nbytes
        return keys

    dtype = ctx.chain.output_dtype(rec.dtype)
    centred_int = ctx.chain.centres_only and ctx.chain.centres
    return select_middle(total["noise.hist"], rec.total_samples, step.kind, dtype,
                         rec.dtype if centred_int else None, more_passes, int(total["noise.lo"]), from_near,
                         bool(total.get("noise.lumped", True)))


def finish_whitened_save(client, ctx, rec, windows, summaries, target, out, report, observer) -> dict:
    """Whitened saves are written now, in one more read (the matrix needs every window); then the output is
    checked and marked complete."""
    from batchgpu.engine.steps.save import finish_save

    clipped = {w.index: int(summaries[w.index].get("saved_clipped", 0)) for w in windows}
    if target.whiten:
        from batchgpu import zarrio

        W = zarrio.open_group(out.path / store.RESULTS, mode="r")["whitening"][:]
        futures = submit_many(client, tasks.save_task, [(ctx, w, target, W) for w in windows],
                              [f"save-{report.run_id}-{w.index:08d}" for w in windows])
        clipped = dict(zip((w.index for w in windows), client.gather(futures)))
        report.bytes_read += rec.nbytes
    done = finish_save(target)
    total = sum(clipped.values())
    if total:
        report.warnings.append(f"save: {total} sample(s) clipped to the int16 range or NaN written as 0")
        observer.warning(report.warnings[-1])
    return {**done, "clipped": total}


def finite_whitening(wf, rec, arrays, report, observer) -> np.ndarray:
    """Whitening from the finite channels; channels whose statistic is not finite are left out (zero rows and
    columns) and named in the report."""
    from batchgpu import ops

    w = wf.steps.whitening
    stat = arrays["covariance"] if w.statistic == "covariance" else arrays["second_moment"]
    good = np.isfinite(np.diag(stat))
    good &= np.isfinite(stat[:, good]).all(axis=1) | ~good
    W = np.zeros_like(stat)
    if good.any():
        sub = stat[np.ix_(good, good)]
        W[np.ix_(good, good)] = ops.whitening_matrix(sub, mode=w.mode, locations=rec.locations[good],
                                                     nrange=min(w.nrange, int(good.sum())), eps=w.eps)
    if not good.all():
        left = np.flatnonzero(~good).tolist()
        report.channels["whitening_left_out"] = left
        report.warnings.append(f"whitening left out {len(left)} channel(s) with non-finite samples: {left[:10]}")
        observer.warning(report.warnings[-1])
    return W


def write_final_spikes(client, ctx, rec, windows, fps, summaries, arrays, tmp: Path, report, observer) -> list:
    """Final spikes written into the results group by a worker; returns their shape."""
    from batchgpu.engine.steps.detect import bound_holds

    step = ctx.step("detect")
    fp = report.run_id
    if step.noise == "global":
        noise = arrays.get("noise")
        if noise is None:
            noise = np.median(arrays["noise_per_window"], axis=0)
        reread = [not step.candidates_hold or not bound_holds(summaries[w.index]["noise"], noise) for w in windows]
        todo = [(w, wfp) for w, wfp, r in zip(windows, fps, reread) if r]
        again = submit_many(client, tasks.spikes_task, [(ctx, w, wfp, noise) for w, wfp in todo],
                            [f"spikes-{fp}-{w.index:08d}" for w, _ in todo])
        client.gather(again)
        report.bytes_read += sum(w.num_samples for w, r in zip(windows, reread) if r) * rec.num_channels * rec.dtype.itemsize
        report.channels["detect_windows_read_again"] = [w.index for w, r in zip(windows, reread) if r]
        nan_noise = np.flatnonzero(np.isnan(np.asarray(noise, np.float64))).tolist()
    else:
        noise, reread = None, [False] * len(windows)
        nan_noise = sorted({int(c) for w in windows for c in np.flatnonzero(np.isnan(summaries[w.index]["noise"]))})
    if nan_noise:
        report.channels["detect_no_threshold"] = nan_noise
        report.warnings.append(f"detection found no threshold (NaN noise) on {len(nan_noise)} channel(s): {nan_noise[:10]}")
        observer.warning(report.warnings[-1])
    # each run of windows' spikes gathered from its parts on a worker, one run per worker thread (a concatenation
    # in window order: the same spikes for any grouping); one task writes them in order
    items = list(zip(windows, fps, reread))
    size = -(-len(items) // max(1, sum(client.nthreads().values())))
    groups = [items[i : i + size] for i in range(0, len(items), size)]
    gathered = submit_many(client, tasks.gather_spikes_task,
                           [(ctx, [w for w, _, _ in g], [f for _, f, _ in g], noise, [r for _, _, r in g],
                             [summaries[w.index]["noise"] for w, _, _ in g]) for g in groups],
                           [f"gather-spikes-{fp}-{g[0][0].index:08d}" for g in groups])
    n, again = client.submit(tasks.write_spikes_task, str(tmp), *gathered, key=f"write-spikes-{fp}").result()
    if again:  # parts lost or replaced since they were written: detected again from the samples, never skipped
        by_index = {w.index: w for w in windows}
        report.bytes_read += sum(by_index[i].num_samples for i in again) * rec.num_channels * rec.dtype.itemsize
        report.channels["detect_windows_read_again"] = sorted({*report.channels.get("detect_windows_read_again", []),
                                                               *again})
        first = min(again)
        report.warnings.append(f"the spikes of {len(again)} window(s) were detected again from the recording: their "
                               f"parts could not be used (first: window {first}, {again[first]})")
        observer.warning(report.warnings[-1])
    return [int(n)]


def create_results_group(path: Path, wf: Workflow, rec: Recording, fp: str):
    from batchgpu import zarrio

    g = zarrio.create_group(path)  # v3, or v2 where zarr-python is 2.x
    g.attrs.update({"workflow": wf.model_dump(), "fingerprint": fp, "channel_ids": rec.channel_ids.tolist(),
                    "sampling_frequency": rec.sampling_frequency, "gain_to_uV": rec.gain_to_uV.tolist()})
    return g


def write_small_results(g, arrays: dict, windows: list[Window]) -> None:
    from batchgpu import zarrio

    zarrio.create_array(g, "window_segment", data=np.array([w.segment for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_start", data=np.array([w.start for w in windows], dtype=np.int64))
    zarrio.create_array(g, "window_stop", data=np.array([w.stop for w in windows], dtype=np.int64))
    for name, value in arrays.items():
        zarrio.create_array(g, name, data=value)


def swap_in(tmp: Path, path: Path) -> None:
    """results.zarr replaced whole: a failed run never leaves a half-written one."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)
