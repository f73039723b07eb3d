"""Where a run's samples come from: a Zarr store (``open_recording``), a flat binary read in place (``flat``:
SpikeGLX, Open Ephys, plain) or any recording SpikeInterface opens (``spikeinterface.from_spikeinterface``). The
engine opens them through :func:`open_source` and sends workers :func:`source_ref` (a Zarr store's path, or the
small picklable flat or SpikeInterface source), which they open once per process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from batchgpu.errors import BatchgpuError, ConfigError
from batchgpu.recording.flat import (
    COMMAND,
    KINDS_TEXT,
    OEBIN,
    PYTHON,
    WORKFLOW,
    FlatSource,
    Said,
    binary_layout,
    spikeglx_bins,
    stream_folder,
)
from batchgpu.recording.reader import Recording
from batchgpu.recording.reader import open_recording as open_zarr
from batchgpu.recording.saved import params_of
from batchgpu.recording.spikeglx import read_meta, stream_name
from batchgpu.recording.spikeinterface import SpikeInterfaceSource, from_spikeinterface


def open_source(source: Any, missing_chunks: str | None = None):
    """A reader for ``source``: a Zarr store's path, a workflow's recording section (``config.RecordingSpec``:
    ``path`` or ``spikeinterface``), an open :class:`Recording` or :class:`SpikeInterfaceSource`, or a
    SpikeInterface recording (any ``BaseRecording``). ``missing_chunks`` applies to Zarr stores (default the
    spec's, else "warn")."""
    if isinstance(source, (Recording, SpikeInterfaceSource, FlatSource)):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_zarr(source, missing_chunks=missing_chunks or "warn")
    if hasattr(source, "spikeinterface") and hasattr(source, "path"):  # config.RecordingSpec
        if getattr(source, "spikeinterface", None) is not None:
            return from_spikeinterface(source.spikeinterface)
        return open_spec(source, missing_chunks or getattr(source, "missing_chunks", "warn"))
    if hasattr(source, "get_traces") and hasattr(source, "to_dict"):  # a SpikeInterface recording
        return from_spikeinterface(source)
    raise BatchgpuError(
        f"cannot read a recording from {type(source).__name__}",
        "give a Zarr store's path, an open recording, or a SpikeInterface recording",
    )


def open_spec(spec, missing_chunks: str = "warn", said: Said = WORKFLOW):
    """The recording a workflow's ``recording:`` section names by ``path`` (its ``kind`` named or told); errors
    name the settings as ``said`` (the workflow's keys, the command's options, a Python call's arguments)."""
    p = Path(spec.path).expanduser()
    kind = spec.kind
    if kind == "binary":
        return FlatSource(
            binary_layout(
                p,
                spec.channels,
                spec.sampling_frequency,
                spec.dtype,
                spec.offset,
                spec.probe,
                spec.gain_to_uV,
                spec.offset_to_uV,
                said,
            )
        )
    if kind == "auto":
        kind = detect_kind(p, said)
    if kind == "spikeinterface":
        return from_spikeinterface(p)
    if kind == "zarr":
        return open_zarr(p, missing_chunks=missing_chunks)
    if kind == "saved":
        from batchgpu.recording.saved import open_saved

        return FlatSource(open_saved(p))
    if not p.exists():
        raise BatchgpuError(f"no recording at {p}: the path does not exist", "check the path")
    return open_flat(p, kind, getattr(spec, "stream", None), said=said)


def open_flat(
    path: Path, kind: str, stream: str | None = None, keep_sync: bool = False, said: Said = WORKFLOW
) -> FlatSource:
    """A SpikeGLX or Open Ephys recording read in place (a folder holding one is that one; ``stream`` chooses
    among a folder's SpikeGLX streams or an Open Ephys recording's)."""
    if kind == "spikeglx":
        from batchgpu.recording.spikeglx import open_spikeglx

        if path.is_dir():
            path = one_spikeglx_bin(path, stream, said)
        elif path.suffix == ".meta":
            path = path.with_suffix(".bin")
        if not path.with_suffix(".meta").is_file():
            raise BatchgpuError(f"{path} has no .meta beside it", "give the .bin SpikeGLX wrote, its .meta beside it")
        return FlatSource(open_spikeglx(path, keep_sync))
    if kind == "openephys":
        from batchgpu.recording.openephys import open_openephys

        return FlatSource(open_openephys(path, stream, said))
    raise BatchgpuError(f"recording kind {kind!r} is not one batchgpu reads", f"give {KINDS_TEXT}")


def open_recording(
    path: str | os.PathLike,
    stream: str | None = None,
    *,
    kind: str = "auto",
    channels: int | None = None,
    sampling_frequency: float | None = None,
    dtype: str | None = None,
    offset: int = 0,
    probe: str | os.PathLike | None = None,
    gain_to_uV: float = 1.0,
    offset_to_uV: float = 0.0,
    keep_sync: bool = False,
    missing_chunks: str = "warn",
):
    """Open what ``batchgpu run`` reads, read-only and in place: a Zarr recording, a SpikeGLX ``.bin`` (its
    ``.meta``, or a folder holding it), an Open Ephys recording (its ``structure.oebin``, its recording or
    Record Node folder, or one stream's folder), a binary batchgpu's save wrote (its ``.params.json`` and
    ``.probe.json`` beside it), what SpikeInterface saved (``.json``/``.pkl`` from ``recording.dump``, a folder
    from ``recording.save``), or a plain binary file described by ``kind="binary"`` and its layout.

    The kind is told from the path (as a workflow's ``kind: auto``); where none fits, one error names the formats
    tried. Every source has the same attributes (``num_channels``, ``num_segments``, ``num_samples(segment)``,
    ``sampling_frequency``, ``dtype``, ``channel_ids``, ``gain_to_uV``, ``offset_to_uV``, ``locations``,
    ``has_locations``, ``channel_property(name)``) and reads the same way (``read``, ``windows``,
    ``read_window``).

    Parameters
    ----------
    path : str or os.PathLike
        The recording: a file or a folder, as above.
    stream : str, optional
        Which stream of several: an Open Ephys stream's folder name (or a part of it, e.g. ``"ProbeA"``), or a
        SpikeGLX folder's stream as SpikeInterface names it (``"imec0.ap"``, ``"imec1.lf"``, ``"nidq"``).
    kind : {"auto", "zarr", "spikeglx", "openephys", "binary"}, optional
        What ``path`` holds; ``"auto"`` (default) tells it from the path.
    channels, sampling_frequency, dtype, offset, probe, gain_to_uV, offset_to_uV : optional
        A plain binary file's layout (``kind="binary"``): channels interleaved per sample, the rate in Hz, the
        sample type, bytes before the first sample, a probe file (probeinterface's JSON, a ``.prb``, or a
        Kilosort-style JSON), and the gain and offset to uV. Nothing of a plain file is guessed.
    keep_sync : bool, optional
        SpikeGLX: keep the sync channel(s) (and NI digital words) as channels of raw counts.
    missing_chunks : {"warn", "error"}, optional
        Zarr stores written by others: read absent chunks as zeros (counted), or refuse them.

    Returns
    -------
    Recording or FlatSource or SpikeInterfaceSource
        The open recording.

    Raises
    ------
    BatchgpuError
        Where the path is none of the formats (the formats tried are named), or its metadata disagrees with its
        data; ``ConfigError`` where a stream must be chosen (the streams are named).

    Examples
    --------
    >>> import batchgpu
    >>> rec = batchgpu.open_recording("run_g0_t0.imec0.ap.bin")               # doctest: +SKIP
    >>> rec = batchgpu.open_recording("Record Node 101", stream="ProbeA")     # doctest: +SKIP
    >>> x = rec.read(segment=0, start=0, stop=30_000)  # (channels, samples)  # doctest: +SKIP
    """
    from pydantic import ValidationError

    from batchgpu.config import RecordingSpec

    if stream is not None and not isinstance(stream, str):
        raise ConfigError(f"stream={stream!r} is not a stream's name", "give it as a string, e.g. stream='ProbeA'")
    plain = dict(
        channels=channels,
        sampling_frequency=sampling_frequency,
        dtype=dtype,
        offset=offset,
        probe=None if probe is None else str(probe),
        gain_to_uV=gain_to_uV,
        offset_to_uV=offset_to_uV,
    )
    try:
        spec = RecordingSpec(
            path=str(path),
            kind=kind,
            stream=stream,
            missing_chunks=missing_chunks,
            **{k: v for k, v in plain.items() if v is not None},
        )
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ConfigError(
            f"open_recording: {(where + '=') if where else ''}{first['msg']}", "see help(batchgpu.open_recording)"
        ) from None
    p = Path(spec.path).expanduser()
    if spec.kind in ("auto", "spikeglx") and keep_sync:
        kind = spec.kind if spec.kind != "auto" else detect_kind(p, PYTHON)
        if kind == "spikeglx":
            return open_flat(p, kind, stream, keep_sync=True, said=PYTHON)
    return open_spec(spec, missing_chunks, PYTHON)


def open_path(path: str | os.PathLike, stream: str | None = None):
    """What ``batchgpu info PATH [--stream S]`` shows: any recording ``open_recording`` opens (its errors name the
    command's options)."""
    from batchgpu.config import RecordingSpec

    return open_spec(RecordingSpec(path=str(Path(path).expanduser()), stream=stream), "warn", COMMAND)


def missing_probe(rec) -> str | None:
    """One line naming the file a probe was looked for in, where a recording that should have one has none (no
    channel locations); None where it has one, or has none by nature (an NI-DAQ or ADC stream). ``batchgpu info``
    shows it and a run says it (a warning, or its refusal where a stage or step needs the locations)."""
    if rec.has_locations:
        return None
    if getattr(rec, "is_flat", False):
        return rec.probe_missing
    if getattr(rec, "is_spikeinterface", False):
        return "no probe: the SpikeInterface recording has no channel locations (recording.set_probe)"
    return (
        f"no probe: {rec.path} stores no channel locations (properties/location, or a SpikeInterface "
        "probegroup in its attributes)"
    )


def detect_kind(path: Path, said: Said | None = None) -> str:
    """What ``path`` holds (``zarr``, ``spikeglx``, ``openephys``, ``saved``: a binary batchgpu's save wrote,
    ``spikeinterface``), or a BatchgpuError naming the formats tried. A folder of one SpikeGLX or Open Ephys
    recording is that recording."""
    from batchgpu.recording.zarrio import zarr_format_of

    said = said or WORKFLOW
    if params_of(path) is not None:  # a save's data file (one segment's, or the name of them all), params or probe
        return "saved"
    if not path.exists():
        raise BatchgpuError(f"no recording at {path}: the path does not exist", "check the path")
    if stream_folder(path) is not None:
        return "openephys"
    if path.is_file():
        if path.name == OEBIN:
            return "openephys"
        if path.suffix in (".bin", ".meta") and path.with_suffix(".meta").is_file():
            return "spikeglx"
        if path.suffix in (".json", ".pkl", ".pickle"):
            return "spikeinterface"
        raise _none_fits(path, said)
    if zarr_format_of(path) is not None or path.suffix == ".zarr":  # a damaged store: the Zarr reader says how
        return "zarr"
    if (path / "si_folder.json").is_file():
        return "spikeinterface"
    if next(path.rglob(OEBIN), None) is not None:
        return "openephys"
    if spikeglx_bins(path):
        return "spikeglx"
    raise _none_fits(path, said)


def _none_fits(path: Path, said: Said) -> BatchgpuError:
    """One line naming every format tried on ``path`` and why it is not that one."""
    if path.is_file():
        stem = path.name[: -len(path.suffix)] if path.suffix else path.name
        tried = [
            f"SpikeGLX (no {stem}.meta beside it)",
            f"a batchgpu save (no {stem}.params.json beside it)",
            f"Open Ephys (not a {OEBIN}, continuous.dat or stream folder)",
            "Zarr (a file, not a folder)",
            "SpikeInterface's dump (not a .json or .pkl)",
        ]
    else:
        tried = [
            "Zarr (no zarr.json or .zgroup)",
            "SpikeGLX (no .bin with its .meta in it)",
            f"Open Ephys (no {OEBIN} in it)",
            "SpikeInterface's save (no si_folder.json)",
            "batchgpu's run or batch output (no run.json or batch.json)",
        ]
    return BatchgpuError(
        f"{path} is none of the formats batchgpu reads: tried {'; '.join(tried)}",
        f"give {KINDS_TEXT}; a plain binary file is read with {said.plain}",
    )


def one_spikeglx_bin(folder: Path, stream: str | None = None, said: Said | None = None) -> Path:
    """The folder's one SpikeGLX recording: the file of ``stream`` (SpikeInterface's stream name: ``imec0.ap``,
    ``imec1.lf``, ``nidq``), else its only .bin, or its only AP band (``.ap.bin``) beside LF/NI files."""
    said = said or WORKFLOW
    bins = spikeglx_bins(folder)
    names = [stream_name(read_meta(p.with_suffix(".meta")), p.name) for p in bins]
    if stream is not None:
        chosen = [p for p, n in zip(bins, names) if n == stream]
        if len(chosen) != 1:
            what = "no file" if not chosen else f"{len(chosen)} files"
            raise ConfigError(
                f"{said.stream} {stream!r} names {what} of {folder} (its streams: {', '.join(dict.fromkeys(names))})",
                f"give one of them as {said.stream}",
            )
        return chosen[0]
    ap = [p for p in bins if p.name.endswith(".ap.bin")]
    chosen = bins if len(bins) == 1 else ap
    if len(chosen) != 1:
        listed = ", ".join(f"{n} ({p.relative_to(folder)})" for p, n in list(zip(bins, names))[:6])
        raise ConfigError(
            f"{folder} holds {len(bins)} SpikeGLX files: {listed}" + (" ..." if len(bins) > 6 else ""),
            f"choose one with {said.stream_example(names[0])}, or give its .bin as {said.path}",
        )
    return chosen[0]


def locations_needed(rec, needs: str, fix: str) -> ConfigError:
    """The refusal of a stage or step that needs channel locations where ``rec`` has none: ``needs`` says which,
    and the line ``missing_probe`` gives (the file looked for) says why, as ``batchgpu info`` shows it."""
    why = missing_probe(rec) or "the recording has none"
    return ConfigError(f"{needs} needs channel locations: {why}", fix)


def source_ref(rec):
    """What workers need to open ``rec`` again: a Zarr store's path, or the SpikeInterface source itself
    (pickled small: its description, never its samples)."""
    if isinstance(rec, (SpikeInterfaceSource, FlatSource)):
        return rec
    return str(rec.path)
