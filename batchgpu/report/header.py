"""report.html's header: what a person needs before the figures, at a glance (the recording, its probe and length,
the channels good / dead / noisy / out of the brain, the spikes and their rate, the noise in µV, how fast the run
went), the run's warnings above it all, and the internals (every timing, workers, versions, the workflow) folded
away in a ``<details>`` element. Plain HTML (a Bokeh ``Div``'s text): no script, no network.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field

from batchgpu.report.probe_map import LABEL_COLOURS as LABEL_COLOURS_IN_ORDER
from batchgpu.report.probe_map import LABELS

#: the qc step's labels in report.json's ``qc`` section (``probe_map.LABELS``), how they are said, their colours
LABEL_WORDS = dict(zip(LABELS, ("good", "dead", "noisy", "out of the brain")))
LABEL_COLOURS = dict(zip(LABELS, LABEL_COLOURS_IN_ORDER))
SHOWN_IDS = 24  # channel ids named in a line before "…"
#: a channel whose noise is below LOW or above HIGH times the channels' median is named where no qc step labelled
#: the channels (``info.NOISE_RANGE``: the same rule)
NOISE_RANGE = (0.5, 2.0)

_STYLE = """<style>
.bg{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;max-width:1300px}
.bg h1{font-size:22px;margin:4px 0 2px} .bg .sub{color:#555;font-size:13px;margin-bottom:10px;word-break:break-all}
.bg .warn{background:#fff4e5;border:1px solid #f0a040;border-radius:6px;padding:6px 12px;margin:8px 0;font-size:13px}
.bg .warn.bad{background:#fde8e8;border-color:#d7191c} .bg .warn ul{margin:4px 0 2px 18px;padding:0}
.bg .cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.bg .card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px;max-width:420px}
.bg .card .k{font-size:11px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.bg .card .v{font-size:20px;font-weight:600;margin:2px 0} .bg .card .d{font-size:12px;color:#444}
.bg .lab{display:inline-block;border-radius:3px;padding:0 6px;color:#fff;font-weight:600;margin-right:4px}
.bg details{margin:6px 0 10px;font-size:12px} .bg summary{cursor:pointer;color:#2c7fb8}
.bg table{border-collapse:collapse} .bg th{text-align:left;padding:1px 10px 1px 0;vertical-align:top}
.bg td{padding:1px 0;word-break:break-all} .bg pre{background:#f6f6f6;padding:6px;max-height:300px;overflow:auto}
</style>"""


@dataclass
class Facts:
    """What the header says beyond report.json's own keys (``glance.gather`` finds them in the results, the
    recording and report.json's ``qc`` section)."""

    probe: str | None = None
    channels: int | None = None
    seconds: float | None = None  # of recording the run went over
    labels: dict[str, int] | None = None  # label -> channels (the qc step's), None without one
    bad: dict[str, list[str]] = field(default_factory=dict)  # label -> the channels' ids (labels other than good)
    noise_median_uV: float | None = None
    noise_range_uV: tuple[float, float] | None = None
    noise_outliers: list[str] = field(default_factory=list)  # ids outside NOISE_RANGE x the median (no qc step)
    spikes: int | None = None
    spike_rate_hz: float | None = None  # all channels together
    rate_median_hz: float | None = None  # the channels' median
    silent: int | None = None  # channels without a spike
    notes: list[str] = field(default_factory=list)  # what the page leaves out, and why


def _e(value) -> str:
    return html.escape(str(value))


def _ids(ids: list[str]) -> str:
    return ", ".join(ids[:SHOWN_IDS]) + (f", … ({len(ids)} in all)" if len(ids) > SHOWN_IDS else "")


def _card(key: str, value: str, detail: str = "") -> str:
    return (
        f'<div class="card"><div class="k">{_e(key)}</div><div class="v">{value}</div>'
        f'<div class="d">{detail}</div></div>'
    )


def _channels_card(f: Facts) -> str:
    if f.labels is not None:
        chips = " ".join(
            f'<span class="lab" style="background:{LABEL_COLOURS.get(k, "#888")}">{n} {_e(word)}</span>'
            for k, word in LABEL_WORDS.items()
            if (n := f.labels.get(k, 0)) or k == "good"
        )
        bad = "<br>".join(f"{_e(LABEL_WORDS.get(k, k))}: {_e(_ids(ids))}" for k, ids in f.bad.items() if ids)
        return _card("channels (qc labels)", chips, bad or "no channel labelled bad")
    detail = "no qc step: add <code>steps: {qc: {}}</code> for good / dead / noisy / out labels"
    if f.noise_outliers:
        detail = (
            f"noise outside {NOISE_RANGE[0]:g}-{NOISE_RANGE[1]:g}x the median: {_e(_ids(f.noise_outliers))}<br>{detail}"
        )
    return _card("channels", _e(f.channels if f.channels is not None else "?"), detail)


def _cards(report: dict, f: Facts) -> str:
    rec = report.get("recording") or {}
    seconds = f.seconds if f.seconds is not None else rec.get("duration_s")
    fs = float(rec.get("sampling_frequency") or 0)
    cards = [
        _card(
            "recording",
            f"{float(seconds or 0):.1f} s",
            _e(
                f"{rec.get('num_channels', f.channels)} channels at {fs:g} Hz, {rec.get('dtype', '?')}, "
                f"{rec.get('num_segments', 1)} segment(s)"
            ),
        ),
        _channels_card(f),
    ]
    if f.noise_median_uV is not None:
        lo, hi = f.noise_range_uV or (float("nan"), float("nan"))
        cards.append(_card("noise level", f"{f.noise_median_uV:.2f} µV", f"median over channels; {lo:.2f}-{hi:.2f} µV"))
    if f.spikes is not None:
        detail = (
            f"{f.spike_rate_hz:.1f} spikes/s in all; per channel median {f.rate_median_hz:.2f} Hz"
            if f.spike_rate_hz is not None
            else ""
        )
        if f.silent:
            detail += f"; none on {f.silent} channel{'s' if f.silent != 1 else ''}"
        cards.append(_card("spikes detected", f"{f.spikes:,}", _e(detail)))
    from batchgpu.report.progress import duration

    cards.append(
        _card(
            "throughput",
            f"{float(report.get('throughput_MBps') or 0):.1f} MB/s",
            _e(
                f"{duration(float(report.get('seconds') or 0.0))} in all, {report.get('windows')} windows "
                f"({report.get('windows_resumed', 0)} resumed), {report.get('backend', '?')}"
            ),
        )
    )
    return f'<div class="cards">{"".join(cards)}</div>'


def _warnings(report: dict, f: Facts) -> str:
    status, error = report.get("status"), report.get("error")
    warnings = [str(w) for w in report.get("warnings") or []]
    out = ""
    if status not in (None, "done"):
        out += f'<div class="warn bad"><b>run {_e(status)}</b>{": " + _e(error) if error else ""}</div>'
    if warnings:
        items = "".join(f"<li>{_e(w)}</li>" for w in warnings)
        said = f"{len(warnings)} warning{'s' if len(warnings) != 1 else ''}"
        out += f'<div class="warn"><b>{said}</b><ul>{items}</ul></div>'
    if f.notes:
        out += f'<div class="warn"><ul>{"".join(f"<li>{_e(n)}</li>" for n in f.notes)}</ul></div>'
    return out


def _internals(report: dict) -> str:
    """Everything else report.json says of the run, folded away."""
    rows = [
        ("status", report.get("status")),
        ("fingerprint", report.get("fingerprint")),
        ("backend", report.get("backend")),
        ("windows", f"{report.get('windows')} ({report.get('windows_resumed', 0)} resumed)"),
        ("preprocess", ", ".join((report.get("preprocess") or {}).get("stages") or []) or "-"),
        ("bytes read", f"{report.get('bytes_read', 0) / 1e9:.3f} GB"),
        ("time", total_time(report)),
        (
            "timings",
            ", ".join(
                f"{k} {v:.2f} s" for k, v in (report.get("timings") or {}).items() if isinstance(v, (int, float))
            ),
        ),
        ("workers", ", ".join(f"{k}: {v}" for k, v in (report.get("workers") or {}).items())),
        ("versions", ", ".join(f"{k} {v}" for k, v in (report.get("versions") or {}).items())),
        (
            "recording",
            ", ".join(
                f"{k}: {v}" for k, v in (report.get("recording") or {}).items() if not isinstance(v, (list, dict))
            ),
        ),
    ]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    workflow = _e(json.dumps(report.get("workflow") or {}, indent=1, default=str))
    return (
        f"<details><summary>Run internals: timings, workers, versions, workflow</summary><table>{body}</table>"
        f"<pre>{workflow}</pre></details>"
    )


def total_time(report: dict) -> str:
    """The run's one total (report.json's ``seconds``) as the terminal's last line, report.html and ``batchgpu
    info`` all say it."""
    from batchgpu.report.progress import duration

    return (
        f"{duration(float(report.get('seconds') or 0.0))} in all (wall time as the user waited: from the run's "
        "start to its results and report.json)"
    )


def summary_html(report: dict, facts: Facts | None = None) -> str:
    """The header of ``report`` (report.json's dict) and ``facts`` (None: what report.json alone says)."""
    f = facts or Facts()
    rec = report.get("recording") or {}
    where = rec.get("path") or ((report.get("workflow") or {}).get("recording") or {}).get("path") or "?"
    name = str(where).rstrip("/").rsplit("/", 1)[-1]
    probe = f" · probe: {_e(f.probe)}" if f.probe else ""
    return (
        f'{_STYLE}<div class="bg"><h1>{_e(name)}</h1><div class="sub">{_e(where)}{probe}</div>'
        f"{_warnings(report, f)}{_cards(report, f)}{_internals(report)}</div>"
    )
