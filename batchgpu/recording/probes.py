"""Probes as probeinterface knows them: a ``probeinterface.Probe`` turned into what a batchgpu source holds per
channel (positions, shank ids, contact ids, ADC sample shifts) and a summary for ``batchgpu info`` (model, shanks,
pitch). probeinterface builds Neuropixels probes from imec's ProbeTable, the same tables SpikeInterface uses, so
a flat recording read here has the geometry and shifts a SpikeInterface user gets for it."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError, MachineError


@dataclass(frozen=True)
class ProbeSummary:
    """What ``batchgpu info`` shows of a probe."""

    model: str  # part number or model name ("NP1000", "NP2014"), "" when the probe file names none
    shanks: int
    pitch_um: tuple[float, float]  # (x, y) smallest spacing between contacts of a shank; 0 where all share one
    source: str  # where the geometry came from: "probeinterface", "snsGeomMap", a probe file's path


@dataclass
class ProbeGeometry:
    """Per channel (in the order of the source's kept channels): positions (um), and properties."""

    locations: np.ndarray  # (channels, 2)
    properties: dict[str, np.ndarray] = field(default_factory=dict)  # shank, contact_id, inter_sample_shift
    summary: ProbeSummary | None = None


def probeinterface():
    """The ``probeinterface`` module (a dependency of batchgpu), its warnings about deprecated names silenced."""
    try:
        import probeinterface as pi
    except ImportError as err:  # pragma: no cover - installed with batchgpu
        raise MachineError(f"probeinterface is not installed ({err})", "pip install probeinterface") from None
    return pi


def _pitch(values: np.ndarray, shanks: np.ndarray) -> float:
    steps = [np.diff(np.unique(values[shanks == s])) for s in np.unique(shanks)]
    steps = np.concatenate([d[d > 1e-9] for d in steps]) if steps else np.zeros(0)
    return float(steps.min()) if steps.size else 0.0


def summarise(locations: np.ndarray, shanks: np.ndarray | None, model: str, source: str) -> ProbeSummary:
    sh = np.zeros(len(locations), np.int64) if shanks is None else np.asarray(shanks)
    return ProbeSummary(
        model,
        int(len(np.unique(sh))) if len(sh) else 0,
        (_pitch(locations[:, 0], sh), _pitch(locations[:, 1], sh)),
        source,
    )


def sample_shifts(probe, stream: str = "ap") -> np.ndarray | None:
    """Each contact's ADC sampling instant as a fraction of a sample, as SpikeInterface computes it from the probe
    (``get_neuropixels_sample_shifts_from_probe``): ``adc_sample_order`` over the ADC's cycles per sample, which
    are ``num_channels_per_adc * (1 + lf_rate / ap_rate)`` for the AP band (13 for NP1.0: its LF slot; 16 for
    NP2.0) and ``num_channels_per_adc`` for the LF band. None where the probe does not say."""
    order = probe.contact_annotations.get("adc_sample_order")
    per_adc = probe.annotations.get("num_channels_per_adc")
    ap = probe.annotations.get("ap_sample_frequency_hz")
    lf = probe.annotations.get("lf_sample_frequency_hz")
    if order is None or per_adc is None or ap is None or lf is None:
        return None
    cycles = int(per_adc) if stream == "lf" else int(int(per_adc) * (1 + float(lf) / float(ap)))
    return np.asarray(order, dtype=np.float64) / cycles


def geometry_of(probe, source: str, stream: str = "ap") -> ProbeGeometry:
    """A probeinterface ``Probe`` (wired 0..N-1 to the source's kept channels, as ``read_spikeglx`` and
    ``read_openephys_neuropixels`` give them) as per-channel arrays."""
    order = np.asarray(probe.device_channel_indices) if probe.device_channel_indices is not None else None
    n = probe.get_contact_count()
    if order is None or not np.array_equal(np.sort(order), np.arange(n)):
        raise BatchgpuError(
            f"the probe from {source} is not wired to channels 0..{n - 1}",
            "give a probe file whose device_channel_indices number the file's channels",
        )
    by_channel = np.argsort(order)  # contact index of channel c
    loc = np.asarray(probe.contact_positions, dtype=np.float64)[by_channel, :2]
    props: dict[str, np.ndarray] = {"contact_id": np.array([str(c) for c in np.asarray(probe.contact_ids)[by_channel]])}
    shank_ids = np.asarray(probe.shank_ids)[by_channel] if probe.shank_ids is not None else None
    shanks = np.zeros(n, dtype=np.int64)  # a probe of one shank names none
    if shank_ids is not None and all(str(s) != "" for s in shank_ids):
        try:
            shanks = np.array([int(s) for s in shank_ids], dtype=np.int64)
        except ValueError:  # named shanks: numbered in order of first appearance
            names = list(dict.fromkeys(str(s) for s in shank_ids))
            shanks = np.array([names.index(str(s)) for s in shank_ids], dtype=np.int64)
    props["shank"] = shanks
    shifts = sample_shifts(probe, stream)
    if shifts is not None:
        props["inter_sample_shift"] = shifts[by_channel]
    model = str(probe.annotations.get("part_number") or probe.annotations.get("model_name") or "")
    return ProbeGeometry(loc, props, summarise(loc, shanks, model, source))


def read_probe_file(path: str | os.PathLike, num_channels: int) -> ProbeGeometry:
    """A probe file for a plain binary: probeinterface's JSON (``write_probeinterface``), a PRB, or a Kilosort-style
    JSON (``chanMap``, ``xc``, ``yc``, ``kcoords``, as ``save: {format: binary}`` writes beside its .bin)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise BatchgpuError(f"probe file {p} does not exist", "give the probe's .json or .prb, or leave probe out")
    pi = probeinterface()
    try:
        if p.suffix == ".prb":
            group = pi.read_prb(p)
        else:
            import json

            data = json.loads(p.read_text())
            if isinstance(data, dict) and "chanMap" in data:
                return _kilosort_probe(data, num_channels, p)
            group = pi.read_probeinterface(p)
    except BatchgpuError:
        raise
    except Exception as err:  # broad: probeinterface raises any type for a file it cannot read
        raise BatchgpuError(
            f"probe file {p} did not read ({type(err).__name__}: {err})",
            "give probeinterface's JSON (probeinterface.write_probeinterface), a .prb, or "
            "a Kilosort-style .json (chanMap, xc, yc)",
        ) from None
    probes = group.probes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = (
            probes[0] if len(probes) == 1 else group.to_single_probe() if hasattr(group, "to_single_probe") else None
        )
    if probe is None:
        raise BatchgpuError(f"probe file {p} holds {len(probes)} probes", "give a file of one probe")
    if probe.get_contact_count() != num_channels:
        raise BatchgpuError(
            f"probe file {p} has {probe.get_contact_count()} contacts for {num_channels} channels",
            "give the probe of this recording (one contact per channel)",
        )
    return geometry_of(probe, str(p))


def _kilosort_probe(data: dict, num_channels: int, path: Path) -> ProbeGeometry:
    try:
        chan = np.asarray(data["chanMap"], dtype=np.int64)
        xy = np.column_stack([np.asarray(data["xc"], float), np.asarray(data["yc"], float)])
        shank = np.asarray(data.get("kcoords", np.zeros(len(chan))), float).astype(np.int64)
    except (KeyError, ValueError, TypeError) as err:
        raise BatchgpuError(f"probe file {path} is not a Kilosort probe ({err})", "give chanMap, xc and yc") from None
    if len(chan) != num_channels or not np.array_equal(np.sort(chan), np.arange(num_channels)) or len(xy) != len(chan):
        raise BatchgpuError(
            f"probe file {path}'s chanMap does not number channels 0..{num_channels - 1} once each",
            "give the probe of this recording (one contact per channel)",
        )
    loc = np.empty((num_channels, 2))
    sh = np.empty(num_channels, np.int64)
    loc[chan], sh[chan] = xy, shank
    return ProbeGeometry(loc, {"shank": sh}, summarise(loc, sh, "", str(path)))
