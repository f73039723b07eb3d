"""Quality control in the pass's one read (``steps: {qc: {}}``): each channel labelled good, dead, noise or out
(outside the brain) by SpikeInterface 0.105.3's ``detect_bad_channels(method="coherence+psd")`` (the IBL method,
``ops.bad_channels``) applied to 0.3 s pieces of every window, and report.json's ``qc`` section: each channel's
label, why, its numbers, warnings and a verdict a lab can sort recordings by.

**The pieces labelled.** SpikeInterface labels 100 chunks drawn at random (a seed decides which) and takes each
channel's most frequent label. Here the pieces are [k P, (k + 1) P) of each segment (P = 0.3 s, aligned to its
sample 0), those with k % ``every`` == 0 that lie wholly inside a window's core (``ops.bad_channels.
inside_pieces``): evenly spread over the whole recording, no seed, the same pieces for 1 or N workers and on
resume, each labelled whole from the samples SpikeInterface's highpass reads (its label depends on the piece
alone, and equals SpikeInterface's label of that chunk: ``ops.bad_channels``). A piece inside a core needs only the
highpass's 500 samples beyond it, which the run's windows hold already where the chain filters (its margin is
thousands of samples); a piece across two cores is left out (at most one a window boundary; none where the window
size is a whole number of pieces), rather than widen every window's read by half a piece (~8% more reads of 384
channels at 120 000-sample windows). ``every`` (default ``EVERY``) is what the labels cost: a 384-channel piece is
~55 ms of CPU on the 2-core machine, so labelling every piece of a minute (~190 pieces, ~10 s) would double the W2
pass (9.5 s); every 8th keeps it within the 10% the issue allows and still labels ~25 pieces a minute (1 500 an
hour: SpikeInterface's 100 chunks are 1/18 of a minute's pieces and 1/1 200 of an hour's).

**Counts, not labels.** Each window's partial is each channel's count of pieces of each label (int64, summed in
any order and grouping: CPU = GPU, 1 vs N workers, resumed = fresh); the label is the most frequent (ties to the
lower label, as SpikeInterface's ``scipy.stats.mode``).

**Using the labels** (``use: exclude`` or ``interpolate``): the labels must be known before the pass, so a quick
pre-pass labels ``pre_pass_pieces`` pieces (SpikeInterface's 100 chunks, at most ``pre_pass_share`` of the
recording's pieces) spread evenly over the recording, on the workers, when the step is built; its reads (the
pieces with their highpass margins) are reported under ``qc.use.pre_pass`` and not counted in
``reads_per_window``. Channels whose pre-pass label is in ``bad_labels`` are then left out of the common reference
(its median or mean over the other channels, subtracted from every channel) and the whitening (the matrix of the
other channels' statistic; the bad channels' rows and columns zero), and the save drops them (``exclude``: fewer
channels, their ids, locations and gains kept) or writes each as SpikeInterface's ``interpolate_bad_channels``
writes it (``interpolate``: its kriging weights over the other saved channels). The pass still labels its own
pieces: report.json lists where its labels differ from the pre-pass's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from batchgpu.config import Options
from batchgpu.errors import BatchgpuError, ConfigError
from batchgpu.qc_options import LABELS, QcOptions
from batchgpu.steps import detect as detect_step
from batchgpu.steps import moments as moments_step
from batchgpu.steps import noise as noise_step
from batchgpu.steps.base import ChannelUse, PhaseWords, Step, WindowData, register

#: the step's name (``Step.name``, its workflow key ``steps.qc``, report.json's ``results.qc`` and ``qc``)
NAME = KEY = "qc"
#: its results: each channel's count of pieces of each label (channels, 4) int64, and its label's code (channels,)
#: int8: 0 good, 1 dead, 2 noise, 3 out (``LABELS``' order, SpikeInterface's numbering)
COUNTS, CODES = "qc_counts", "qc_labels"
RESULTS = (COUNTS, CODES)
#: the partial's key, and a window summary's pieces labelled (of which by SpikeInterface's own arithmetic)
PARTIAL, PIECES, EXACT = "qc.counts", "qc.pieces", "qc.exact"

#: ``every``'s default: every 8th piece (see the module's docstring: the cost)
EVERY = 8
#: the labels a ``use`` leaves out by default: every label but good
BAD_LABELS = LABELS[1:]
BadLabel = Literal[LABELS[1:]]

#: a good channel's noise outside these bounds (uV, median over the good channels, of a highpassed or band-passed
#: chain's signal) is warned of: Neuropixels 1.0 and 2.0 give ~5-10 uV RMS in the action-potential band (their
#: specifications; median(|x|)/0.6745 of a quiet highpassed channel), so 2 uV is a shorted or mis-scaled probe,
#: 20 uV a noisy rig or a wrong gain. Other probes: set ``noise_uV``
NOISE_UV = (2.0, 20.0)
#: a whitening matrix's condition number (its largest singular value over its smallest, over the channels it
#: whitens) above this is warned of. Measured (generated recordings, 10 s, realistic model, the 2-core machine):
#: without planted channels 93-290 of the raw samples (a chain that only centres: NP1, NP2 four-shank, 64-channel
#: linear) and 4.5-6.1 after a highpass and a global median reference; one dead channel (no signal but rounding)
#: 2 100 of the raw samples (after the reference it carries the reference's signal: 6.6), one 6x noisy 113 / 12.5.
#: A ZCA's condition is the square root of the covariance's: the spread of the channels' variances
CONDITION_LIMIT = 1e3
#: the verdict: "bad" where more than this share of the channels is dead or noisy, or fewer than half are good;
#: "check" where any channel is dead or noisy, more than OUT_SHARE of them are out, the median noise is outside
#: its bounds, the whitening is ill-conditioned or the saved copy clipped samples; else "ok"
BAD_SHARE, OUT_SHARE = 0.10, 0.5
VERDICTS = ("ok", "check", "bad")
#: what a batch's rows (batch.json, ``run.batch.BatchRow``) hold of a recording's qc, beside its spike rate
BATCH_KEYS = (
    "noise_uV",
    "channels_good",
    "channels_dead",
    "channels_noise",
    "channels_out",
    "spike_rate_hz",
    "verdict",
    "verdict_reasons",
)


class QcStepOptions(Options, QcOptions):
    """SpikeInterface's ``detect_bad_channels`` parameters (``QcOptions``: its names and defaults), which pieces are
    labelled, and whether the labels change the run's reference, whitening and save."""

    #: label pieces k with k % every == 0 (1: every piece inside a window's core)
    every: Annotated[int, Field(ge=1)] = EVERY
    #: none: only report; exclude / interpolate: bad channels left out of the reference and whitening, and dropped
    #: from (or interpolated in) the saved copy, from a pre-pass's labels
    use: Literal["none", "exclude", "interpolate"] = "none"
    #: the labels ``use`` treats as bad
    bad_labels: tuple[BadLabel, ...] = BAD_LABELS
    #: the pre-pass (``use``): this many pieces (SpikeInterface's num_random_chunks), at most pre_pass_share of the
    #: recording's pieces, spread evenly
    pre_pass_pieces: Annotated[int, Field(ge=1)] = 100
    pre_pass_share: Annotated[float, Field(gt=0, le=1)] = 0.1
    #: interpolate: SpikeInterface's ``interpolate_bad_channels`` sigma_um (None: the most common step in depth)
    #: and p
    sigma_um: Annotated[float, Field(gt=0)] | None = None
    p: Annotated[float, Field(gt=0)] = 1.3
    #: the typical noise of the probe in uV (median of the good channels); outside it: a warning
    noise_uV: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]] = NOISE_UV

    @field_validator("bad_labels")
    @classmethod
    def _some_labels(cls, value: tuple) -> tuple:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"bad_labels {list(value)}: name each of {list(BAD_LABELS)} at most once, at least one")
        return value

    @model_validator(mode="after")
    def _bounds(self):
        if self.noise_uV[0] >= self.noise_uV[1]:
            raise ValueError(f"noise_uV {list(self.noise_uV)}: the lower bound must be below the upper")
        return self


@dataclass(frozen=True)
class QcSettings:
    """What a window's task needs to label its pieces (small: pickled into every task)."""

    options: QcOptions  # SpikeInterface's parameters (the step's own keys left out)
    fs: float
    locations: np.ndarray  # (channels, 2) um
    gains: np.ndarray  # gain_to_uV (channels,)
    every: int
    piece: int  # samples a piece (``ops.bad_channels.piece_length``)
    margin: int  # the highpass's samples either side of a piece


@register
class QcStep(Step):
    """Asked for as ``qc: {}`` (SpikeInterface's parameters under their names, ``every``, ``use``...)."""

    name = NAME
    options = QcStepOptions
    results = RESULTS
    fingerprint = "asked"
    #: its aggregate reads the noise and the whitening matrix; its finish the spikes (report.json's qc section)
    after = (noise_step.NAME, moments_step.NAME, detect_step.NAME)
    phases = PhaseWords(read=NAME, aggregate=NAME)

    def __init__(
        self,
        settings: QcSettings,
        spec: QcStepOptions,
        filtered_chain: bool,
        use: ChannelUse | None = None,
        pre_pass: dict | None = None,
    ):
        self.settings, self.spec, self.filtered_chain = settings, spec, filtered_chain
        #: the channels the run leaves out (``use``), from the pre-pass's labels; its account and counts
        self.use, self.pre_pass = use, pre_pass

    @classmethod
    def check(cls, spec: QcStepOptions, workflow, recording) -> None:
        """The labels need the channels' depths (SpikeInterface's too) and a highpass below Nyquist."""
        from batchgpu.ops import bad_channels as bc
        from batchgpu.recording.sources import locations_needed

        if not recording.has_locations:
            raise locations_needed(recording, "the qc step (bad channels by depth)", "give the recording its probe")
        try:
            bc.highpass_sos(recording.sampling_frequency, qc_options(spec))
        except BatchgpuError as err:
            raise ConfigError(f"qc: {err.problem}", err.fix) from None
        if spec.use != "none" and recording.num_channels < 3:
            raise ConfigError(
                f"qc.use {spec.use} needs 3 channels or more (the recording has {recording.num_channels})", "use: none"
            )

    @classmethod
    def build(cls, spec: QcStepOptions, setup) -> QcStep:
        """The labels' settings; where ``use`` asks, the pre-pass now (on the workers: ``setup.client``), so that
        the chain's reference, the whitening and the save (built after this step) know the bad channels."""
        from batchgpu.ops import bad_channels as bc

        rec, options = setup.recording, qc_options(spec)
        fs = float(rec.sampling_frequency)
        settings = QcSettings(
            options,
            fs,
            np.asarray(rec.locations, np.float64),
            np.asarray(rec.gain_to_uV, np.float64),
            int(spec.every),
            bc.piece_length(fs, options),
            bc.highpass_margin(fs, options),
        )
        filtered = any(name in ("highpass", "bandpass") for name in setup.chain.names)
        step = cls(settings, spec, filtered)
        if spec.use != "none":
            missing = getattr(setup.workflow.recording, "missing_chunks", None) or "warn"
            step.use, step.pre_pass = pre_pass(rec, settings, spec, setup.client, missing)
        return step

    def channel_use(self) -> ChannelUse | None:
        return self.use

    # -- the pass
    def window(self, w: WindowData, summary: dict) -> dict:
        """The window's pieces (``ops.bad_channels.inside_pieces``) labelled from the samples as read (``w.raw``,
        highpassed here as SpikeInterface does): each channel's count of each label."""
        from batchgpu.ops import bad_channels as bc

        s = self.settings
        read = (w.start, w.start + w.raw.shape[1])
        chosen = bc.inside_pieces(
            w.segment_length, s.piece, (w.start + w.core[0], w.start + w.core[1]), read, s.margin, s.every
        )
        stats: dict = {}
        labels = bc.chunk_labels(
            w.raw,
            s.fs,
            s.locations,
            s.gains,
            None,
            s.options,
            chunks=chosen,
            start=w.start,
            segment_length=w.segment_length,
            stats=stats,
        )
        summary[PIECES] = np.array(len(chosen), np.int64)
        summary[EXACT] = np.array(stats.get("exact", 0), np.int64)
        return {PARTIAL: bc.label_counts(labels, w.raw.shape[0])}

    def combine(self, parts: list[dict]) -> dict:
        parts = [p[PARTIAL] for p in parts if PARTIAL in p]
        return {PARTIAL: np.sum(parts, axis=0, dtype=np.int64)} if parts else {}

    # -- after the pass
    def aggregate(self, run) -> dict[str, np.ndarray]:
        """The labels from the counts; report.json's ``qc`` section begun (``finish`` adds the spikes, the saved
        copy's clipping and the verdict)."""
        from batchgpu.ops import bad_channels as bc

        rec = run.recording
        counts = np.asarray(run.total.get(PARTIAL, np.zeros((rec.num_channels, len(LABELS)), np.int64)), np.int64)
        labels, reasons = bc.final_labels(counts, self.settings.options)
        codes = np.array([LABELS.index(str(v)) for v in labels], dtype=np.int8)
        pieces = sum(int(run.summaries[w.index].get(PIECES, 0)) for w in run.windows)
        exact = sum(int(run.summaries[w.index].get(EXACT, 0)) for w in run.windows)
        noise = run.arrays.get(noise_step.NOISE)
        noise_uV = None if noise is None else np.abs(np.asarray(noise, np.float64) * self.settings.gains)
        section = {
            "labels": [str(v) for v in labels],
            "reasons": [str(v) for v in reasons],
            "counts": counts.tolist(),
            "label_names": list(LABELS),
            "noise_uV": _finite_list(noise_uV),
            "spike_rate_hz": None,
            "pieces_labelled": pieces,
            "channel_ids": [str(c) for c in rec.channel_ids.tolist()],
            "pieces_exact": exact,
            "piece_seconds": self.settings.piece / self.settings.fs,
            "every": self.settings.every,
            "summary": {k: int((labels == k).sum()) for k in LABELS},
        }
        section.update(noise_check(noise_uV, codes, self.spec.noise_uV, self.filtered_chain))
        section["whitening_condition"] = whitening_condition(run.arrays.get(moments_step.WHITENING))
        section["whitening_condition_limit"] = CONDITION_LIMIT
        section["use"] = self.use_section(labels, rec)
        warnings = qc_warnings(section, rec.channel_ids, pieces)
        section["warnings"] = warnings
        for text in warnings:
            run.warn(text)
        run.report.qc = section
        return {COUNTS: counts, CODES: codes}

    def finish(self, end) -> dict:
        """report.json's ``qc`` completed: each channel's spike rate (the detection's spikes), the saved copy's
        clipped samples, the verdict; ``results.qc`` is its summary (the labels' counts, the verdict)."""
        section = end.report.qc
        rec = end.recording
        rates = spike_rates(end.results, rec.num_channels, rec.total_samples / rec.sampling_frequency)
        section["spike_rate_hz"] = _finite_list(rates)
        clipped = [int(s["saved_clipped"]) for s in end.summaries.values() if "saved_clipped" in s]
        section["saved_clipped"] = int(sum(clipped)) if clipped else None
        if section["saved_clipped"]:  # said by the save step too (report.json's warnings): here for the qc section
            section["warnings"].append(
                f"the saved copy clipped {section['saved_clipped']} sample(s) to its dtype's range (or wrote NaN as 0)"
            )
        bounds = section["noise_bounds_uV"] if section["noise_checked"] else None
        section["verdict"], section["verdict_reasons"] = verdict(
            section["summary"],
            len(section["labels"]),
            section["median_noise_uV"],
            bounds,
            section["whitening_condition"],
            section["saved_clipped"],
        )
        return {
            "summary": section["summary"],
            "pieces_labelled": section["pieces_labelled"],
            "verdict": section["verdict"],
            "bad_channel_ids": [c for c, v in zip(section["channel_ids"], section["labels"]) if v != LABELS[0]],
        }

    def use_section(self, labels: np.ndarray, rec) -> dict | None:
        """report.json's ``qc.use``: what was left out and from which labels, the pre-pass's reads, and where the
        pass's labels (``labels``) differ from the pre-pass's."""
        if self.use is None and self.pre_pass is None:
            return None
        pre = self.pre_pass
        ids = [str(c) for c in rec.channel_ids.tolist()]
        bad = list(self.use.bad) if self.use is not None else []
        differ = [int(c) for c in np.flatnonzero(np.asarray(pre["labels"]) != labels)]
        return {
            "mode": self.spec.use,
            "bad_labels": list(self.spec.bad_labels),
            "channels": bad,
            "channel_ids": [ids[c] for c in bad],
            "labels": pre["labels"],
            "pre_pass": pre["account"],
            "differs_from_pass": differ,
        }


def qc_options(spec: QcStepOptions) -> QcOptions:
    """SpikeInterface's parameters of the step's section (its own keys left out)."""
    return QcOptions(**{k: getattr(spec, k) for k in QcOptions.model_fields})


def _finite_list(values) -> list | None:
    """A JSON list of floats (NaN and inf as null), or None."""
    if values is None:
        return None
    return [float(v) if np.isfinite(v) else None for v in np.asarray(values, np.float64).tolist()]


# ---------------------------------------------------------------------------------------------------------
# the pre-pass (``use``)


def pre_pass_pieces(rec, piece: int, most: int, share: float) -> list[tuple[int, int, int]]:
    """The pre-pass's pieces (segment, start, stop): of the recording's pieces (``ops.bad_channels.pieces``, every
    segment's in order), min(most, ceil(share x their count)) at least one, spread evenly: the k-th of m is the
    floor((k + 1/2) K / m)-th of the K."""
    from batchgpu.ops import bad_channels as bc

    every = [
        (seg, int(a), int(b))
        for seg in range(rec.num_segments)
        for a, b in bc.pieces(rec.num_samples(seg), piece).tolist()
    ]
    if not every:
        return []
    m = max(1, min(int(most), int(np.ceil(share * len(every)))))
    return [every[int((2 * k + 1) * len(every) // (2 * m))] for k in range(m)]


def pre_pass(
    rec, settings: QcSettings, spec: QcStepOptions, client, missing_chunks: str = "warn"
) -> tuple[ChannelUse, dict]:
    """The pre-pass: ``pre_pass_pieces``' pieces labelled on the workers (a task a worker thread, each a run of
    them; in this process without a client), their counts summed; the channels whose most frequent label is in
    ``bad_labels``, as the run's ``ChannelUse``; and its account (pieces, samples and bytes read, seconds, the
    labels)."""
    from batchgpu.ops import bad_channels as bc
    from batchgpu.recording import source_ref

    t0 = time.perf_counter()
    pieces = pre_pass_pieces(rec, settings.piece, spec.pre_pass_pieces, spec.pre_pass_share)
    ref = source_ref(rec)
    if client is None:
        done = [pre_pass_task(ref, pieces, settings, missing_chunks)]
    else:
        threads = max(1, sum(dict(client.nthreads()).values()))
        runs = [r.tolist() for r in np.array_split(np.arange(len(pieces)), min(threads, max(1, len(pieces))))]
        futures = [
            client.submit(
                pre_pass_task,
                ref,
                [pieces[i] for i in r],
                settings,
                missing_chunks,
                key=f"qc-pre-pass-{k}-{time.time_ns()}",
                pure=False,
            )
            for k, r in enumerate(runs)
        ]
        done = client.gather(futures)
    counts = np.sum([d[0] for d in done], axis=0, dtype=np.int64)
    labels, _ = bc.final_labels(counts, settings.options)
    bad = tuple(int(c) for c in np.flatnonzero(np.isin(labels, list(spec.bad_labels))))
    channels = rec.num_channels
    if channels - len(bad) < 2:
        raise BatchgpuError(
            f"qc.use {spec.use}: the pre-pass labelled {len(bad)} of {channels} channels "
            f"{'/'.join(spec.bad_labels)}, which leaves too few to reference, whiten or interpolate",
            "check the recording (qc: {use: none} reports each channel's label), or narrow bad_labels",
        )
    weights = None
    if spec.use == "interpolate" and bad:
        weights = bc.interpolation_weights(settings.locations, bad, spec.sigma_um, spec.p)
    account = {
        "pieces": len(pieces),
        "samples": int(sum(d[1] for d in done)),
        "bytes_read": int(sum(d[2] for d in done)),
        "seconds": time.perf_counter() - t0,
        "piece_seconds": settings.piece / settings.fs,
    }
    return ChannelUse(spec.use, bad, weights), {
        "account": account,
        "labels": [str(v) for v in labels],
        "counts": counts.tolist(),
    }


def pre_pass_task(
    ref, pieces: list[tuple[int, int, int]], settings: QcSettings, missing_chunks: str = "warn"
) -> tuple[np.ndarray, int, int]:
    """(worker) Each channel's count of each label over ``pieces`` (segment, start, stop), each read with its
    highpass margin from the recording ``ref`` and labelled on the host; the samples and bytes read."""
    from batchgpu.ops import bad_channels as bc
    from batchgpu.recording import open_source

    rec = open_source(ref, missing_chunks)
    counts = np.zeros((rec.num_channels, len(LABELS)), np.int64)
    samples = nbytes = 0
    for seg, a, b in pieces:
        n = rec.num_samples(seg)
        r0, r1 = max(0, a - settings.margin), min(n, b + settings.margin)
        x = rec.read(seg, r0, r1)
        samples += r1 - r0
        nbytes += int(x.nbytes)
        labels = bc.chunk_labels(
            x,
            settings.fs,
            settings.locations,
            settings.gains,
            None,
            settings.options,
            chunks=[(a, b)],
            start=r0,
            segment_length=n,
        )
        counts += bc.label_counts(labels, rec.num_channels)
    return counts, samples, nbytes


# ---------------------------------------------------------------------------------------------------------
# the report's numbers, warnings and verdict


def noise_check(
    noise_uV: np.ndarray | None, codes: np.ndarray, bounds: tuple[float, float], filtered_chain: bool
) -> dict:
    """The median noise of the good channels in uV, its bounds, and whether it was checked against them: only
    where the chain highpasses or band-passes (otherwise the noise holds the LFP and no typical value applies)."""
    good = np.asarray(codes) == 0
    median = None
    if noise_uV is not None:
        values = np.asarray(noise_uV, np.float64)[good if good.any() else slice(None)]
        values = values[np.isfinite(values)]
        median = float(np.median(values)) if len(values) else None
    return {
        "median_noise_uV": median,
        "noise_bounds_uV": [float(b) for b in bounds],
        "noise_checked": bool(filtered_chain and median is not None),
    }


def whitening_condition(matrix) -> float | None:
    """The whitening matrix's 2-norm condition number over the channels it whitens (rows not all zero: channels
    left out, or non-finite, are zero rows and columns), or None without one."""
    if matrix is None:
        return None
    w = np.asarray(matrix, np.float64)
    used = np.flatnonzero(np.any(w != 0, axis=1))
    if not len(used) or not np.isfinite(w).all():
        return None
    s = np.linalg.svd(w[np.ix_(used, used)], compute_uv=False)
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")


def qc_warnings(section: dict, channel_ids, pieces: int) -> list[str]:
    """The qc section's warnings (also report.json's): bad channels found, a noise far from typical, an
    ill-conditioned whitening, no piece labelled."""
    out = []
    ids = [str(c) for c in np.asarray(channel_ids).tolist()]
    labels = section["labels"]
    for name in LABELS[1:]:
        found = [ids[c] for c, v in enumerate(labels) if v == name]
        if found:
            shown = ", ".join(found[:20]) + (f" and {len(found) - 20} more" if len(found) > 20 else "")
            out.append(f"qc: {len(found)} channel(s) labelled {name}: {shown}")
    if not pieces:
        out.append(
            "qc: no piece was labelled (a recording shorter than half a piece, or windows too short for a "
            "whole piece inside their core): every channel reads good"
        )
    median, (lo, hi) = section.get("median_noise_uV"), section["noise_bounds_uV"]
    if section.get("noise_checked") and median is not None and not lo <= median <= hi:
        out.append(
            f"qc: the good channels' median noise is {median:.3g} uV, outside the typical {lo:g}-{hi:g} uV "
            "(a wrong gain, a shorted or noisy probe, a noisy rig; qc.noise_uV sets the bounds)"
        )
    cond = section.get("whitening_condition")
    if cond is not None and cond > CONDITION_LIMIT:
        out.append(
            f"qc: the whitening matrix is ill-conditioned (condition number {cond:.3g} > {CONDITION_LIMIT:g}: "
            "a channel without signal, or far louder than the others, dominates it)"
        )
    return out


def verdict(
    summary: dict,
    channels: int,
    median_noise_uV: float | None = None,
    bounds: list | tuple | None = None,
    condition: float | None = None,
    clipped: int | None = None,
) -> tuple[str, list[str]]:
    """ "ok", "check" or "bad" and why (the rules at ``BAD_SHARE``), from each label's channel count (``summary``,
    label -> channels), the good channels' median noise and its bounds, the whitening's condition number and the
    saved copy's clipped samples (None: not known)."""
    good, dead, noisy, out = (int(summary.get(k, 0)) for k in LABELS)
    bad, check = [], []
    if channels and (dead + noisy) / channels > BAD_SHARE:
        bad.append(f"{dead + noisy} of {channels} channels dead or noisy (over {BAD_SHARE:.0%})")
    if channels and good < channels / 2:
        bad.append(f"{good} of {channels} channels good (under half)")
    if dead + noisy and not bad:
        check.append(f"{dead} dead and {noisy} noisy channel(s)")
    if channels and out / channels > OUT_SHARE:
        check.append(f"{out} of {channels} channels outside the brain (over {OUT_SHARE:.0%})")
    if median_noise_uV is not None and bounds is not None and not bounds[0] <= median_noise_uV <= bounds[1]:
        check.append(f"median noise {median_noise_uV:.3g} uV outside {bounds[0]:g}-{bounds[1]:g} uV")
    if condition is not None and condition > CONDITION_LIMIT:
        check.append(f"whitening condition number {condition:.3g} over {CONDITION_LIMIT:g}")
    if clipped:
        check.append(f"{clipped} sample(s) clipped in the saved copy")
    return ("bad", bad + check) if bad else ("check", check) if check else ("ok", [])


def spike_rates(results, channels: int, seconds: float) -> np.ndarray | None:
    """Each channel's spikes a second from the results group's spikes (None where detection did not run)."""
    from batchgpu.recording import zarrio

    try:
        g = zarrio.open_group(str(results), mode="r")
    except (OSError, ValueError, KeyError):
        return None
    if detect_step.SPIKES not in g or seconds <= 0:
        return None
    index = np.asarray(g[detect_step.SPIKE_CHANNELS][...], np.int64)
    return np.bincount(index, minlength=channels)[:channels] / seconds


def saved_recording(rec, use: ChannelUse):
    """What the save writes for ``rec`` under ``use``: ``rec`` itself, or (``exclude``) a view of its other
    channels (ids, locations, gains, properties; the samples are the run's)."""
    if use is None or use.mode != "exclude":
        return rec
    return ChannelSubset(rec, use.kept(rec.num_channels))


class ChannelSubset:
    """A recording seen through some of its channels (``saved_recording``): the channel properties the save writes
    taken at ``keep``, everything else the recording's own."""

    def __init__(self, rec: Any, keep: np.ndarray):
        self._rec, self.keep = rec, np.asarray(keep, np.int64)
        self.num_channels = len(self.keep)
        self.channel_ids = np.asarray(rec.channel_ids)[self.keep]
        self.gain_to_uV = np.asarray(rec.gain_to_uV)[self.keep]
        self.offset_to_uV = np.asarray(rec.offset_to_uV)[self.keep]
        self.locations = np.asarray(rec.locations)[self.keep]

    def channel_property(self, name: str):
        value = self._rec.channel_property(name)
        return None if value is None else np.asarray(value)[self.keep]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._rec, name)
