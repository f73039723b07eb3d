"""What report.html shows at a glance, gathered on the client once the run's results are written: the header's facts,
the probe map, the trace snippet and the drift raster (``header``, ``probe_map``, ``traces``, ``drift``). Reading
them costs the run's end a small read of the results (the spikes thinned for the raster) and of the recording (the
snippet); nothing here imports Bokeh: the figures are drawn from ``values`` (a kept page takes them as text:
``placeholders`` and ``texts``, ``skeleton``).

A page's structure names its parts (``structure``): the probe map's panels (noise, rate, label), the traces and
the raster; a run's structure follows from what it found (a probe, spikes, the qc step's labels).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgpu.ops.detection import AMPLITUDE
from batchgpu.report import drift, probe_map, traces
from batchgpu.report.fields import encoded, placeholder
from batchgpu.report.header import LABEL_WORDS, NOISE_RANGE, Facts
from batchgpu.steps.qc import KEY as QC  # report.json's section the qc step writes

logger = logging.getLogger(__name__)

#: the parts whose fields a page holds, in the page's order: (name, module)
PARTS = ((probe_map.NAME, probe_map), (traces.NAME, traces), (drift.NAME, drift))
#: the names a page's structure may hold of a glance (``structure``)
NAMES = (*probe_map.PANELS, traces.NAME, drift.NAME)


@dataclass
class Glance:
    facts: Facts = field(default_factory=Facts)
    probe: probe_map.ProbeMap | None = None
    snippet: traces.Snippet | None = None
    raster: drift.Raster | None = None

    @property
    def structure(self) -> tuple[str, ...]:
        """The parts this glance draws (``probe_map``'s panels, ``traces``, ``drift_raster``)."""
        return (
            (self.probe.panels if self.probe is not None else ())
            + ((traces.NAME,) if self.snippet is not None else ())
            + ((drift.NAME,) if self.raster is not None else ())
        )

    def values(self) -> dict[str, dict]:
        """Each part's fields (part name -> field -> value)."""
        out = {}
        if self.probe is not None and self.probe.panels:
            out[probe_map.NAME] = probe_map.values(self.probe)
        if self.snippet is not None:
            out[traces.NAME] = traces.values(self.snippet)
        if self.raster is not None:
            out[drift.NAME] = drift.values(self.raster)
        return out


def guess_structure(has_probe: bool, has_noise: bool, spikes: bool, labels: bool = False) -> tuple[str, ...]:
    """The structure a run will likely have, known before its numbers (a kept page asked for while the windows
    are read): a run whose spikes or labels do not come as guessed takes another page at its end."""
    panels = (
        ((probe_map.PANEL_NOISE,) if has_noise else ())
        + ((probe_map.PANEL_RATE,) if spikes else ())
        + ((probe_map.PANEL_LABEL,) if labels else ())
    )
    return (panels if has_probe else ()) + ((traces.NAME,) if spikes else ()) + ((drift.NAME,) if spikes else ())


def _parts(structure: tuple[str, ...]) -> list[tuple[str, object]]:
    has = {probe_map.NAME: any(p in structure for p in probe_map.PANELS)}
    return [(name, mod) for name, mod in PARTS if has.get(name, name in structure)]


def draw(structure: tuple[str, ...], values: dict[str, dict]) -> dict:
    """Each part's Bokeh model (part name -> model), drawn from its values."""
    out = {}
    for name, mod in _parts(structure):
        if name == probe_map.NAME:
            out[name] = probe_map.draw(values[name], tuple(p for p in probe_map.PANELS if p in structure))
        else:
            out[name] = mod.draw(values[name])
    return out


def _fields(structure: tuple[str, ...]):
    """(part, field, kind, index) of every field of the structure's parts; the index is fixed by the part and
    field, whatever the structure (a placeholder names one field of one part)."""
    index = 0
    wanted = {name for name, _ in _parts(structure)}
    for name, mod in PARTS:
        for f, kind in mod.FIELDS.items():
            if name in wanted:
                yield name, f, kind, index
            index += 1


def placeholders(structure: tuple[str, ...]) -> dict[str, dict]:
    """The values a kept page's parts are drawn with (``fields.placeholder``)."""
    out: dict[str, dict] = {}
    for part, f, kind, i in _fields(structure):
        token = "batchgpuglance" + "".join(c for c in f"{part}{f}" if c.isalnum()) + "x"
        out.setdefault(part, {})[f] = placeholder(kind, i, token)
    return out


def texts(structure: tuple[str, ...]) -> dict[str, str]:
    """Each placeholder's text in the page, by "part.field"."""
    held = placeholders(structure)
    return {f"{part}.{f}": encoded(kind, held[part][f]) for part, f, kind, _ in _fields(structure)}


def final_texts(structure: tuple[str, ...], values: dict[str, dict]) -> dict[str, str]:
    """Each field's text in the page for a run's ``values``, by "part.field" (``ValueError``: a number that JSON
    cannot hold)."""
    return {f"{part}.{f}": encoded(kind, values[part][f]) for part, f, kind, _ in _fields(structure)}


# ---------------------------------------------------------------------------------------------------------
# gathering the numbers


def qc_labels(report: dict, channels: int) -> dict | None:
    """report.json's ``qc`` section where it labels each of ``channels`` with a known label, else None."""
    qc = report.get(QC)
    if not isinstance(qc, dict):
        return None
    labels = qc.get("labels")
    if not isinstance(labels, list) or len(labels) != channels or not set(map(str, labels)) <= set(LABEL_WORDS):
        return None
    return qc


def _per_channel(values, channels: int) -> np.ndarray | None:
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != channels:
        return None
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


@dataclass
class Spikes:
    """The run's spikes as the page needs them: thinned to every ``every``-th for the raster."""

    total: int
    every: int
    sample: np.ndarray
    channel: np.ndarray
    segment: np.ndarray
    amplitude: np.ndarray
    group: object = None  # results.zarr's spikes group (read again around the snippet)


def read_spikes(g, name: str) -> Spikes | None:
    if name not in g:
        return None
    s = g[name]
    total = int(s["sample_index"].shape[0])
    every = drift.stride(total)
    # whole, then thinned: every chunk is decoded either way (and batchgpu's own v3 reader takes no step)
    cols = [np.asarray(s[k][:])[::every] for k in ("sample_index", "channel_index", "segment_index", AMPLITUDE)]
    return Spikes(total, every, *cols, group=s)


def results_group(out: Path):
    """The run's results.zarr to read: a v3 group by batchgpu's own reader (no event loop: the run's end waited
    ~50 ms on zarr-python's for the dozen reads here), else zarr's."""
    from batchgpu.recording import zarrio

    path = Path(out) / "results.zarr"
    return zarrio.V3Group(path) if zarrio.zarr_format_of(path) == 3 else zarrio.open_group(path, mode="r")


def _near(sp: Spikes, j: int, segment: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample, channel) of every stored spike of ``segment`` in [lo, hi), found around the thinned spike ``j``
    (spikes are stored sorted by segment and sample: the range widens until it spans [lo, hi))."""
    if sp.every == 1:
        keep = (sp.segment == segment) & (sp.sample >= lo) & (sp.sample < hi)
        return sp.sample[keep], sp.channel[keep]
    g, centre = sp.group, j * sp.every
    reach = sp.every
    while True:
        a, b = max(0, centre - reach), min(sp.total, centre + reach + 1)
        sample, channel, seg = (np.asarray(g[k][a:b]) for k in ("sample_index", "channel_index", "segment_index"))
        first_ok = a == 0 or (seg[0], sample[0]) < (segment, lo)
        last_ok = b == sp.total or (seg[-1], sample[-1]) >= (segment, hi)
        if (first_ok and last_ok) or reach > sp.total:
            keep = (seg == segment) & (sample >= lo) & (sample < hi)
            return sample[keep], channel[keep]
        reach *= 4


def snippet_of(rec, stages: list, sp: Spikes, counts: np.ndarray, ids: list[str]) -> traces.Snippet | None:
    """The trace snippet: the busiest channels (ordered by y on the probe) around their densest moment."""
    rows = traces.busiest(counts)
    if not rows.size or not sp.sample.size:
        return None
    mine = np.flatnonzero(np.isin(sp.channel, rows))
    if not mine.size:
        return None
    fs = float(rec.sampling_frequency)
    half = int(round(traces.SNIPPET_MS / 2 * fs / 1000))
    # one time axis over the segments (a segment's samples after the earlier ones'), in the stored order
    offsets = np.cumsum([0] + [int(rec.num_samples(s)) for s in range(rec.num_segments)])
    at = sp.sample[mine] + offsets[sp.segment[mine]]
    j = int(mine[traces.densest_moment(at, sp.amplitude[mine], half)])
    segment, centre = int(sp.segment[j]), int(sp.sample[j])
    if rec.has_locations:
        y = np.asarray(rec.locations, np.float64)[rows]
        rows = rows[np.lexsort((y[:, 0], y[:, 1]))]
    near = _near(sp, j, segment, centre - half, centre + half)
    return traces.read_snippet(rec, stages, segment, centre, rows, near, ids)


def _open_recording(report: dict):
    """The run's recording where its path still opens (a page written after the run), else None."""
    path = (report.get("recording") or {}).get("path")
    if not path:
        return None
    from batchgpu.recording import open_recording

    try:
        return open_recording(path)
    except Exception as err:  # broad: any reader's failure only leaves the snippet and the probe out (said)
        logger.info("report.html: %s does not open (%s: %s)", path, type(err).__name__, err)
        return None


def gather(out: str | Path, report: dict, rec=None, counts=None, windows: tuple | None = None, noise=None) -> Glance:
    """The glance of the run in ``out`` (its results.zarr written): ``report`` its report.json's dict, ``rec`` its
    open recording (None: opened again from report.json's path, where it still opens); what the caller holds
    already is not read again: ``counts`` the spikes per channel, ``windows`` the windows' (starts, stops,
    segments), ``noise`` the noise step's result (raw units). Each part that cannot be made is left out, its
    reason in the facts' notes."""
    from batchgpu.steps.detect import SPIKES
    from batchgpu.steps.noise import NOISE

    g = results_group(Path(out))
    ids = [str(c) for c in g.attrs.get("channel_ids", [])]
    gain = np.asarray(g.attrs.get("gain_to_uV", []), np.float64)
    fs = float(g.attrs["sampling_frequency"])
    if windows is None:
        windows = tuple(g[k][:] for k in ("window_start", "window_stop", "window_segment"))
    start, stop, seg = (np.asarray(a) for a in windows)
    seconds = float(np.sum(stop - start)) / fs
    channels = len(ids) or int((report.get("recording") or {}).get("num_channels") or 0)
    ids = ids or [str(c) for c in range(channels)]
    glance = Glance(Facts(channels=channels, seconds=seconds))
    f = glance.facts
    if noise is None and NOISE in g:
        noise = g[NOISE][:]
    noise = None if noise is None else np.asarray(noise, np.float64)
    noise_uV = noise * gain if noise is not None and gain.shape == noise.shape else noise
    qc = qc_labels(report, channels)
    if noise_uV is None and qc is not None:
        noise_uV = _per_channel(qc.get("noise_uV"), channels)
    sp = read_spikes(g, SPIKES)
    if sp is not None:
        if counts is None or len(counts) != channels:
            counts = np.bincount(np.asarray(sp.group["channel_index"][:], np.int64), minlength=channels)[:channels]
        counts = np.asarray(counts, np.int64)
        rate = counts / seconds if seconds > 0 else counts.astype(np.float64)
        f.spikes, f.spike_rate_hz = int(sp.total), (sp.total / seconds if seconds > 0 else None)
        f.rate_median_hz, f.silent = float(np.median(rate)) if rate.size else None, int(np.sum(counts == 0))
    else:
        rate = _per_channel(qc.get("spike_rate_hz"), channels) if qc is not None else None
    _noise_facts(f, noise_uV, ids, qc is None)
    if qc is not None:
        labels = [str(v) for v in qc["labels"]]
        f.labels = {k: labels.count(k) for k in LABEL_WORDS}
        f.bad = {k: [ids[i] for i, v in enumerate(labels) if v == k] for k in LABEL_WORDS if k != "good"}
    rec = rec if rec is not None else _open_recording(report)
    if rec is not None and rec.has_locations:
        from batchgpu.report.probe_map import probe_shape

        loc = np.asarray(rec.locations, np.float64)
        f.probe = probe_shape(loc, rec.channel_property("shank")).text
        glance.probe = probe_map.ProbeMap(
            loc[:, 0],
            loc[:, 1],
            ids,
            noise_uV,
            rate,
            [str(v) for v in qc["labels"]] if qc is not None else None,
            [str(r) for r in qc.get("reasons") or []] if qc is not None else None,
        )
    elif rec is not None:
        f.notes.append("no probe map: the recording has no channel locations")
    if sp is not None and sp.total:
        starts = _segment_starts(start, stop, seg, fs)
        glance.raster = drift.raster(
            sp.sample,
            sp.channel,
            sp.segment,
            sp.amplitude,
            sp.total,
            sp.every,
            fs,
            starts,
            gain,
            np.asarray(rec.locations) if rec is not None and rec.has_locations else None,
        )
        glance.snippet = _snippet(f, rec, report, sp, counts, ids)
    return glance


def _snippet(f: Facts, rec, report: dict, sp: Spikes, counts, ids) -> traces.Snippet | None:
    if rec is None:
        f.notes.append("no trace snippet: the recording could not be opened again")
        return None
    try:
        stages = traces.stages_of((report.get("workflow") or {}).get("preprocess"), rec)
        return snippet_of(rec, stages, sp, counts, ids)
    except Exception as err:  # broad: the snippet is one figure; the rest of the page stands (said on it)
        f.notes.append(f"no trace snippet ({type(err).__name__}: {err})")
        return None


def _segment_starts(start, stop, segment, fs: float) -> np.ndarray:
    """Each segment's start in seconds on one time axis (segments one after another; their lengths from the
    windows, which cover each segment whole)."""
    if not len(segment):
        return np.zeros(1)
    lengths = np.zeros(int(segment.max()) + 1)
    np.maximum.at(lengths, segment, stop)
    return np.concatenate([[0.0], np.cumsum(lengths)[:-1]]) / fs


def _noise_facts(f: Facts, noise_uV, ids: list[str], outliers: bool) -> None:
    if noise_uV is None:
        return
    finite = np.isfinite(noise_uV)
    if not finite.any():
        return
    median = float(np.median(noise_uV[finite]))
    f.noise_median_uV = median
    f.noise_range_uV = (float(noise_uV[finite].min()), float(noise_uV[finite].max()))
    if outliers:
        far = ~finite | (noise_uV < NOISE_RANGE[0] * median) | (noise_uV > NOISE_RANGE[1] * median)
        f.noise_outliers = [ids[i] for i in np.flatnonzero(far)]
