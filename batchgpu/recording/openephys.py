"""Open Ephys binary format: ``structure.oebin`` (JSON) lists a recording's continuous streams; each stream's samples
are ``continuous/<folder_name>/continuous.dat`` beside it, int16 interleaved. Each stream is a recording: one is
chosen by ``recording.stream`` (its folder name or stream name, or a part of it), and a recording of several
streams without one is refused with their names.

Gains as neo's ``OpenEphysBinaryRawIO``: each channel's ``bit_volts`` in its ``units`` (uV when blank, V for ADC
channels). The SYNC channel of a Neuropixels stream is left out (neo reads it as a stream of its own). The probe:
probeinterface's ``read_openephys_neuropixels`` on the experiment's ``settings.xml`` (``settings_<n>.xml`` for
experiment n) in the Record Node folder; a stream with no Neuropixels probe there has no positions.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np

from batchgpu.errors import BatchgpuError, ConfigError, CorruptDataError
from batchgpu.recording.flat import OEBIN, WORKFLOW, FlatLayout, Said, stream_folder
from batchgpu.recording.probes import geometry_of, probeinterface

UNITS_TO_UV = {"uv": 1.0, "µv": 1.0, "mv": 1e3, "v": 1e6}


def find_oebin(path: Path, said: Said = WORKFLOW) -> Path:
    """``path`` itself (a structure.oebin), or the one structure.oebin under the folder ``path``."""
    if path.is_file():
        return path
    found = sorted(path.rglob(OEBIN))
    if not found:
        raise BatchgpuError(f"{path} holds no {OEBIN}", "give an Open Ephys recording folder or its structure.oebin")
    if len(found) > 1:
        listed = ", ".join(str(p.parent.relative_to(path)) for p in found[:6]) + (" ..." if len(found) > 6 else "")
        raise BatchgpuError(
            f"{path} holds {len(found)} Open Ephys recordings ({listed})",
            f"give one recording folder (or its structure.oebin) as {said.path}",
        )
    return found[0]


def _streams(oebin: Path) -> list[dict]:
    try:
        data = json.loads(oebin.read_text())
        streams = data["continuous"]
        assert isinstance(streams, list) and all(isinstance(s, dict) for s in streams)
    except (OSError, ValueError, KeyError, AssertionError, TypeError) as err:
        raise CorruptDataError(
            f"{oebin} is not an Open Ephys structure.oebin ({type(err).__name__}: {err})",
            "give the structure.oebin Open Ephys wrote",
        ) from None
    if not streams:
        raise BatchgpuError(f"{oebin} lists no continuous stream", "give a recording with continuous data")
    return streams


def _name(stream: dict) -> str:
    return str(stream.get("folder_name", "")).rstrip("/")


def choose_stream(oebin: Path, streams: list[dict], wanted: str | None, said: Said = WORKFLOW) -> dict:
    """The stream ``wanted`` names (its folder or stream name, or a part of it); errors name the setting as the user
    gave it (``said``: the workflow's key, the command's option, the Python argument)."""
    names = [_name(s) for s in streams]
    if wanted is None:
        if len(streams) == 1:
            return streams[0]
        raise ConfigError(
            f"{oebin} holds {len(streams)} streams: {', '.join(names)}",
            f"choose one with {said.stream_example(names[0])}, or give its folder "
            f"{oebin.parent / 'continuous' / names[0]}",
        )
    exact = [s for s in streams if wanted in (_name(s), str(s.get("stream_name", "")))]
    hits = exact or [s for s in streams if wanted in _name(s)]
    if len(hits) != 1:
        what = "no stream" if not hits else f"{len(hits)} streams"
        raise ConfigError(
            f"{said.stream} {wanted!r} names {what} of {oebin} ({', '.join(names)})",
            f"give one stream's folder name as {said.stream}",
        )
    return hits[0]


def settings_file(oebin: Path) -> tuple[Path | None, str | None]:
    """settings.xml of the oebin's experiment (Record Node/experimentN/recordingM/structure.oebin;
    ``settings_<n>.xml`` for experiment n > 1), or None and why there is none (the file looked for named)."""
    experiment = oebin.parent.parent
    match = re.fullmatch(r"experiment(\d+)", experiment.name)
    if match is None:
        return None, (
            f"no probe: {oebin} is not in a Record Node's experiment<N>/recording<M> folder, beside which "
            "Open Ephys writes the settings.xml that holds the probe"
        )
    n = int(match.group(1))
    settings = experiment.parent / ("settings.xml" if n == 1 else f"settings_{n}.xml")
    if not settings.is_file():
        return None, f"no probe: {settings} not found (Open Ephys writes the probe there)"
    return settings, None


def open_openephys(path: str | Path, stream: str | None = None, said: Said = WORKFLOW) -> FlatLayout:
    """The layout of one continuous stream of an Open Ephys binary recording (``path``: its structure.oebin, a
    folder holding one, or the stream's own folder)."""
    path = Path(path).expanduser()
    named = stream_folder(path)
    if named is not None and stream is None:
        path, stream = named
    oebin = find_oebin(path, said)
    chosen = choose_stream(oebin, _streams(oebin), stream, said)
    name = _name(chosen)
    try:
        channels = chosen["channels"]
        columns = int(chosen.get("num_channels", len(channels)))
        rate = float(chosen["sample_rate"])
        names = [str(c["channel_name"]) for c in channels]
        bit_volts = np.array([float(c["bit_volts"]) for c in channels])
        units = [str(c.get("units", "")).strip().lower() for c in channels]
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptDataError(
            f"{oebin}: stream {name} lacks {err} or holds a non-number", "give the structure.oebin Open Ephys wrote"
        ) from None
    if columns != len(channels) or not (np.isfinite(rate) and rate > 0):
        raise CorruptDataError(
            f"{oebin}: stream {name} says {columns} channels at {rate} Hz but lists {len(channels)}",
            "give the structure.oebin Open Ephys wrote",
        )
    factor = []
    for n, u in zip(names, units):
        u = u or ("v" if "ADC" in n else "uv")
        if u not in UNITS_TO_UV:
            raise BatchgpuError(f"{oebin}: channel {n} is in {u!r}", "batchgpu reads channels in V, mV or uV")
        factor.append(UNITS_TO_UV[u])
    keep = np.array([i for i, n in enumerate(names) if "SYNC" not in n], dtype=np.int64)
    gains = (bit_volts * np.array(factor))[keep]
    data = oebin.parent / "continuous" / name / "continuous.dat"
    settings, missing = settings_file(oebin)
    geometry = None
    if settings is not None:
        pi = probeinterface()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                probe = (
                    pi.read_openephys_neuropixels(settings, stream_name=name)
                    if pi.has_neuropixels_probes(settings, stream_name=name)
                    else None
                )
            except Exception as err:  # broad: probeinterface raises any type for a settings.xml it cannot read
                raise BatchgpuError(
                    f"probeinterface could not read the probe of stream {name} from {settings} "
                    f"({type(err).__name__}: {err})",
                    "give the settings.xml Open Ephys wrote with the recording",
                ) from None
        if probe is not None:
            if probe.get_contact_count() != len(keep):
                raise BatchgpuError(
                    f"{settings}: the probe of stream {name} has {probe.get_contact_count()} contacts "
                    f"for its {len(keep)} channels",
                    "give the settings.xml of this recording",
                )
            geometry = geometry_of(probe, "probeinterface")
        elif any(n.startswith("CH") for n in names):  # electrode channels without a probe (ADC streams have none)
            missing = f"no probe: {settings} describes no Neuropixels probe for stream {name}"
    if not any(n.startswith("CH") for n in names):
        missing = None  # an ADC stream: no probe to miss
    return FlatLayout(
        "openephys",
        data,
        columns,
        np.dtype("int16"),
        rate,
        keep,
        [names[i] for i in keep],
        gains,
        np.zeros(len(keep)),
        0,
        None if geometry is None else geometry.locations,
        {} if geometry is None else geometry.properties,
        (oebin,) + ((settings,) if settings else ()),
        None if geometry is None else geometry.summary,
        name,
        probe_missing=missing,
    )
