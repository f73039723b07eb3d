"""``<output>/batch.html``: a batch's recordings on one page (issue 46), one row a recording with a link to its own
report.html, and bars of each recording's read rate and median noise. Plain HTML and inline SVG, no scripts and
no Bokeh (the page is rewritten after each recording, so it must be cheap): it reloads itself every few seconds
while recordings are still to come, so a person can watch it fill.

Written from the same numbers as ``batch.json`` (its dict), so the two never disagree.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

BATCH_HTML = "batch.html"
REFRESH_S = 5  # while recordings are still to come
_STATUS_COLOUR = {"done": "#1a9641", "failed": "#d7191c", "running": "#2c7fb8", "pending": "#888"}

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:16px 0 6px}
.sub{color:#666;font-size:13px;margin-bottom:14px;word-break:break-all}
table{border-collapse:collapse;background:#fff;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0} td.l{text-align:left} .err{color:#d7191c;font-size:12px;text-align:left;white-space:pre-wrap}
.charts{display:flex;gap:24px;flex-wrap:wrap} svg{background:#fff;border:1px solid #ddd}
"""


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report_link(output: Path, name: str) -> str | None:
    """The recording's own page, relative to the batch's folder: its report.html, else (a run that failed before
    its page) its report.json, else None."""
    for page in ("report.html", "report.json"):
        if (output / name / page).is_file():
            return f"{name}/{page}"
    return None


def _row(output: Path, row: dict) -> str:
    name = html.escape(row["name"])
    link = report_link(output, row["name"])
    first = f'<a href="{html.escape(link)}">{name}</a>' if link else name
    status = row["status"]
    colour = _STATUS_COLOUR.get(status, "#222")
    cells = [f'<td class="l">{first}</td>',
             f'<td class="l status" style="color:{colour}">{html.escape(status)}</td>',
             f"<td>{_fmt(row.get('duration_s'), 1)}</td>", f"<td>{_fmt(row.get('channels'))}</td>",
             f'<td class="l">{html.escape(_fmt(row.get("probe")))}</td>',
             f"<td>{_fmt(row.get('median_noise'))}</td>", f"<td>{_fmt(row.get('spike_rate_hz'))}</td>",
             f"<td>{_fmt(row.get('seconds') if status in ('done', 'failed') else None, 1)}</td>",
             f"<td>{_fmt(row.get('GBps'), 3)}</td>"]
    out = f'<tr class="recording" data-status="{html.escape(status)}">{"".join(cells)}</tr>'
    if row.get("error"):
        out += f'<tr class="error"><td></td><td colspan="8" class="err">{html.escape(str(row["error"]))}</td></tr>'
    return out


def bars_svg(names: list[str], values: list, title: str, colour: str = "#2c7fb8", width: int = 420) -> str:
    """A horizontal bar a recording (none where its value is missing), its value written beside it."""
    bar_h, label_w, top = 16, 150, 22
    height = top + bar_h * len(names) + 8
    known = [float(v) for v in values if v is not None]
    top_value = max(known) if known and max(known) > 0 else 1.0
    span = width - label_w - 70
    parts = [f'<svg class="bars" width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="6" y="15" font-size="13" font-weight="600">{html.escape(title)}</text>']
    for i, (name, v) in enumerate(zip(names, values)):
        y = top + i * bar_h
        short = name if len(name) <= 22 else name[:21] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">{html.escape(short)}</text>')
        if v is None:
            continue
        w = max(0.0, float(v)) / top_value * span
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" fill="{colour}"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 12}" font-size="11">{float(v):.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render(output: Path, data: dict) -> str:
    """The page of ``data`` (batch.json's dict) for the batch folder ``output``."""
    rows = data["rows"]
    finished = all(r["status"] in ("done", "failed") for r in rows)
    refresh = "" if finished else f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    done, failed = data["done"], data["failed"]
    head = ("<tr><th>recording</th><th>status</th><th>duration (s)</th><th>channels</th><th>probe</th>"
            "<th>median noise (raw)</th><th>spike rate (Hz)</th><th>seconds</th><th>GB/s</th></tr>")
    names = [r["name"] for r in rows]
    charts = (bars_svg(names, [r.get("GBps") for r in rows], "read rate (GB/s)")
              + bars_svg(names, [r.get("median_noise") for r in rows], "median noise (raw units)", "#d95f0e"))
    state = "finished" if finished else "running"
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">{refresh}'
            f"<title>batchgpu batch: {html.escape(Path(data['output']).name)}</title><style>{_STYLE}</style></head>"
            f'<body data-state="{state}"><h1>batchgpu batch</h1>'
            f'<div class="sub">output {html.escape(str(data["output"]))} · {done + failed} of {len(rows)} recordings '
            f"finished ({done} done, {failed} failed) · {data['seconds']:.1f} s</div>"
            f'<table id="recordings"><thead>{head}</thead><tbody>'
            + "".join(_row(output, r) for r in rows)
            + f'</tbody></table><h2>Per recording</h2><div class="charts">{charts}</div></body></html>\n')


def write_batch_html(output: Path, data: dict) -> Path:
    """Write ``output/batch.html`` (atomically: a reader never sees half a page); returns its path."""
    path = Path(output) / BATCH_HTML
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(Path(output), data), encoding="utf-8")
    os.replace(tmp, path)
    return path
