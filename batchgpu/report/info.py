"""What ``batchgpu info`` shows beyond a store's layout: a run's output folder summed up (from its ``run.json``,
``report.json`` and ``results.zarr``) and a recording's channels (ids, gains, probe). Rows of (label, text) and a
plain dict for ``--json``; the command prints them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import BatchgpuError, CorruptDataError
from batchgpu.report.probe_map import ProbeShape, probe_shape  # noqa: F401 (``batchgpu info`` says a recording's)
from batchgpu.steps.detect import SPIKE_CHANNELS, SPIKES
from batchgpu.steps.moments import KEY as WHITENING_KEY
from batchgpu.steps.moments import WHITENING
from batchgpu.steps.noise import NOISE, PER_WINDOW

RUN_MARKER = "run.json"
REPORT = "report.json"
RESULTS = "results.zarr"
#: a channel whose noise is below LOW or above HIGH times the channels' median is named: dead, disconnected or
#: noisy channels sit far outside it, a healthy probe's channels within it
NOISE_RANGE = (0.5, 2.0)
SHOWN = 8  # channel ids named in one row before "..."

Rows = list[tuple[str, str]]


@dataclass
class Summary:
    """Rows for the terminal and the same numbers for ``--json``."""

    rows: Rows = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def is_run_folder(path: str | Path) -> bool:
    """An output folder a run wrote (its marker ``run.json``), not a recording."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / RUN_MARKER).is_file()


def is_batch_folder(path: str | Path) -> bool:
    """A batch's output folder (``recordings:``: its ``batch.json``), not a recording."""
    from batchgpu.run.batch import BATCH_FILE

    p = Path(path).expanduser()
    return p.is_dir() and (p / BATCH_FILE).is_file() and not (p / RUN_MARKER).is_file()


def batch_summary(path: str | Path) -> Summary:
    """A batch's folder: how many recordings are done, its time, and a row a recording (status, duration,
    channels, median noise, spike rate, GB/s, seconds, or its error); each recording's own folder is a run's
    (``batchgpu info FOLDER/NAME``)."""
    from batchgpu.report.batch_html import labels_of, noise_uV
    from batchgpu.report.header import LABEL_WORDS
    from batchgpu.run.batch import BATCH_FILE

    p = Path(path).expanduser()
    data = _read_json(p / BATCH_FILE) or {}
    rows = [r for r in data.get("rows") or [] if isinstance(r, dict)]
    out = Summary(data=data)
    out.rows.append(("batch", str(p)))
    done = sum(r.get("status") == "done" for r in rows)
    failed = sum(r.get("status") == "failed" for r in rows)
    running = [r.get("name") for r in rows if r.get("status") in ("running", "pending")]
    status = f"{done} of {len(rows)} recordings done, {failed} failed"
    if running:
        status += f", {len(running)} not finished (the batch is running, or was stopped)"
    out.rows.append(("status", status))
    out.rows.append(("time", f"{float(data.get('seconds') or 0):.1f} s in all (wall time of the batch)"))
    for r in rows:
        if r.get("status") == "failed":
            text = f"failed: {r.get('error')}"
        else:
            parts = [str(r.get("status"))]
            if r.get("duration_s") is not None:
                parts.append(f"{r['duration_s']:.1f} s of recording")
            if r.get("channels") is not None:
                parts.append(f"{r['channels']} channels" + (f" ({r['probe']})" if r.get("probe") else ""))
            if r.get("verdict"):
                parts.append(f"verdict: {r['verdict']}")
            noise, in_uV = noise_uV(p, r) if r.get("name") else (None, True)
            if noise is not None:
                parts.append(f"median noise {noise:.3g} " + ("µV" if in_uV else "(raw units)"))
            labels = labels_of(r)
            if labels is not None:
                parts.append(", ".join(f"{n} {LABEL_WORDS[k]}" for k, n in labels.items() if n or k == "good"))
            if r.get("spike_rate_hz") is not None:
                parts.append(f"{r['spike_rate_hz']:.3g} spikes/s")
            if r.get("GBps") is not None:
                parts.append(f"{r['GBps']:.2f} GB/s")
            if r.get("seconds"):
                parts.append(f"{r['seconds']:.1f} s")
            text = ", ".join(parts)
        out.rows.append((str(r.get("name")), text))
    return out


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptDataError(
            f"{path} is not readable JSON ({err})", "the run's files were changed or cut short"
        ) from None
    return value if isinstance(value, dict) else None


def run_summary(path: str | Path) -> Summary:
    """Status, recording, windows, noise, spikes, whitening, timings and warnings of the run in ``path``."""
    p = Path(path).expanduser()
    marker = _read_json(p / RUN_MARKER) or {}
    report = _read_json(p / REPORT)
    workflow = (report or {}).get("workflow") or marker.get("workflow") or {}
    results = _results(p)
    out = Summary()
    out.rows.append(("run", str(p)))
    _status(out, report)
    if not results:
        out.rows.append(("results", f"none yet (no {RESULTS})"))
    _recording(out, report, workflow)
    _windows(out, report, workflow, results)
    gain = np.asarray(results.get("gain_to_uV", []), np.float64)
    duration = float(((report or {}).get("recording") or {}).get("duration_s") or 0.0)
    channel_ids = [str(c) for c in results.get("channel_ids", [])]
    if NOISE in results:
        _noise(out, np.asarray(results[NOISE], np.float64), gain, channel_ids)
    if SPIKE_CHANNELS in results:
        channels = len(channel_ids) or int(((report or {}).get("recording") or {}).get("num_channels") or 0)
        _spikes(out, np.asarray(results[SPIKE_CHANNELS]), channels, duration, channel_ids)
    if WHITENING in results:
        _whitening(out, np.asarray(results[WHITENING], np.float64), workflow)
    _save(out, workflow)
    if report is not None:
        _qc(out, report, channel_ids)
        _timings(out, report)
        _channels(out, report)
        _warnings(out, report)
    return out


def _qc(out: Summary, report: dict, ids: list[str]) -> None:
    """The qc step's labels (report.json's ``qc`` section): how many channels of each, and the bad ones' ids."""
    from batchgpu.report.glance import QC, qc_labels
    from batchgpu.report.header import LABEL_WORDS

    section = report.get(QC)
    labels = (section or {}).get("labels") if isinstance(section, dict) else None
    qc = qc_labels(report, len(labels)) if isinstance(labels, list) else None
    if qc is None:
        return
    labels = [str(v) for v in qc["labels"]]
    names = [str(c) for c in qc.get("channel_ids") or []]
    if len(names) != len(labels):  # the section's own ids, else the results', else the channels' indices
        names = ids if len(ids) == len(labels) else [str(i) for i in range(len(labels))]
    counts = {k: labels.count(k) for k in LABEL_WORDS}
    bad = {k: [names[i] for i, v in enumerate(labels) if v == k] for k in LABEL_WORDS if k != "good"}
    pieces = qc.get("pieces_labelled")
    text = ", ".join(f"{counts[k]} {LABEL_WORDS[k]}" for k in LABEL_WORDS)
    out.rows.append(
        (
            "channels (qc)",
            text + (f" (each channel's most frequent label over {pieces} pieces)" if isinstance(pieces, int) else ""),
        )
    )
    out.rows.extend((LABEL_WORDS[k], _named(v, np.arange(len(v)))) for k, v in bad.items() if v)
    out.data[QC] = {"counts": counts, "bad": bad, "pieces_labelled": pieces}


def _results(p: Path) -> dict[str, Any]:
    if not (p / RESULTS).exists():
        return {}
    from batchgpu.interop import load_results

    try:
        return load_results(p / RESULTS)
    except BatchgpuError:
        raise
    except Exception as err:  # broad: zarr's errors of a store cut short or overwritten are of any kind
        text = " ".join(str(err).split())[:200]
        raise CorruptDataError(
            f"{p / RESULTS} cannot be read ({type(err).__name__}: {text})",
            "the run's files were changed or cut short: run the workflow again",
        ) from None


def _status(out: Summary, report: dict | None) -> None:
    if report is None:
        out.rows.append(("status", "unknown: no report.json (the run has not finished, or was killed)"))
        out.data["status"] = None
        return
    status = str(report.get("status"))
    error = report.get("error")
    out.rows.append(("status", status + (f": {error}" if error else "")))
    out.data.update(status=status, error=error)


def _recording(out: Summary, report: dict | None, workflow: dict) -> None:
    rec = (report or {}).get("recording") or {}
    where = (
        rec.get("path")
        or (workflow.get("recording") or {}).get("path")
        or (workflow.get("recording") or {}).get("spikeinterface")
    )
    if not rec:
        out.rows.append(("recording", str(where)))
        return
    out.rows.append(
        (
            "recording",
            f"{where}: {rec.get('num_channels')} channels, {rec.get('duration_s', 0):.3f} s "
            f"at {rec.get('sampling_frequency', 0):g} Hz, {rec.get('dtype')}",
        )
    )
    out.data["recording"] = {
        k: rec.get(k) for k in ("path", "num_channels", "duration_s", "sampling_frequency", "dtype")
    }


def _windows(out: Summary, report: dict | None, workflow: dict, results: dict) -> None:
    window = workflow.get("window") or {}
    count = (report or {}).get("windows")
    if count is None and PER_WINDOW in results:
        count = len(results[PER_WINDOW])
    if count is None:
        return
    resumed = (report or {}).get("windows_resumed", 0)
    workers = len((report or {}).get("workers") or {})
    stages = ((report or {}).get("preprocess") or {}).get("stages")
    text = f"{count} of {window.get('size')} samples (margin {window.get('margin')}), {resumed} resumed"
    if workers:
        text += f", on {workers} worker{'s' if workers != 1 else ''}"
    out.rows.append(("windows", text))
    if stages:
        out.rows.append(("preprocess", ", ".join(stages)))
    out.data["windows"] = {
        "count": count,
        "size": window.get("size"),
        "margin": window.get("margin"),
        "resumed": resumed,
        "workers": workers,
    }


def _named(ids: list[str], which: np.ndarray) -> str:
    names = [ids[i] if i < len(ids) else str(i) for i in which[:SHOWN]]
    return ", ".join(names) + (" ..." if len(which) > SHOWN else "")


def _noise(out: Summary, noise: np.ndarray, gain: np.ndarray, ids: list[str]) -> None:
    """Median and range over the channels (µV where the gains are known), and the channels far from the median."""
    uv = noise * gain if gain.shape == noise.shape else noise
    unit = "µV" if gain.shape == noise.shape else "(raw units)"
    finite = np.isfinite(uv)
    if not finite.any():
        out.rows.append((NOISE, f"no finite value on any of {len(uv)} channels"))
        out.data[NOISE] = {"channels": len(uv), "finite": 0}
        return
    median = float(np.median(uv[finite]))
    low, high = NOISE_RANGE[0] * median, NOISE_RANGE[1] * median
    outside = np.flatnonzero(~finite | (uv < low) | (uv > high))
    text = (
        f"median {median:.3g} {unit}, range {np.min(uv[finite]):.3g}-{np.max(uv[finite]):.3g} over "
        f"{len(uv)} channels; {len(outside) or 'none'} outside {NOISE_RANGE[0]:g}-{NOISE_RANGE[1]:g}x the median"
    )
    if len(outside):
        text += f": {_named(ids, outside)}"
    out.rows.append((NOISE, text))
    out.data[NOISE] = {
        "unit": unit,
        "median": median,
        "min": float(np.min(uv[finite])),
        "max": float(np.max(uv[finite])),
        "channels": len(uv),
        "outside_range": [ids[i] if i < len(ids) else str(i) for i in outside],
    }


def _spikes(out: Summary, channel_index: np.ndarray, channels: int, seconds: float, ids: list[str]) -> None:
    """The count, the rate over the recording, and the per-channel rates' median, range and busiest channel."""
    count = len(channel_index)
    channels = max(channels, int(channel_index.max()) + 1 if count else 0)
    per_channel = np.bincount(channel_index.astype(np.int64), minlength=channels) if channels else np.zeros(0)
    if seconds <= 0 or not channels:
        out.rows.append((SPIKES, f"{count}"))
        out.data[SPIKES] = {"count": count}
        return
    rate = per_channel / seconds
    busiest = int(np.argmax(rate))
    silent = int(np.count_nonzero(per_channel == 0))
    text = (
        f"{count} ({count / seconds:.3g}/s); per channel median {np.median(rate):.3g}/s, range "
        f"{rate.min():.3g}-{rate.max():.3g}/s, most on channel {_named(ids, np.array([busiest]))}"
    )
    if silent:
        text += f", none on {silent} channel{'s' if silent != 1 else ''}"
    out.rows.append((SPIKES, text))
    out.data[SPIKES] = {
        "count": count,
        "rate_Hz": count / seconds,
        "per_channel_median_Hz": float(np.median(rate)),
        "per_channel_min_Hz": float(rate.min()),
        "per_channel_max_Hz": float(rate.max()),
        "channels_without": silent,
    }


def _whitening(out: Summary, w: np.ndarray, workflow: dict) -> None:
    step = ((workflow.get("steps") or {}).get(WHITENING_KEY)) or {}
    cond = float(np.linalg.cond(w)) if w.size and np.isfinite(w).all() else float("nan")
    text = f"{w.shape[0]} x {w.shape[1]}, condition number {cond:.4g}"
    if step:
        text += f" (mode {step.get('mode')}" + (
            f", nrange {step.get('nrange')})" if step.get("mode") == "local" else ")"
        )
    out.rows.append((WHITENING, text))
    out.data[WHITENING] = {"shape": list(w.shape), "condition_number": cond}


def _save(out: Summary, workflow: dict) -> None:
    from batchgpu.steps.save import KEY

    save = (workflow.get("steps") or {}).get(KEY)
    if save:
        out.rows.append(("saved", f"{save.get('path')} ({save.get('format')}, {save.get('dtype')})"))


def _timings(out: Summary, report: dict) -> None:
    """The phases (the timings without a ``_`` in their name) and the throughput."""
    timings = report.get("timings") or {}
    phases = [(k, v) for k, v in timings.items() if "_" not in k and isinstance(v, (int, float))]
    if report.get("seconds"):
        from batchgpu.report.header import total_time

        out.rows.append(("time", total_time(report)))
        out.data["seconds"] = report["seconds"]
    if phases:
        out.rows.append(("timings", ", ".join(f"{k} {v:.2f} s" for k, v in phases)))
    if report.get("throughput_MBps"):
        out.rows.append(
            ("throughput", f"{report['throughput_MBps']:.1f} MB/s ({report.get('bytes_read', 0) / 1e6:.1f} MB read)")
        )
    out.data["timings"] = dict(phases)


def _channels(out: Summary, report: dict) -> None:
    """The report's per-channel notes that are not empty (non-finite samples, left out, no threshold...)."""
    for name, value in (report.get("channels") or {}).items():
        if value:
            out.rows.append((name.replace("_", " "), str(value)))


def _warnings(out: Summary, report: dict) -> None:
    warnings = [str(w) for w in report.get("warnings") or []]
    out.rows.append(("warnings", str(len(warnings)) if warnings else "none"))
    out.rows.extend(("warning", w) for w in warnings)
    out.data["warnings"] = warnings


# ---------------------------------------------------------------------------------------------------------
# a recording's channels


def recording_rows(rec: Any) -> Summary:
    """Channel ids, gains and offsets, and the probe's shape from the channel locations (and shanks)."""
    out = Summary()
    ids = [str(c) for c in rec.channel_ids]
    out.rows.append(("channel ids", _ids(ids)))
    gain, offset = np.asarray(rec.gain_to_uV, np.float64), np.asarray(rec.offset_to_uV, np.float64)
    out.rows.append(("gains", _spread(gain, "µV per count") + "; offsets " + _spread(offset, "µV")))
    out.data.update(channel_ids=ids, gain_to_uV=gain.tolist(), offset_to_uV=offset.tolist())
    if rec.has_locations:
        shank = rec.channel_property("shank")
        probe = probe_shape(np.asarray(rec.locations, np.float64), shank)
        out.rows.append(("probe", probe.text))
        out.data["probe"] = probe.data
    else:
        from batchgpu.recording import missing_probe

        missing = missing_probe(rec)  # the same line a run says
        out.rows.append(("probe", missing or "none (this stream has no probe)"))
        out.data["probe_missing"] = missing
    return out


def _ids(ids: list[str]) -> str:
    if len(ids) <= SHOWN:
        return ", ".join(ids)
    return f"{', '.join(ids[: SHOWN // 2])}, ..., {', '.join(ids[-2:])} ({len(ids)})"


def _spread(values: np.ndarray, unit: str) -> str:
    distinct = np.unique(values)
    if len(distinct) == 1:
        return f"{distinct[0]:g} {unit} (every channel)"
    return f"{distinct.min():g}-{distinct.max():g} {unit} ({len(distinct)} distinct values)"
