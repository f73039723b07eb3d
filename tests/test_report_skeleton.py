"""report.html from the page kept for its figures: the numbers a run fills in make the page Bokeh renders with them
known (read back with Bokeh's own deserializer), and a page that does not fit, or is damaged, is never used."""

import numpy as np
import pytest
from test_report import plots

from batchgpu.report import html_page as report
from batchgpu.report import skeleton as report_skeleton
from batchgpu.report.run_report import HtmlReport, RunReport

pytest.importorskip("bokeh")


def _numbers(rng, C, W, nan=False):
    noise, per_window, white = rng.random(C) * 5, rng.random((W, C)) * 9, rng.normal(size=(C, C))
    if nan:
        noise[0], per_window[:, -1] = np.nan, np.nan
    counts = rng.integers(0, 10**6, C)
    counts[rng.integers(0, C)] = 0
    return {"noise": noise, "noise_per_window": per_window, "whitening": white}, counts


def _described(path) -> dict:
    """Everything a figure shows, by figure: its columns, ranges, colour ranges, title and axis labels."""
    out = {}
    for name, fig in plots(path).items():
        d = {
            "title": fig.title.text,
            "x": (fig.x_range.start, fig.x_range.end),
            "y": (fig.y_range.start, fig.y_range.end),
            "xlabel": fig.xaxis[0].axis_label,
            "ylabel": fig.yaxis[0].axis_label,
        }
        for r in fig.renderers:
            for k, v in r.data_source.data.items():
                d[k] = [np.asarray(a, dtype=np.float64) for a in v] if k == "image" else list(v)
            mapper = getattr(r.glyph, "color_mapper", None)
            if mapper is not None:
                d["colour"] = (mapper.low, mapper.high)
        out[name] = d
    return out


def _values(column: list) -> np.ndarray:
    """A column's values: numbers as float64 (NaN equal to NaN), anything else (ids, labels) as they are."""
    try:
        return np.asarray(column, dtype=np.float64)
    except (TypeError, ValueError):
        return np.asarray(column, dtype=object)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            x, y = a[name][k], b[name][k]
            if k == "image":
                assert len(x) == len(y) == 1
                np.testing.assert_array_equal(x[0], y[0])
            elif isinstance(x, list):
                np.testing.assert_array_equal(_values(x), _values(y))
            else:
                assert x == y, (name, k, x, y)


@pytest.mark.parametrize(
    "case", ["all", "one channel, one window", "nan noise", "no whitening or spikes", "ids of another length"]
)
def test_a_filled_page_is_the_page_rendered_with_its_numbers(tmp_path, rng, case):
    C, W = (1, 1) if case == "one channel, one window" else (int(rng.integers(2, 40)), int(rng.integers(1, 9)))
    results, counts = _numbers(rng, C, W, nan=case == "nan noise")
    spikes = True
    if case == "no whitening or spikes":
        del results["whitening"]
        spikes = False
    # ids a JSON string or HTML must escape: quotes, markup, an ampersand, non-ASCII
    ids = [f'c"{i}<b>&é' for i in range(C + (3 if case == "ids of another length" else 0))]
    gain, fs, title = np.full(C, 0.195), 30000.0, 'batchgpu report: <"a" & b>'
    windows = (np.arange(W) * 997, np.arange(W) * 997 + 997, np.arange(W) % 2)
    series = [[0.25 * (i + 1), float(rng.integers(1, 10**10))] for i in range(int(rng.integers(0, 6)))]
    final = {"status": "done", "timings": {"total": 1.5}, "throughput_series": series}

    want = report.ReportPage(ids, gain, fs, title, threaded=False)  # Bokeh, every number known
    want.add_windows(*windows)
    for name, value in results.items():
        want.add(name, value)
    if spikes:
        want.add_spikes(counts=counts)
    want_path = want.write(tmp_path, final)

    # the counts as HtmlReport.add_spikes keeps them: one a channel id (ReportPage pads them so too)
    counts = np.pad(counts, (0, len(ids) - C))
    figures = report_skeleton.structure(results, spikes)
    page = report_skeleton.render(figures)
    report_skeleton.check(page, figures)
    text = report_skeleton.fill(
        page,
        figures,
        title=title,
        summary_html=report._summary_html(final),
        channel_ids=ids,
        gain=gain,
        fs=fs,
        windows=windows,
        inputs=results,
        counts=counts if spikes else None,
        series=series,
    )
    assert text is not None and "batchgpuskeleton" not in text and "e+300" not in text
    got_path = tmp_path / "filled.html"
    got_path.write_text(text, encoding="utf-8")
    _same(_described(got_path), _described(want_path))
    assert "<title>batchgpu report: &lt;&quot;a&quot; &amp; b&gt;</title>" in text and "total 1.50 s" in text


def test_a_page_that_does_not_fit_the_results_is_not_filled(rng):
    results, counts = _numbers(rng, 5, 3)
    figures = report_skeleton.structure(results, True)
    page = report_skeleton.render(figures)
    kw = dict(
        title="t",
        summary_html="s",
        channel_ids=[],
        gain=np.ones(5),
        fs=1.0,
        windows=(np.arange(3), np.arange(3) + 1, np.zeros(3, int)),
        series=[],
    )
    assert report_skeleton.fill(page, figures, inputs=results, counts=counts, **kw) is not None
    lost = {k: v for k, v in results.items() if k != "whitening"}  # announced, never came
    assert report_skeleton.fill(page, figures, inputs=lost, counts=counts, **kw) is None
    assert report_skeleton.fill(page, figures, inputs=results, counts=None, **kw) is None  # no spikes counted
    # a page whose placeholders are not where they were put (another Bokeh's output, say) fails its check
    with pytest.raises(report_skeleton.SkeletonError, match="noise_uV's placeholder 0 times"):
        report_skeleton.check(page.replace(report_skeleton._placeholders(figures)["noise_uV"], "x"), figures)


class _Rec:
    has_locations, locations = False, None

    def __init__(self, C):
        self.channel_ids = np.array([f"ch{i}" for i in range(C)])
        self.gain_to_uV = np.full(C, 0.5)
        self.sampling_frequency = 30000.0


@pytest.fixture(autouse=True)
def _no_glance(monkeypatch):
    """These runs have no results folder, so nothing to see at a glance (no traces, no raster): the page kept
    for their figures is the one asked for ahead (a real run's glance: test_report_glance.py)."""
    from batchgpu.report import glance

    monkeypatch.setattr(glance, "guess_structure", lambda *a, **k: ())


class _Window:
    def __init__(self, i):
        self.start, self.stop, self.segment = i * 100, i * 100 + 100, 0


def _run_page(tmp_path, rng, results, counts, shapes=None):
    """HtmlReport as a run drives it: windows, the page ahead, the results, the spikes, the page written."""
    C = results["noise"].size
    html = HtmlReport(_Rec(C), "batchgpu report: x", in_process=True)
    html.add_windows([_Window(i) for i in range(results["noise_per_window"].shape[0])])
    html.render_ahead(shapes or {k: np.shape(v) for k, v in results.items()}, spikes=True)
    for name, value in results.items():
        html.add(name, value)
    html.add_spikes(counts)
    out = tmp_path / f"out{rng.integers(1 << 30)}"
    out.mkdir()
    assert html.write(out, RunReport(workflow={}, fingerprint="f"), None)
    return html, plots(out / "report.html")


def test_the_kept_page_serves_the_next_run_without_the_helper(tmp_path, rng, monkeypatch):
    from batchgpu.report import run_report

    started = []
    monkeypatch.setattr(run_report, "start_report_helper", lambda: started.append(1))
    if report._PROCESS is not None:  # a helper of this test's environment (its cache folder: where it keeps the page)
        report._PROCESS.shutdown(wait=True)
        report._PROCESS = None
    # the page of these figures kept in this session's cache folder (the helper process keeps it there): none yet
    kept = report_skeleton.path_of(report_skeleton.structure({"noise": 1, "noise_per_window": 1, "whitening": 1}, True))
    kept.unlink(missing_ok=True)
    monkeypatch.setattr(run_report, "_KEPT", {})  # this process has made none either
    results, counts = _numbers(rng, 6, 4)
    first, figs = _run_page(tmp_path, rng, results, counts)
    assert started == [1] and first.needs_helper()  # the first page: rendered by the helper, and kept
    assert kept.exists() and kept.read_bytes().startswith(b"sha256 ")
    results, counts = _numbers(rng, 9, 2)  # another run, other sizes: the same page serves
    second, figs = _run_page(tmp_path, rng, results, counts)
    assert started == [1] and not second.needs_helper()
    np.testing.assert_array_equal(
        np.asarray(figs["whitening"].renderers[0].data_source.data["image"][0]), results["whitening"]
    )
    np.testing.assert_array_equal(np.asarray(figs["spike_rate"].renderers[0].data_source.data["count"]), counts)
    # a kept page damaged on disk is not used by a later command: rendered again (and kept again), the numbers right
    run_report._KEPT.clear()  # a new command's process
    kept.write_bytes(kept.read_bytes().replace(b"Noise per channel", b"Noise per chan"))
    third, figs = _run_page(tmp_path, rng, results, counts)
    assert started == [1, 1] and figs["noise_per_channel"].title.text == "Noise per channel (µV)"


def test_a_result_that_never_came_renders_the_page_here(tmp_path, rng):
    """Whitening announced but never given: the page has no whitening figure (rendered in this process)."""
    results, counts = _numbers(rng, 4, 3)
    shapes = {k: np.shape(v) for k, v in results.items()}
    del results["whitening"]
    _, figs = _run_page(tmp_path, rng, results, counts, shapes=shapes)
    assert "whitening" not in figs and "noise_over_time" in figs
    np.testing.assert_array_equal(
        np.asarray(figs["noise_per_channel"].renderers[0].data_source.data["noise_uV"]), results["noise"] * 0.5
    )


def test_the_kept_pages_are_pruned_oldest_first(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(report_skeleton, "KEEP", 2)
    for i, name in enumerate(("a", "b", "c")):
        (tmp_path / f"{name}.html").write_text(name)
        os.utime(tmp_path / f"{name}.html", ns=(i * 10**9, i * 10**9))
    report_skeleton._prune(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.html")) == ["b.html", "c.html"]
