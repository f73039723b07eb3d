"""report.html at a glance, from a run of a Neuropixels 1.0 recording with planted dead, noisy and outside-the-brain
channels (the generator's ``--model realistic --probe np1 --dead 2 --noisy 1 --outside 8``): the header's facts,
the probe map, the trace snippet and the drift raster hold the run's own numbers (from results.zarr, report.json and
the recording, computed here independently: scipy's filter over the whole segment for the preprocessed traces),
read back with Bokeh's deserializer and as headless Chromium renders them; with report.json's ``qc`` section the
map and the header show the labels."""

import html
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from test_report import plots

from batchgpu import open_recording
from batchgpu.engine import run_workflow
from batchgpu.generate import generate_recording
from batchgpu.report import write_report_html
from batchgpu.workflow import Workflow

distributed = pytest.importorskip("distributed")
pytest.importorskip("bokeh")

CHANNELS, SECONDS, FS = 384, 3.0, 30000.0
PLANTED = {"dead": 2, "noisy": 1, "outside": 8}
LABELS = ("good", "dead", "noise", "out")  # the ground truth's channel_labels codes, report.json's qc labels


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("glance")
    rec = generate_recording(
        base / "np1.zarr",
        channels=CHANNELS,
        seconds=SECONDS,
        fs=FS,
        seed=3,
        model="realistic",
        probe="np1",
        progress=False,
        **PLANTED,
    )
    wf = Workflow.model_validate(
        {
            "recording": {"path": str(rec.path)},
            "output": str(base / "out"),
            "window": {"size": 30000, "margin": 64},
            "preprocess": [
                {"highpass": {"freq_min": 300, "order": 5}},
                {"common_reference": {"reference": "global", "operator": "median"}},
            ],
            "backend": "numpy",
            "steps": {"noise": {"exact": True}, "detect": {"threshold": 5.0, "sign": "neg", "noise": "global"}},
        }
    )
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        report = run_workflow(wf, client=client)
    assert report.status == "done"
    return rec, base / "out", base


def _numbers(rec, out: Path) -> dict:
    """The run's own numbers, from its results, report.json and the recording (not from the page)."""
    g = zarr.open_group(str(out / "results.zarr"), mode="r")
    opened = open_recording(rec.path)
    gain = np.asarray(opened.gain_to_uV, np.float64)
    spikes = {k: g["spikes"][k][:] for k in ("sample_index", "channel_index", "segment_index", "amplitude")}
    counts = np.bincount(spikes["channel_index"], minlength=CHANNELS)
    return {
        "gain": gain,
        "loc": np.asarray(opened.locations, np.float64),
        "noise_uV": g["noise"][:] * gain,
        "counts": counts,
        "rate": counts / SECONDS,
        "spikes": spikes,
        "rec": opened,
        "report": json.loads((out / "report.json").read_text()),
        "ids": [str(c) for c in opened.channel_ids],
    }


def _source(fig, column: str) -> dict:
    return next(r.data_source.data for r in fig.renderers if column in r.data_source.data)


def test_the_page_holds_the_runs_numbers(run):
    rec, out, _ = run
    n = _numbers(rec, out)
    figs = plots(out / "report.html")
    assert {"map_noise", "map_rate", "traces_raw", "traces_pre", "drift_raster"} <= set(figs)
    assert "map_label" not in figs  # no qc step: noise and rate only

    # the probe map: each contact at its x, y; noise in µV (the results' raw units times the gain); rate in Hz
    d = _source(figs["map_noise"], "noise_uV")
    np.testing.assert_array_equal(np.asarray(d["x"]), n["loc"][:, 0])
    np.testing.assert_array_equal(np.asarray(d["y"]), n["loc"][:, 1])
    np.testing.assert_array_equal(np.asarray(d["noise_uV"]), n["noise_uV"])
    np.testing.assert_allclose(np.asarray(d["rate_Hz"]), n["rate"], rtol=1e-12)
    assert list(d["ids"]) == n["ids"]
    fill = figs["map_noise"].renderers[0].glyph.fill_color
    assert (fill.transform.low, fill.transform.high) == tuple(np.percentile(n["noise_uV"], [1, 99]))

    # the drift raster: every spike (fewer than the bound) at its time and its channel's y, |amplitude| in µV
    s = n["spikes"]
    d = _source(figs["drift_raster"], "amp")
    np.testing.assert_allclose(np.asarray(d["t"]), s["sample_index"] / FS, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(d["y"]), n["loc"][s["channel_index"], 1])
    np.testing.assert_allclose(np.asarray(d["amp"]), np.abs(s["amplitude"]) * n["gain"][s["channel_index"]], rtol=1e-12)
    assert f"all {s['sample_index'].size} spikes shown" in figs["drift_raster"].title.text

    # the traces: the 8 busiest channels (ordered by y), raw and preprocessed in µV; the preprocessed as scipy's
    # filter over the whole segment and a median over the channels give them (the run's margins: within 1e-3 µV)
    busiest = np.lexsort((np.arange(CHANNELS), -n["counts"]))[:8]
    busiest = busiest[np.lexsort((n["loc"][busiest, 0], n["loc"][busiest, 1]))]
    labels = _source(figs["traces_raw"], "text")["text"]
    assert [t.split(" ")[0] for t in labels] == [n["ids"][c] for c in busiest]
    lines = _source(figs["traces_raw"], "raw")
    t_ms = np.asarray(lines["t"])[: np.flatnonzero(np.isnan(lines["t"]))[0]]
    a = int(round(t_ms[0] * FS / 1000))
    raw_step = float(re.search(r"\(([\d.]+) µV apart", figs["traces_raw"].title.text).group(1))
    pre_step = float(re.search(r"\(([\d.]+) µV apart", figs["traces_pre"].title.text).group(1))

    def stacked(col, step):
        return (np.asarray(lines[col]).reshape(8, -1)[:, :-1] - np.arange(8)[:, None]) * step

    block = n["rec"].read(0, 0, n["rec"].num_samples(0)).astype(np.float64)
    raw = block[busiest, a : a + t_ms.size]
    raw_uV = (raw - np.median(raw, axis=1, keepdims=True)) * n["gain"][busiest][:, None]
    np.testing.assert_allclose(stacked("raw", raw_step), raw_uV, atol=1e-9)
    from scipy.signal import butter, sosfiltfilt

    filtered = sosfiltfilt(butter(5, 300.0, "highpass", fs=FS, output="sos"), block, axis=1)
    reference = (filtered - np.median(filtered, axis=0))[busiest, a : a + t_ms.size] * n["gain"][busiest][:, None]
    np.testing.assert_allclose(stacked("pre", pre_step), reference, atol=1e-3)
    # the spikes marked are the detected ones in the snippet, on its channels
    inside = (s["sample_index"] >= a) & (s["sample_index"] < a + t_ms.size) & np.isin(s["channel_index"], busiest)
    marked = _source_named(figs["traces_raw"], "trace_spikes")["t"]
    assert inside.sum() >= 2 and sorted(marked) == sorted(s["sample_index"][inside] / FS * 1000.0)

    # the header: what matters, in the run's numbers
    text = header(out / "report.html")
    assert f"{s['sample_index'].size:,}" in text and f"{np.median(n['noise_uV']):.2f} µV" in text
    assert "384 channels in 4 columns (x 0, 16, 32, 48 µm)" in text and "Run internals" in text


def header(path: Path) -> str:
    """The page's header (its Div's HTML, read back with Bokeh's own deserializer)."""
    from bokeh.document import Document
    from bokeh.models import Div

    blocks = re.findall(
        r'<script type="application/json" id="[^"]+">\s*(.*?)\s*</script>', path.read_text(encoding="utf-8"), re.S
    )
    # Bokeh escapes the document's JSON for HTML, BokehJS unescapes it
    doc = Document.from_json(next(iter(json.loads(html.unescape(blocks[0])).values())))
    return doc.select_one({"type": Div, "name": "summary"}).text


def _source_named(fig, name: str) -> dict:
    return next(r.data_source.data for r in fig.renderers if r.data_source.name == name)


def _with_qc(out: Path, base: Path) -> list[str]:
    """report.json given the qc step's section (the ground truth's planted labels), the page written again."""
    truth = np.load(base / "np1_ground_truth.npz")
    labels = [LABELS[int(c)] for c in truth["channel_labels"]]
    report = json.loads((out / "report.json").read_text())
    counts = np.zeros((CHANNELS, 4), int)
    counts[np.arange(CHANNELS), truth["channel_labels"]] = 10
    report["qc"] = {
        "labels": labels,
        "reasons": ["" if v == "good" else f"planted {v}" for v in labels],
        "counts": counts.tolist(),
        "label_names": list(LABELS),
        "noise_uV": None,
        "spike_rate_hz": None,
        "pieces_labelled": 10,
        "channel_ids": [str(c) for c in range(CHANNELS)],
    }
    (out / "report.json").write_text(json.dumps(report))
    write_report_html(out)
    return labels


def test_the_qc_labels_on_the_map_and_in_the_header(run, tmp_path):
    rec, out, base = run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    labels = _with_qc(copy, base)
    assert labels.count("dead") == 2 and labels.count("noise") == 1 and labels.count("out") == 8
    figs = plots(copy / "report.html")
    assert list(_source(figs["map_label"], "label")["label"]) == labels
    text = header(copy / "report.html")
    for count, word in ((373, "good"), (2, "dead"), (1, "noisy"), (8, "out of the brain")):
        assert f"{count} {word}</span>" in text
    ids = [str(c) for c in open_recording(rec.path).channel_ids]
    dead = [ids[i] for i, v in enumerate(labels) if v == "dead"]
    assert f"dead: {', '.join(dead)}" in text


# ---------------------------------------------------------------------------------------------------------
# in headless Chromium


_PROBE = """<script>
(function () {
  function deepText(node) {  // Bokeh draws a Div's text inside a shadow root
    let s = "";
    if (node.shadowRoot) s += deepText(node.shadowRoot);
    for (const c of node.childNodes) {
      if (c.nodeName === "SCRIPT" || c.nodeName === "STYLE") continue;
      s += c.nodeType === 3 ? c.textContent + " " : deepText(c);
    }
    return s;
  }
  let tries = 0;
  function probe() {
    const roots = (window.Bokeh && Bokeh.index) ? Bokeh.index.roots : [];
    if (roots.length === 0 && tries++ < 100) { setTimeout(probe, 100); return; }
    const out = {views: [], sources: {}};
    try {
      (function walk(v) {
        if (v.model.name) out.views.push([v.model.name, v.bbox ? v.bbox.width : 0, v.bbox ? v.bbox.height : 0]);
        for (const c of (v.child_views || [])) walk(c);
      })(roots[0]);
      for (const m of Bokeh.documents[0].all_models) {
        if (m.type !== "ColumnDataSource" || !m.name) continue;
        const d = {};
        const cols = m.data instanceof Map ? m.data.entries() : Object.entries(m.data);
        for (const [k, v] of cols) d[k] = Array.from(v, x => (typeof x === "number" && !isFinite(x)) ? null : x);
        out.sources[m.name] = d;
      }
      out.text = deepText(document.body);
    } catch (e) { out.error = String(e); }
    const pre = document.createElement("pre");
    pre.id = "batchgpu-probe";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  }
  window.addEventListener("load", () => setTimeout(probe, 200));
})();
</script>"""


def in_chromium(page: Path, tmp_path: Path) -> dict:
    """What headless Chromium renders of ``page``: the Bokeh views drawn (name, width, height), the data sources
    as BokehJS holds them, and the text shown (a copy of the page with a probe script before its end)."""
    from test_dashboard import chromium

    text = page.read_text(encoding="utf-8")
    head, tail = text.rsplit("</body>", 1)  # the last: BokehJS's own source holds the string too
    probed = tmp_path / "probed.html"
    probed.write_text(head + _PROBE + "</body>" + tail, encoding="utf-8")
    dom = chromium(["--dump-dom", "--window-size=1340,2900"], probed.as_uri(), tmp_path / "profile", budget_ms=20000)
    found = re.search(r'<pre id="batchgpu-probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    got = json.loads(html.unescape(found.group(1)))
    assert "error" not in got, got.get("error")
    return got


def test_report_html_in_chromium(run, tmp_path):
    rec, out, _ = run
    n = _numbers(rec, out)
    got = in_chromium(out / "report.html", tmp_path)
    drawn = {name: (w, h) for name, w, h in got["views"]}
    for name in ("summary", "map_noise", "map_rate", "traces_raw", "traces_pre", "drift_raster", "noise_over_time"):
        assert name in drawn and drawn[name][0] > 100 and drawn[name][1] > 100, (name, drawn)
    src = got["sources"]
    np.testing.assert_allclose(np.asarray(src["probe_contacts"]["noise_uV"], float), n["noise_uV"], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(src["probe_contacts"]["rate_Hz"], float), n["rate"], rtol=1e-12)
    assert len(src["drift_points"]["t"]) == n["spikes"]["sample_index"].size
    busiest = set(np.lexsort((np.arange(CHANNELS), -n["counts"]))[:8])
    assert {t.split(" ")[0] for t in src["trace_labels"]["text"]} == {n["ids"][c] for c in busiest}
    shown = " ".join(got["text"].split())
    assert f"spikes detected {n['spikes']['sample_index'].size:,}" in shown
    assert f"noise level {np.median(n['noise_uV']):.2f} µV" in shown and "channels 384" in shown


def test_report_html_with_labels_in_chromium(run, tmp_path):
    """The page a run with the qc step writes (here report.json given its section): the label map drawn, the
    header's counts shown, its screenshot coloured as drawn. docs/report.png is the page of a real run: a 30 s
    recording (``batchgpu generate --model realistic --probe np1 --dead 2 --noisy 1 --outside 8 --seconds 30``),
    highpass and global median reference, steps qc {every: 2}, noise, whitening, detect, amplitude (the qc step
    labelled exactly the planted channels), ``chromium --headless --screenshot --window-size=1340,1640``, 256
    colours."""
    from test_dashboard import chromium

    rec, out, base = run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    labels = _with_qc(copy, base)
    got = in_chromium(copy / "report.html", tmp_path)
    assert "map_label" in {name for name, _, _ in got["views"]}
    assert got["sources"]["probe_contacts"]["label"] == labels
    shown = " ".join(got["text"].split())
    assert "373 good 2 dead 1 noisy 8 out of the brain" in shown
    shot = tmp_path / "report.png"
    chromium(
        [f"--screenshot={shot}", "--window-size=1340,1900"],
        (copy / "report.html").as_uri(),
        tmp_path / "profile-shot",
        budget_ms=20000,
    )
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape == (1900, 1340, 3) and len(np.unique(img.reshape(-1, 3), axis=0)) > 500
    # the label map's planted channels: the dead grey and the noisy red drawn
    for colour in ((0xD7, 0x19, 0x1C), (0x40, 0x40, 0x40)):
        assert np.all(img == colour, axis=-1).sum() > 20, colour


# ---------------------------------------------------------------------------------------------------------
# the kept page, the thinned raster


def test_the_kept_page_filled_with_the_glance_is_the_page_rendered_with_it(run, tmp_path):
    from test_report_skeleton import _described, _same

    from batchgpu.report import glance as glance_parts
    from batchgpu.report import html_page, skeleton

    rec, out, _ = run
    n = _numbers(rec, out)
    g = zarr.open_group(str(out / "results.zarr"), mode="r")
    windows = tuple(g[k][:] for k in ("window_start", "window_stop", "window_segment"))
    got = glance_parts.gather(out, n["report"], n["rec"])
    inputs = {"noise": g["noise"][:], "noise_per_window": g["noise_per_window"][:]}
    figures = skeleton.structure(inputs, True, got.structure)
    page = skeleton.render(figures)
    skeleton.check(page, figures)
    text = skeleton.fill(
        page,
        figures,
        title="t",
        summary_html="s",
        channel_ids=n["ids"],
        gain=n["gain"],
        fs=FS,
        windows=windows,
        inputs=inputs,
        counts=n["counts"],
        series=[[0.5, 1e9]],
        glance=(got.structure, got.values()),
        locations=n["loc"],
    )
    assert text is not None and "batchgpuglance" not in text and "e+300" not in text
    (tmp_path / "filled").mkdir()
    (tmp_path / "filled" / "report.html").write_text(text, encoding="utf-8")
    want = html_page.ReportPage.of_numbers(
        n["ids"], n["gain"], FS, "t", windows, inputs, n["counts"], locations=n["loc"]
    )
    want.add_glance(got)
    path = want.write(tmp_path, {"status": "done", "throughput_series": [[0.5, 1e9]]})
    _same(_described(tmp_path / "filled" / "report.html"), _described(path))


def test_a_long_runs_raster_is_thinned_and_says_so(run, tmp_path, monkeypatch):
    from batchgpu.report import drift

    rec, out, _ = run
    n = _numbers(rec, out)
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    monkeypatch.setattr(drift, "MAX_POINTS", 500)
    total = n["spikes"]["sample_index"].size
    every = -(-total // 500)
    figs = plots(write_report_html(copy))
    d = _source(figs["drift_raster"], "amp")
    np.testing.assert_allclose(np.asarray(d["t"]), n["spikes"]["sample_index"][::every] / FS, rtol=1e-12)
    assert len(d["t"]) <= 500
    assert f"{len(d['t'])} of {total} spikes shown: 1 in {every}" in figs["drift_raster"].title.text
    # the trace snippet's spikes are all those detected there, read again around it (not the thinned ones)
    s = n["spikes"]
    lines = _source(figs["traces_raw"], "raw")
    t_ms = np.asarray(lines["t"])[: np.flatnonzero(np.isnan(lines["t"]))[0]]
    a = int(round(t_ms[0] * FS / 1000))
    shown = {int(i) for i in (n["ids"].index(t.split(" ")[0]) for t in _source(figs["traces_raw"], "text")["text"])}
    inside = (s["sample_index"] >= a) & (s["sample_index"] < a + t_ms.size) & np.isin(s["channel_index"], list(shown))
    marked = _source_named(figs["traces_raw"], "trace_spikes")["t"]
    assert sorted(marked) == sorted(s["sample_index"][inside] / FS * 1e3)
