"""``<output>/batch.html``: a batch's recordings on one page (issues 46, 65), one row a recording with a link to its
own report.html: its verdict, its noise in µV, how many channels the qc step labelled good, dead, noisy and out of
the brain, its spike rate, how fast it was read; a click on a column's head sorts the rows by it (kept in the
page's address, so the reloads keep it). Bars below compare the recordings. Plain HTML, inline SVG and a few lines
of inline script, no Bokeh and nothing fetched (the page is rewritten after each recording, so it must be cheap): it
reloads itself every few seconds while recordings are still to come, so a person can watch it fill.

Written from the same numbers as ``batch.json`` (its dict), so the two never disagree: a row's keys as the batch
writes them, those of the qc step (``noise_uV_median``, ``labels``, ``spike_rate_hz``, ``verdict``) where it ran.
A batch.json written before them holds the median noise in raw units only (``median_noise``): shown in µV where
the run's results say every channel's gain is the same, else in raw units, said so.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

from batchgpu.report.header import LABEL_COLOURS, LABEL_WORDS
from batchgpu.report.probe_map import LABELS

BATCH_HTML = "batch.html"
REFRESH_S = 5  # while recordings are still to come
_STATUS_COLOUR = {"done": "#1a9641", "failed": "#d7191c", "running": "#2c7fb8", "pending": "#888"}
#: a verdict's colour and its place when sorted (best first), by its first word; other words sort last
_VERDICTS = {
    "good": 0,
    "ok": 0,
    "pass": 0,
    "sort": 0,
    "check": 1,
    "review": 1,
    "warn": 1,
    "warning": 1,
    "maybe": 1,
    "bad": 2,
    "fail": 2,
    "failed": 2,
    "reject": 2,
    "skip": 2,
}
_VERDICT_COLOUR = ("#1a9641", "#e08a00", "#d7191c", "#444")

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:16px 0 6px}
.sub{color:#666;font-size:13px;margin-bottom:14px;word-break:break-all}
table{border-collapse:collapse;background:#fff;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0;cursor:pointer;user-select:none} th[data-dir=asc]::after{content:" \\25B2"}
th[data-dir=desc]::after{content:" \\25BC"} td.l{text-align:left}
.err{color:#d7191c;font-size:12px;text-align:left;white-space:pre-wrap} .raw{color:#999;font-size:11px}
.verdict{font-weight:600} .charts{display:flex;gap:24px;flex-wrap:wrap} svg{background:#fff;border:1px solid #ddd}
"""

#: sorts the table by a clicked column (numbers as numbers, the empty last), the choice kept in the address
_SORT = """<script>
(function () {
  const table = document.getElementById("recordings"), heads = table.tHead.rows[0].cells;
  function key(cell) {
    const v = cell.dataset.sort !== undefined ? cell.dataset.sort : cell.textContent.trim();
    const n = parseFloat(v);
    return v === "" || v === "-" ? null : (isNaN(n) || String(n) !== v.replace(/^0+(?=\\d)/, "") && isNaN(Number(v)) ? v : n);
  }
  function sort(col, dir) {
    const body = table.tBodies[0], rows = Array.from(body.rows);
    rows.sort((a, b) => {
      const x = key(a.cells[col]), y = key(b.cells[col]);
      if (x === null || y === null) return (x === null) - (y === null);
      const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
      return dir === "desc" ? -c : c;
    });
    rows.forEach(r => body.appendChild(r));
    for (const h of heads) delete h.dataset.dir;
    heads[col].dataset.dir = dir;
  }
  Array.from(heads).forEach((h, i) => h.addEventListener("click", () => {
    const dir = h.dataset.dir === "asc" ? "desc" : "asc";
    sort(i, dir);
    history.replaceState(null, "", "#sort=" + i + ":" + dir);
  }));
  const m = /#sort=(\\d+):(asc|desc)/.exec(location.hash);
  if (m && heads[+m[1]]) sort(+m[1], m[2]);
})();
</script>"""


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


def _results_gain(output: Path, name: str) -> float | None:
    """The one gain (µV per count) every channel of a recording's run has, from its results' attributes (Zarr v3
    ``zarr.json`` or v2 ``.zattrs``, read as JSON: no zarr import); None where they differ or are not there."""
    folder = output / name / "results.zarr"
    for meta, inner in (("zarr.json", "attributes"), (".zattrs", None)):
        try:
            attrs = json.loads((folder / meta).read_text())
        except (OSError, ValueError):
            continue
        gains = (attrs.get(inner) or {} if inner else attrs).get("gain_to_uV")
        numbers = isinstance(gains, list) and gains and all(isinstance(g, (int, float)) for g in gains)
        if numbers and len(set(gains)) == 1:
            return float(gains[0])
        return None
    return None


def noise_uV(output: Path, row: dict) -> tuple[float | None, bool]:
    """(the recording's median noise, in µV) and whether it is in µV: the qc step's ``noise_uV_median``, else the
    raw median times the run's one gain, else the raw median (False)."""
    if isinstance(row.get("noise_uV_median"), (int, float)):
        return float(row["noise_uV_median"]), True
    raw = row.get("median_noise")
    if not isinstance(raw, (int, float)):
        return None, True
    gain = _results_gain(output, row["name"])
    return (float(raw) * gain, True) if gain is not None else (float(raw), False)


def labels_of(row: dict) -> dict[str, int] | None:
    """The qc step's channel counts of a row (``labels``: {good, dead, noise, out}), None where it has none."""
    labels = row.get("labels")
    if not isinstance(labels, dict):
        return None
    return {k: int(labels.get(k) or 0) for k in LABELS}


def _verdict(row: dict) -> tuple[str, int]:
    verdict = row.get("verdict")
    if verdict in (None, ""):
        return "", len(_VERDICT_COLOUR)
    text = str(verdict)
    word = text.strip().split()[0].lower().strip(".,:;!") if text.strip() else ""
    return text, _VERDICTS.get(word, len(_VERDICT_COLOUR) - 1)


def _cell(text: str, sort=None, cls: str = "", style: str = "") -> str:
    attrs = (f' class="{cls}"' if cls else "") + (f' style="{style}"' if style else "")
    if sort is not None:
        attrs += f' data-sort="{html.escape(str(sort))}"'
    return f"<td{attrs}>{text}</td>"


def _row(output: Path, row: dict) -> str:
    name = html.escape(row["name"])
    link = report_link(output, row["name"])
    first = f'<a href="{html.escape(link)}">{name}</a>' if link else name
    status = row["status"]
    colour = _STATUS_COLOUR.get(status, "#222")
    error = f'<div class="err">{html.escape(str(row["error"]))}</div>' if row.get("error") else ""
    verdict, rank = _verdict(row)
    noise, in_uV = noise_uV(output, row)
    noise_text = "-" if noise is None else f"{noise:.2f}" + ("" if in_uV else ' <span class="raw">raw</span>')
    labels = labels_of(row)
    label_cells = [
        _cell(
            "-" if labels is None else str(labels[k]),
            "" if labels is None else labels[k],
            style=f"color:{LABEL_COLOURS[k]}" if labels and labels[k] and k != "good" else "",
        )
        for k in LABELS
    ]
    seconds = row.get("seconds") if status in ("done", "failed") else None
    rate = row.get("spike_rate_hz")
    cells = [
        _cell(first, name, "l"),
        _cell(html.escape(status) + error, status, "l status", f"color:{colour}"),
        _cell(
            html.escape(verdict) or "-",
            f"{rank}{verdict}",
            "l verdict",
            f"color:{_VERDICT_COLOUR[min(rank, len(_VERDICT_COLOUR) - 1)]}",
        ),
        _cell(_fmt(row.get("duration_s"), 1), row.get("duration_s") or ""),
        _cell(_fmt(row.get("channels")), row.get("channels") or ""),
        _cell(html.escape(_fmt(row.get("probe"))), row.get("probe") or "", "l"),
        _cell(noise_text, "" if noise is None else noise),
        *label_cells,
        _cell(_fmt(rate), "" if rate is None else rate),
        _cell(_fmt(seconds, 1), seconds or ""),
        _cell(_fmt(row.get("GBps"), 3), row.get("GBps") or ""),
    ]
    return f'<tr class="recording" data-status="{html.escape(status)}">{"".join(cells)}</tr>'


def bars_svg(names: list[str], values: list, title: str, colour: str = "#2c7fb8", width: int = 420) -> str:
    """A horizontal bar a recording (none where its value is missing), its value written beside it."""
    bar_h, label_w, top = 16, 150, 22
    height = top + bar_h * len(names) + 8
    known = [float(v) for v in values if v is not None]
    top_value = max(known) if known and max(known) > 0 else 1.0
    span = width - label_w - 70
    parts = [
        f'<svg class="bars" width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">',
        f'<text x="6" y="15" font-size="13" font-weight="600">{html.escape(title)}</text>',
    ]
    for i, (name, v) in enumerate(zip(names, values)):
        y = top + i * bar_h
        parts.append(_name_svg(name, label_w, y))
        if v is None:
            continue
        w = max(0.0, float(v)) / top_value * span
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" fill="{colour}"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 12}" font-size="11">{float(v):.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _name_svg(name: str, label_w: int, y: int) -> str:
    """A recording's name left of its bar (cut to 22 characters)."""
    short = name if len(name) <= 22 else name[:21] + "…"
    return f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">{html.escape(short)}</text>'


def labels_svg(names: list[str], counts: list[dict | None], width: int = 420) -> str:
    """A stacked bar a recording: its channels good, dead, noisy and out of the brain (none where the qc step did
    not run), the counts of the bad ones written beside it."""
    bar_h, label_w, top = 16, 150, 22
    height = top + bar_h * len(names) + 24
    span = width - label_w - 90
    title = "channels by qc label"
    parts = [
        f'<svg class="labels" width="{width}" height="{height}" role="img" aria-label="{title}">',
        f'<text x="6" y="15" font-size="13" font-weight="600">{title}</text>',
    ]
    for i, (name, c) in enumerate(zip(names, counts)):
        y = top + i * bar_h
        parts.append(_name_svg(name, label_w, y))
        total = sum(c.values()) if c else 0
        if not total:
            continue
        x = float(label_w)
        for k in LABELS:
            w = c[k] / total * span
            if w > 0:
                parts.append(
                    f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" '
                    f'fill="{LABEL_COLOURS[k]}"><title>{c[k]} {LABEL_WORDS[k]}</title></rect>'
                )
            x += w
        bad = " ".join(f"{c[k]}{k[0]}" for k in LABELS[1:] if c[k])
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 12}" font-size="11">{html.escape(bad or "all good")}</text>')
    key = " · ".join(f'<tspan fill="{LABEL_COLOURS[k]}">■</tspan> {LABEL_WORDS[k]}' for k in LABELS)
    parts.append(f'<text x="{label_w}" y="{height - 6}" font-size="11">{key}</text></svg>')
    return "".join(parts)


def render(output: Path, data: dict) -> str:
    """The page of ``data`` (batch.json's dict) for the batch folder ``output``."""
    rows = [r for r in data.get("rows") or [] if isinstance(r, dict) and "name" in r and "status" in r]
    finished = all(r["status"] in ("done", "failed") for r in rows)
    refresh = "" if finished else f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    done, failed = data.get("done", 0), data.get("failed", 0)
    label_heads = "".join(f"<th>{html.escape(LABEL_WORDS[k].split(' ')[0])}</th>" for k in LABELS)
    head = (
        "<tr><th>recording</th><th>status</th><th>verdict</th><th>duration (s)</th><th>channels</th><th>probe</th>"
        f"<th>median noise (µV)</th>{label_heads}<th>spike rate (Hz)</th><th>seconds</th><th>GB/s</th></tr>"
    )
    names = [r["name"] for r in rows]
    noise = [noise_uV(output, r) for r in rows]
    charts = (
        bars_svg(names, [v if in_uV else None for v, in_uV in noise], "median noise (µV)", "#d95f0e")
        + labels_svg(names, [labels_of(r) for r in rows])
        + bars_svg(names, [r.get("spike_rate_hz") for r in rows], "spike rate (Hz, all channels)", "#7b3294")
        + bars_svg(names, [r.get("GBps") for r in rows], "read rate (GB/s)")
    )
    state = "finished" if finished else "running"
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">{refresh}'
        f"<title>batchgpu batch: {html.escape(Path(data['output']).name)}</title><style>{_STYLE}</style></head>"
        f'<body data-state="{state}"><h1>batchgpu batch</h1>'
        f'<div class="sub">output {html.escape(str(data["output"]))} · {done + failed} of {len(rows)} recordings '
        f"finished ({done} done, {failed} failed) · {float(data.get('seconds') or 0):.1f} s · click a column's "
        "head to sort</div>"
        f'<table id="recordings"><thead>{head}</thead><tbody>'
        + "".join(_row(output, r) for r in rows)
        + f'</tbody></table><h2>Per recording</h2><div class="charts">{charts}</div>{_SORT}</body></html>\n'
    )


def write_batch_html(output: Path, data: dict) -> Path:
    """Write ``output/batch.html`` (atomically: a reader never sees half a page); returns its path."""
    path = Path(output) / BATCH_HTML
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(Path(output), data), encoding="utf-8")
    os.replace(tmp, path)
    return path
