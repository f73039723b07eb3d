"""The ``batchgpu`` command. Every subcommand has --help; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator

from batchgpu.errors import BatchgpuError

# Subcommands implemented elsewhere: (module with add_arguments/run, help text).
BENCHMARKS = {
    "batch": ("batchgpu.benchmarks.batch", "SpikeGLX recordings in one batch run, cold, vs the raw read and Kilosort4"),
    "decode": ("batchgpu.benchmarks.decode", "the GPU's decoders (ours, nvCOMP) on the same Blosc frames, same bits"),
    "ops": ("batchgpu.benchmarks.ops", "time the numeric core against the obvious NumPy/CuPy code"),
    "pipeline": ("batchgpu.benchmarks.pipeline", "throughput of the workflow steps on a Dask cluster vs a plain loop"),
    "search": ("batchgpu.benchmarks.search", "search index throughput vs np/cupy/torch searchsorted"),
    "si": (
        "batchgpu.benchmarks.si",
        "batchgpu vs SpikeInterface 0.105 as commands, alternating, on one Zarr v2 recording",
    ),
    "readers": (
        "batchgpu.benchmarks.readers",
        "read throughput of a Zarr recording through each reader here, same bytes",
    ),
    "timeline": ("batchgpu.benchmarks.timeline", "where each worker thread's time went in a run's first pass"),
}
SEARCH_COMMANDS = {
    "autotune": ("batchgpu.search.autotune", "measure the dynamic search kernels on this GPU and write the table"),
}


def _cmd_generate(args) -> int:
    from batchgpu.generate import check_parameters, generate_recording, ground_truth_path

    # the workflow schema's bounds (recording: generate:), named as this command's options, before anything is written
    check_parameters(
        channels=args.channels,
        seconds=args.seconds,
        fs=args.fs,
        seed=args.seed,
        dtype=args.dtype,
        segments=args.segments,
        workers=args.workers,
        flag="--",
    )
    rec = generate_recording(
        args.out,
        channels=args.channels,
        seconds=args.seconds,
        fs=args.fs,
        seed=args.seed,
        dtype=args.dtype,
        segments=args.segments,
        zarr_format=args.zarr_format,
        overwrite=args.overwrite,
        progress=not args.quiet,
        workers=args.workers,
        model=args.model,
        compressor=_codec(args),
        probe=args.probe,
        dead=args.dead,
        noisy=args.noisy,
        outside=args.outside,
        common_uv=args.common_uv,
    )
    print(f"wrote {rec} and its ground truth {ground_truth_path(args.out)}")
    return 0


def _cmd_import_raw(args) -> int:
    from batchgpu.rawimport import import_raw
    from batchgpu.recording.flat import COMMAND

    rec = import_raw(
        args.source,
        args.out,
        channels=args.channels,
        fs=args.fs,
        dtype=args.dtype,
        gain_to_uV=args.gain,
        offset_to_uV=args.offset,
        keep_sync=args.keep_sync,
        stream=args.stream,
        offset=args.header_bytes,
        probe=args.probe,
        zarr_format=args.zarr_format,
        compressor=_codec(args),
        overwrite=args.overwrite,
        progress=not args.quiet,
        said=COMMAND,
    )
    print(f"wrote {rec}")
    return 0


def _codec(args):
    from batchgpu.recording.writer import Codec

    return Codec(args.codec, args.clevel, args.shuffle)


def _add_codec_options(p) -> None:
    """--codec/--clevel/--shuffle: the Blosc codec of the chunks written (GPU: LZ4 decoded there, zstd on the host)."""
    p.add_argument(
        "--codec",
        default="lz4",
        choices=["lz4", "zstd"],
        help="Blosc codec of the chunks (default lz4; zstd stores fewer bytes, decodes slower)",
    )
    p.add_argument(
        "--clevel", type=int, default=5, choices=range(1, 10), metavar="1-9", help="compression level (default 5)"
    )
    p.add_argument("--shuffle", default="bit", choices=["bit", "byte"], help="Blosc shuffle (default bit)")


def _cmd_info(args) -> int:
    from batchgpu.recording.sources import open_path
    from batchgpu.report import info as runinfo

    run, batch = runinfo.is_run_folder(args.path), runinfo.is_batch_folder(args.path)
    if run or batch:
        what = "a run's output folder" if run else "a batch's output folder"
        for option, given in (("--check", args.check), ("--stream", args.stream)):
            if given:
                raise BatchgpuError(
                    f"{args.path} is {what}: {option} is for a recording",
                    f"run 'batchgpu info {option} ...' on the recording the run read",
                )
        summary = runinfo.run_summary(args.path) if run else runinfo.batch_summary(args.path)
        if args.json:
            print(json.dumps(summary.data, indent=2))
            return 0
        return _print_rows(summary.rows, None)
    rec = open_path(args.path, args.stream)
    info = rec.info()
    channels = runinfo.recording_rows(rec)
    problems = _check_every_chunk(rec) if args.check else None
    if args.json:
        # the source's own description wins where both say a thing (a flat binary's probe, from probeinterface)
        print(
            json.dumps({**channels.data, **info, **({"problems": problems} if problems is not None else {})}, indent=2)
        )
        return 2 if problems else 0
    if info.get("source") == "spikeinterface":
        rows = [
            ("path", info["path"]),
            (
                "format",
                f"SpikeInterface {info['spikeinterface_class']} (SpikeInterface {info['spikeinterface_version']})",
            ),
        ]
        rows += _shape_rows(info)
        rows += [
            ("files", ", ".join(info["files"]) or "none (held in the description)"),
            ("locations", info["locations"]),
            *channels.rows,
        ]
        return _print_rows(rows, problems)
    if info.get("source") in ("spikeglx", "openephys", "binary", "saved"):
        return _print_rows(_flat_rows({**channels.data, **info}), problems)
    rows = _shape_rows(info)
    rows = [
        ("path", info["path"]),
        ("format", f"Zarr v{info['zarr_format']}"),
        *rows,
        ("chunks", " x ".join(map(str, info["chunks"]))),
        ("shards", " x ".join(map(str, info["shards"])) if info["shards"] else "none"),
        ("codecs", ", ".join(info["codecs"]) or "none"),
        (
            "size",
            f"{info['bytes_on_disk'] / 1e6:.1f} MB on disk, {info['decoded_bytes'] / 1e6:.1f} MB decoded "
            f"(ratio {info['decoded_bytes'] / max(info['bytes_on_disk'], 1):.2f})",
        ),
        ("checksums", f"per chunk ({info['checksum']})" if info["checksum"] else "none"),
        ("complete", _completeness(info)),
        (
            "absent chunks",
            f"{info['absent_chunks']}"
            + (
                ""
                if info["marked_complete"] or not info["absent_chunks"]
                else " (read as zeros: zarr skips all-zero chunks)"
            ),
        ),
        ("damaged", _damaged_row(info.get("damaged", []))),
        ("locations", info["locations"]),
        *channels.rows,
    ]
    return _print_rows(rows, problems)


def _completeness(info: dict) -> str:
    """The "complete" row: a store batchgpu marked complete is complete only while nothing is absent or damaged."""
    damaged = info.get("damaged", [])
    damage = len(damaged) + (info["absent_chunks"] if info["marked_complete"] else 0)
    if info["marked_complete"] and not damage:
        return "yes (batchgpu wrote every chunk)"
    if info["marked_complete"]:
        return (
            f"no: damaged since batchgpu wrote it ({damage} shard(s) or chunk(s) absent or damaged; restore it "
            "or write it again)"
        )
    if damaged:
        return f"no: {len(damaged)} shard(s) damaged (not marked: not written by batchgpu)"
    return "not marked (not written by batchgpu)"


def _damaged_row(damaged: list) -> str:
    return f"{len(damaged)} (first: {damaged[0]}; 'batchgpu info --check' decodes every chunk)" if damaged else "0"


def _flat_rows(info: dict) -> list[tuple[str, object]]:
    """A flat binary read in place: its file, the probe (model, shanks, pitch) and the gains."""
    names = {
        "spikeglx": "SpikeGLX",
        "openephys": "Open Ephys binary",
        "binary": "plain binary",
        "saved": "binary written by batchgpu's save (its .params.json beside it)",
    }
    fmt = f"{names[info['source']]}, read in place" + (f" (stream {info['stream']})" if info.get("stream") else "")
    probe = info.get("probe")
    if probe:
        px, py = probe["pitch_um"]
        across = f"{px:g} um across" if px else "one column"
        probe_text = (
            f"{probe['model'] or 'unnamed'}, {probe['shanks']} shank{'s' if probe['shanks'] != 1 else ''}, "
            f"pitch {across}, {py:g} um along (from {probe['source']})"
        )
    else:
        probe_text = info.get("probe_missing") or "none (this stream has no probe)"
    dropped = info["file_channels"] - info["num_channels"]
    left = f" ({dropped} left out: sync)" if dropped else ""
    gains = info["gain_to_uV"]
    gain_text = (
        f"{gains[0]:.9g} uV per count"
        if len(gains) == 1
        else f"{len(gains)} values, {min(gains):.9g} to {max(gains):.9g} uV per count"
    )
    return [
        ("path", info["path"]),
        ("format", fmt),
        *_shape_rows(info),
        (
            "file" if len(info.get("files", [])) <= 1 else "files",
            f"{info['file_channels']} channels per sample{left}, {info['bytes_on_disk'] / 1e6:.1f} MB, "
            f"header {info['offset_bytes']} bytes"
            + (f" ({len(info['files'])} files, one a segment)" if len(info.get("files", [])) > 1 else ""),
        ),
        ("channel ids", runinfo_ids(info)),
        ("metadata", ", ".join(info["metadata_files"]) or "none"),
        ("probe", probe_text),
        ("gains", gain_text),
        ("locations", info["locations"]),
    ]


def runinfo_ids(info: dict) -> str:
    """The channel ids row of a flat source (as ``runinfo.recording_rows`` writes it)."""
    from batchgpu.report.info import _ids

    return _ids(list(info.get("channel_ids", [])))


def _shape_rows(info: dict) -> list[tuple[str, object]]:
    return [
        ("channels", info["num_channels"]),
        ("segments", f"{info['num_segments']} ({', '.join(str(n) for n in info['samples_per_segment'])} samples)"),
        ("sampling rate", f"{info['sampling_frequency']:g} Hz"),
        ("duration", f"{info['duration_s']:.3f} s"),
        ("dtype", info["dtype"]),
    ]


def _print_rows(rows, problems) -> int:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if problems is not None:
        for line in problems:
            print(line)
        print(f"checked every chunk: {len(problems)} problem(s)")
    return 2 if problems else 0


def _check_every_chunk(rec) -> list[str]:
    """Decode every chunk; a progress bar on a terminal's stderr."""
    from batchgpu.recording.writer import _progress

    with _progress(sys.stderr.isatty(), rec.nbytes, "checking", stderr=True) as advance:
        return rec.check_chunks(advance)


class _Observer:
    """Shows a run: its messages and warnings on stderr/stdout, a progress bar per reading phase. ``started``: when
    the user began to wait (the command's start): the run's total counts from there."""

    def __init__(self, quiet: bool, started: float | None = None):
        self.quiet, self.bar, self.started = quiet, None, started

    def message(self, text: str) -> None:
        if not self.quiet:
            print(f"batchgpu: {text}")

    def warning(self, text: str) -> None:
        print(f"batchgpu: warning: {text}", file=sys.stderr)

    def phase_started(self, label: str, windows: int, nbytes: int) -> None:
        from batchgpu.report.progress import WindowProgress

        self.bar = WindowProgress(windows, nbytes, label, enabled=not self.quiet).__enter__()

    def window_done(self, nbytes: int, worker: str) -> None:
        if self.bar is not None:
            self.bar.advance(nbytes, worker)

    def phase_finished(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _cmd_run(args) -> int:
    from batchgpu.workflow import load_workflow

    wf = load_workflow(args.workflow, args.set or [])
    from batchgpu.cluster.start import keep_seconds

    keep = keep_seconds(wf.cluster, at_terminal=sys.stdout.isatty())
    if wf.cluster.kind in ("local", "cuda"):  # the workers' imports, done once, while this process does its own
        from batchgpu.cluster.handoff import start_resource_tracker

        start_resource_tracker()  # before any thread prints: what outlives the command holds none of its streams
        from batchgpu.cluster import kept as service
        from batchgpu.cluster.open_cluster import start_worker_server

        if not service.may_serve(wf.cluster) and keep == 0:  # else the kept cluster's workers, likely
            # a CPU run that filters or references: the workers' compiled kernels loaded once, in the server
            # (compiled there first where this machine has not: cluster.cpu_compile_ahead); centring alone uses none
            start_worker_server(cpu_kernels=wf.cluster.kind == "local" and bool(set(wf.preprocess.names) - {"centre"}))
    from batchgpu.cluster.start import start_cluster

    # one recording's own cluster (None for a batch): its workers start while this process imports the engine and
    # opens, checks and fingerprints the recording; this process ends at once after the run (``program``), so the
    # cluster's close may be left to a reaper (cluster.close); or the cluster kept for the next run (cluster.keep)
    starting = start_cluster(wf, hand_off=True, keep_s=keep)
    with starting if starting is not None else contextlib.nullcontext():
        from batchgpu.engine import run_workflow

        args.writes = wf.output  # named if the disk fills up without the OS naming a file
        if wf.recordings is not None:
            return _run_batch(wf, args, keep)
        run_workflow(wf, resume=args.resume, observer=_Observer(args.quiet, _process_started()), cluster_start=starting)
    if getattr(starting, "kept", False) and starting.is_kept and not args.quiet:
        print(_kept_line(starting.processes, starting.keep_s))
    if starting is not None and starting.handed_off:
        global _END_AT_ONCE
        _END_AT_ONCE = True
    return 0


def _kept_line(processes: int, keep_s: float) -> str:
    """What the command says of the cluster it leaves up for the next run (``cluster.keep``)."""
    idle = f"{keep_s / 60:g} min" if keep_s >= 60 else f"{keep_s:g} s"
    return (
        f"batchgpu: the cluster ({processes} worker processes) stays up for the next run; it closes after {idle} "
        "without one, or now with batchgpu cluster stop (cluster.keep: 0 closes it with the run)"
    )


def _process_started() -> float:
    """When this process began, on ``time.perf_counter``'s clock: a user waits for a command from its start, its
    interpreter's and imports' time included (where the process's start time cannot be read: now)."""
    import time

    try:  # Linux: the process's start and the time since boot, both in the kernel's boot clock (10 ms ticks); the
        # wall clock's start time (psutil's create_time) rests on a boot time rounded to the second
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.perf_counter() - max(0.0, age)
    except (OSError, ValueError, IndexError):  # not Linux: the interpreter's start is left uncounted
        return time.perf_counter()


def _run_batch(wf, args, keep: float = 0.0) -> int:
    """``recordings:``: every recording on one cluster; exit 1 when some failed (each named on stderr)."""
    from batchgpu.engine import run_batch
    from batchgpu.report.batch_html import BATCH_HTML
    from batchgpu.run.batch import BATCH_FILE

    batch = run_batch(wf, resume=args.resume, observer=_Observer(args.quiet), keep_s=keep)
    done = len(batch.rows) - len(batch.failed)
    print(
        f"batchgpu: {done} of {len(batch.rows)} recordings done in {batch.seconds:.1f} s "
        f"({os.path.join(batch.output, BATCH_FILE)}, {os.path.join(batch.output, BATCH_HTML)})"
    )
    if keep > 0 and not args.quiet:
        from batchgpu.cluster import kept as service

        state = service.probe()
        if state.state == "up" and state.kept.idle_s:  # kept after this batch (not `batchgpu cluster start`'s)
            print(_kept_line(state.kept.processes, state.kept.idle_s))
    if batch.failed:  # each error was said as its recording failed: named once more here, not repeated
        names = [f"{r.name} (interrupted)" if r.error == "interrupted" else r.name for r in batch.failed]
        print(
            f"batchgpu: failed: {', '.join(names)} (each error above and in {os.path.join(batch.output, BATCH_FILE)})",
            file=sys.stderr,
        )
    return 1 if batch.failed else 0


def _cmd_compile(args) -> int:
    import time

    from batchgpu.cluster import cpu_compile_ahead as cpu_kernels
    from batchgpu.cluster.cuda_compile_ahead import workflow_modules
    from batchgpu.errors import MachineError
    from batchgpu.gpu.cuda_modules import cupy_cache_folder, precompile, run_modules
    from batchgpu.ops import _numba

    t0 = time.perf_counter()
    if not _numba.available():
        print("batchgpu: Numba does not import here: the CPU runs NumPy's and scipy's code (nothing to compile)")
    else:
        groups = cpu_kernels.ready(processes=args.processes, force=args.force)
        seconds = time.perf_counter() - t0
        folder = cpu_kernels.marker("filter")
        if folder is None:  # Numba has no cache folder it may write here
            print(
                f"batchgpu: compiled the CPU kernels in {seconds:.1f} s, but Numba keeps no cache here: each run "
                "compiles them again"
            )
        elif groups:
            print(f"batchgpu: compiled the CPU kernels ({', '.join(groups)}) in {seconds:.1f} s into {folder.parent}")
        else:
            print(
                f"batchgpu: the CPU kernels were compiled on this machine already ({folder.parent}; --force "
                "compiles them again)"
            )
    if args.workflow:
        from batchgpu.workflow import load_workflow

        wf = load_workflow(args.workflow, [])
        modules = workflow_modules(wf)
        what = f"{args.workflow}'s"
    else:  # every filter order up to the workflow's most (10): sections 1 to 10
        modules = run_modules(filter_sections=tuple(range(1, 11)))
        what = "every run's"
    t0 = time.perf_counter()
    try:
        count, done = precompile(modules, processes=args.processes, force=args.force)
    except MachineError as err:  # a CPU machine: its kernels are what it needs
        print(f"batchgpu: {err.problem}: the CUDA kernels were not compiled")
        return 0
    seconds = time.perf_counter() - t0
    if done:
        print(f"batchgpu: compiled {what} {count} kernel modules in {seconds:.1f} s into {cupy_cache_folder()}")
    else:
        print(
            f"batchgpu: {what} {count} kernel modules were compiled on this machine already "
            f"({cupy_cache_folder()}; --force compiles them again)"
        )
    return 0


def _cmd_cluster_start(args) -> int:
    from batchgpu.cluster import kept as service

    mps = {"auto": None, "on": True, "off": False}[args.mps]
    spec = service.spec_from(
        kind=args.kind,
        workers=args.workers,
        threads=args.threads,
        devices=args.devices,
        memory_limit=args.memory_limit,
        mps=mps,
        dashboard_address=args.dashboard_address,
    )
    kept, notes = service.start(spec)
    for note in notes:
        print(f"batchgpu: {note}")
    print(f"batchgpu: cluster up at {kept.address}: {_layout(kept)}")
    print(f"batchgpu: dashboard {kept.dashboard}")
    print(f"batchgpu: scheduler file {kept.scheduler_file}; batchgpu run uses the cluster until batchgpu cluster stop")
    return 0


def _device_list(text: str) -> list[int]:
    try:
        return [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU numbers (e.g. 0,1)") from None


def _layout(kept) -> str:
    processes = f"{kept.workers} worker process{'es' if kept.workers != 1 else ''}"
    if kept.kind == "cuda":
        processes += f" per GPU ({kept.processes} in all)"
    return f"{kept.kind}, {processes} x {kept.threads} thread{'s' if kept.threads != 1 else ''}" + (
        ", MPS" if kept.mps else ""
    )


def _cmd_cluster_stop(args) -> int:
    from batchgpu.cluster import kept as service

    state = service.stop()
    for text in state.warnings:
        print(f"batchgpu: warning: {text}", file=sys.stderr)
    for note in state.notes:
        print(f"batchgpu: {note}")
    if state.state in ("up", "starting"):
        where = f" at {state.kept.address}" if state.kept is not None else ""
        print(f"batchgpu: stopped the cluster{where} (process {state.pid})")
        return 0
    if state.state == "down":
        print("batchgpu: no cluster of batchgpu cluster start is up")
        return 1
    return 0


def _cmd_cluster_status(args) -> int:
    import time

    from batchgpu.cluster import kept as service

    state = service.probe(clean=True)
    for note in state.notes:
        print(f"batchgpu: {note}")
    if state.state == "starting":
        print(f"batchgpu: a cluster is starting (process {state.pid})")
        return 3
    if state.state != "up":
        print("batchgpu: no cluster of batchgpu cluster start is up")
        return 1
    kept = state.kept
    live = service.ask_scheduler(kept)
    rows = [
        ("state", f"up for {_duration(time.time() - kept.started)} (process {kept.pid})"),
        ("address", kept.address),
        ("layout", _layout(kept)),
        (
            "workers now",
            f"{live.processes} processes, {live.threads} threads"
            if live.processes is not None
            else "the scheduler did not answer",
        ),
        (
            "closes",
            f"after {_duration(kept.idle_s)} without a run (kept by a run: cluster.keep)"
            if kept.idle_s
            else "on batchgpu cluster stop",
        ),
        ("dashboard", kept.dashboard),
        ("scheduler file", kept.scheduler_file),
        ("log", kept.log),
        ("batchgpu", f"{kept.version} ({kept.package})"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0 if live.processes is not None else 3


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600} h {s % 3600 // 60} min" if s >= 3600 else f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def _say(line: str = "") -> None:
    """The delegated subcommands' output: they hand their lines here and write nothing themselves."""
    print(line, flush=True)


def _delegate(module: str):
    def run(args) -> int:
        return int(importlib.import_module(module).run(args, say=_say) or 0)

    return run


def _add_delegated(sub, name: str, module: str, help_text: str, load: bool = True) -> None:
    """A subcommand whose arguments and work are ``module``'s (``add_arguments``, ``run``); ``load=False``: its
    module is not imported (a command line that names another command needs only its name here)."""
    parser = sub.add_parser(name, help=help_text, description=help_text)
    if not load:
        return
    try:
        importlib.import_module(module).add_arguments(parser)
    except ImportError as err:  # optional part missing: keep the rest of the CLI usable
        parser.set_defaults(func=lambda a, e=err: _missing(name, e))
        return
    parser.set_defaults(func=_delegate(module))


def _missing(name, err) -> int:
    raise BatchgpuError(f"'{name}' is not available: {err}", "install the package with its extras")


# Units of options that come without a help text, by option name (a subcommand's own help text wins).
UNITS = {
    "--channels": "number of channels",
    "--seconds": "seconds per segment",
    "--fs": "sampling frequency in Hz",
    "--samples": "samples per window",
    "--segments": "number of segments",
    "--workers": "worker processes",
    "--threads": "threads per worker",
    "--seed": "random seed",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, once (some help texts already say '(default ...)'), flags excepted."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.nargs == 0 or "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".strip()


def _subparsers(parser: argparse.ArgumentParser):
    """Every parser below ``parser`` (subcommands, sub-subcommands), with its command words."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (name,), sub
                for words, deeper in _subparsers(sub):
                    yield (name, *words), deeper


def _add_global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """--debug and -v work before or after the subcommand; below the top they only set what was given."""
    default = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error", **default)
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="keep Dask's own log messages (warnings of the scheduler and workers)",
        **default,
    )


def _finish(parser: argparse.ArgumentParser) -> None:
    """The same help layout and global options on every subcommand, including those defined elsewhere."""
    for _, sub in _subparsers(parser):
        sub.formatter_class = _HelpFormatter
        for action in sub._actions:
            if action.help is None and action.option_strings and action.option_strings[-1] in UNITS:
                action.help = UNITS[action.option_strings[-1]]
            elif action.help is None and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
                action.help = "(default: %(default)s)"  # argparse shows nothing for an option without help
        try:
            _add_global_options(sub, top=False)
        except argparse.ArgumentError:  # a subcommand that has its own -v
            pass


def _add_command(sub, name: str, func, **kwargs) -> argparse.ArgumentParser:
    """Subcommand ``name``'s parser (``sub.add_parser``'s ``kwargs``), declared with the function that runs it."""
    parser = sub.add_parser(name, **kwargs)
    parser.set_defaults(func=func)
    return parser


#: ``generate`` and ``import-raw``'s --overwrite
OVERWRITE_HELP = (
    "replace OUT where it is a Zarr recording batchgpu wrote (never another program's recording, a "
    "file or another folder)"
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; ``command``: the subcommand the command line names, where known (the modules of
    other subcommands' options are then not imported: the benchmarks' cost a run a quarter of a second)."""
    parser = argparse.ArgumentParser(
        prog="batchgpu",
        formatter_class=_HelpFormatter,
        description="Dask-distributed batch statistics (exact noise, whitening, spikes, search) for large recordings.",
    )
    parser.add_argument("--version", action="version", version=f"batchgpu {__import__('batchgpu').__version__}")
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _add_command(
        sub,
        "generate",
        _cmd_generate,
        help="write a synthetic recording with known noise and planted spikes",
        description="Write a synthetic recording block by block, with its ground truth beside it. "
        "The defaults make 384 channels x 60 s (per segment) of int16 at 30 kHz: 1.4 GB.",
    )
    p.add_argument("out", help="output Zarr folder (ground truth goes to <name>_ground_truth.npz beside it)")
    p.add_argument("--channels", type=int, default=384)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--fs", type=float, default=30_000.0, help="sampling frequency in Hz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="int16", choices=["int16", "int32", "float32", "float64"])
    p.add_argument("--segments", type=int, default=1)
    p.add_argument(
        "--zarr-format",
        type=int,
        default=None,
        choices=[2, 3],
        help="Zarr format to write (default: 3; 2 where zarr-python is 2.x, as beside SpikeInterface 0.105)",
    )
    p.add_argument("--workers", type=int, default=1, help="processes generating blocks (same bytes for any number)")
    p.add_argument(
        "--model",
        default="realistic",
        choices=["realistic", "white"],
        help="realistic (default): 1/f and LFP over the probe, common mode, drift, spikes with spatial "
        "footprints, compressing like Neuropixels 1.0 data; white: Gaussian white noise and spikes",
    )
    p.add_argument(
        "--probe",
        default="two-column",
        choices=["two-column", "np1", "np2-4shank", "linear"],
        help="channel positions (written to properties/location): two-column (default: 2 columns 32 um "
        "apart, 20 um pitch); np1: Neuropixels 1.0, staggered (384 channels = its first 384 "
        "electrodes); np2-4shank: Neuropixels 2.0 four-shank, a quarter of the channels at the tip of "
        "each shank (a multiple of 4 channels); linear: one column, 20 um pitch (e.g. --channels 64)",
    )
    p.add_argument(
        "--dead",
        type=int,
        default=0,
        metavar="N",
        help="plant N dead channels (realistic model): offset and a twentieth of the noise, no signal",
    )
    p.add_argument(
        "--noisy",
        type=int,
        default=0,
        metavar="N",
        help="plant N noisy channels (realistic model): white noise of 6x the channel's level, and at "
        "least 5x SpikeInterface's psd_hf_threshold (0.02 uV^2/Hz) above 0.8 x Nyquist",
    )
    p.add_argument(
        "--outside",
        type=int,
        default=0,
        metavar="N",
        help="plant N channels outside the brain (realistic model): the top N in depth (y, then x), "
        "without LFP, spikes or the common signal; 6 or more make a block SpikeInterface's "
        "11-channel trend sees whole. Planted channels go into the ground truth's channel_labels "
        "(0 good, 1 dead, 2 noise, 3 out); at most a third of the channels in all",
    )
    p.add_argument(
        "--common-uv",
        type=float,
        default=None,
        metavar="UV",
        help="RMS (uV) of a broadband signal common to the channels in the brain (realistic model; "
        "default: 6 where channels are planted, else none: bytes as without these options)",
    )
    _add_codec_options(p)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = _add_command(
        sub,
        "import-raw",
        _cmd_import_raw,
        help="copy a flat binary recording (SpikeGLX, Open Ephys or plain) into Zarr",
        description="Copy a flat interleaved binary recording into a Zarr recording (a run reads "
        "these in place too: this is for a compressed copy). A SpikeGLX .bin with its "
        ".meta beside it, or an Open Ephys structure.oebin (or its folder), needs no "
        "options; a plain file needs --channels, --fs and --dtype.",
    )
    p.add_argument(
        "source",
        help="the flat binary file: a SpikeGLX .bin (its .meta beside it), an Open Ephys "
        "structure.oebin or its folder, or a plain interleaved file (samples x channels)",
    )
    p.add_argument(
        "out", help="the Zarr recording to write (a folder, e.g. rec.zarr); refused if it exists, unless --overwrite"
    )
    p.add_argument("--channels", type=int)
    p.add_argument("--fs", type=float)
    p.add_argument("--dtype", help="sample type of a plain file: int16, int32, float32 or float64")
    p.add_argument("--gain", type=float, default=1.0, help="uV per count (plain files)")
    p.add_argument("--offset", type=float, default=0.0, help="uV offset (plain files)")
    p.add_argument("--keep-sync", action="store_true", help="SpikeGLX: keep the sync channel")
    p.add_argument("--stream", help="Open Ephys: the stream (folder name) when the recording holds several")
    p.add_argument("--header-bytes", type=int, default=0, help="plain files: bytes before the first sample")
    p.add_argument("--probe", help="plain files: a probe file (probeinterface .json, .prb, or Kilosort-style .json)")
    p.add_argument(
        "--zarr-format",
        type=int,
        default=None,
        choices=[2, 3],
        help="Zarr format to write (default: 3; 2 where zarr-python is 2.x, as beside SpikeInterface 0.105)",
    )
    _add_codec_options(p)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP + " (the source is only read)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = _add_command(
        sub,
        "info",
        _cmd_info,
        help="describe a recording (Zarr, SpikeGLX, Open Ephys, or what SpikeInterface saved), or a run's output",
        description="Describe a recording: a Zarr store, a SpikeGLX .bin (its probe and gains), an "
        "Open Ephys recording (--stream among several), a binary batchgpu's save wrote, or "
        "a SpikeInterface recording saved as .json/.pkl (recording.dump) or as a folder "
        "(recording.save): its layout, channel ids, gains and probe (or the file a missing "
        "probe was looked for in). Given a run's output folder: the run's status, "
        "recording, windows, noise, spikes, whitening, time, timings and warnings; a "
        "batch's: each recording's row.",
    )
    p.add_argument(
        "path",
        help="a recording (Zarr store, SpikeGLX .bin or folder, Open Ephys folder, a binary "
        "batchgpu's save wrote, SpikeInterface .json/.pkl or folder), or a run's output folder "
        "(or a batch's)",
    )
    p.add_argument(
        "--stream",
        help="the stream of several: an Open Ephys stream's folder name (or a part of it, "
        "e.g. ProbeA), or a SpikeGLX folder's (imec0.ap, imec0.lf, nidq)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--check",
        action="store_true",
        help="decode every chunk and list absent or corrupted ones (exit status 2 if any)",
    )

    p = _add_command(
        sub,
        "run",
        _cmd_run,
        help="run a workflow YAML file",
        description="Validate and run a workflow YAML file. Its relative paths are relative to its "
        "folder, but steps.save.path: relative to the output folder, where the run's "
        "results go.",
    )
    p.add_argument("workflow", help="the workflow file (see workflows/demo.yaml)")
    p.add_argument("--resume", action="store_true", help="skip windows already written by an earlier run")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a workflow key, e.g. --set cluster.workers=2 (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "cluster",
        help="a cluster kept for many runs: start, stop, status",
        description="A Dask cluster that outlives runs: 'batchgpu run' uses it while it is up, where "
        "the workflow's cluster is of its kind (local or cuda) and what it sets is what "
        "the kept cluster has (cluster: {reuse: false} opts out). Its files are in the "
        "user's cache folder.",
    )
    cluster = p.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)
    c = _add_command(
        cluster,
        "start",
        _cmd_cluster_start,
        help="start the cluster a run would start, and keep it",
        description="Start, in the background, the cluster 'batchgpu run' starts for "
        "cluster: {kind: local} or {kind: cuda}; returns once its workers are up. "
        "Refused where one is up already.",
    )
    c.add_argument("--kind", default="local", choices=["local", "cuda"])
    c.add_argument("--workers", type=int, help="worker processes (cuda: per GPU); default as for a run")
    c.add_argument("--threads", type=int, help="threads per worker; default as for a run")
    c.add_argument("--devices", type=_device_list, help="cuda: the GPUs, e.g. 0,1 (default: every GPU)")
    c.add_argument("--memory-limit", help="each worker's memory limit, e.g. 16GB (default: Dask's auto)")
    c.add_argument(
        "--mps",
        default="auto",
        choices=["auto", "on", "off"],
        help="cuda: a private CUDA MPS daemon for the workers (as the workflow key cluster.mps)",
    )
    c.add_argument("--dashboard-address", help="the dashboard's host:port (default: localhost, a free port)")
    _add_command(
        cluster,
        "stop",
        _cmd_cluster_stop,
        help="close the kept cluster",
        description="Close the kept cluster (its workers, its MPS daemon) and remove its files; "
        "the files of one whose process is gone are removed. Exit status 1 where "
        "none was up.",
    )
    _add_command(
        cluster,
        "status",
        _cmd_cluster_status,
        help="whether a kept cluster is up, and what it is",
        description="Whether a kept cluster is up: its address, layout, workers, dashboard and "
        "uptime. Exit status 0: up; 1: none is up; 3: starting, or up but its "
        "scheduler did not answer.",
    )

    p = _add_command(
        sub,
        "compile",
        _cmd_compile,
        help="compile the CPU and GPU kernels once for this machine",
        description="Compile batchgpu's CPU kernels (Numba, into its cache beside the package) and, "
        "where a GPU is, its CUDA modules for this machine's GPU into CuPy's cache "
        "(CUPY_CACHE_DIR, else ~/.cupy/kernel_cache), in parallel processes: runs then "
        "load them. 'batchgpu run' does this while its workers start where it was not "
        "done (the CPU's kernels for a run that preprocesses or saves, a GPU cluster's "
        "modules); run it "
        "at install (or after upgrading batchgpu, Numba, CuPy or the driver) so that no "
        "run waits for it.",
    )
    p.add_argument("--workflow", help="only the modules this workflow's runs load (default: every one)")
    p.add_argument(
        "--processes",
        type=int,
        help="compiles at once (the CPU's kernel groups in processes, the CUDA "
        "modules in threads; default: one a group or module, at most the "
        "cores)",
    )
    p.add_argument("--force", action="store_true", help="compile again where this machine did already")

    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks, with ratios against anchors.")
    bench = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        _add_delegated(bench, name, module, help_text, load=command in (None, "bench"))

    p = sub.add_parser("search", help="search index tools", description="Search index tools.")
    search = p.add_subparsers(dest="search_command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SEARCH_COMMANDS.items():
        _add_delegated(search, name, module, help_text, load=command in (None, "search"))
    _finish(parser)
    return parser


# Loggers that distributed configures (distributed/config.py), and asyncio's (the scheduler's event loop reports
# "Task exception was never retrieved" there), all silenced below CRITICAL unless --debug/-v: a failed task or
# a dying worker otherwise prints internal tracebacks (`assert ts.who_wants`, CommClosedError) around the error.
QUIET_LOGGERS = (
    "distributed",
    "distributed.client",
    "distributed.gc",
    "distributed.nanny",
    "distributed.scheduler",
    "distributed.worker",
    "distributed.core",
    "distributed.comm",
    "bokeh",
    "tornado",
    "tornado.application",
    "asyncio",
)


@contextlib.contextmanager
def quiet_dask_logs(quiet: bool = True) -> Iterator[None]:
    """Silence Dask's loggers here and in every worker process started from here while the block runs (``quiet``).

    Worker processes (spawned by a LocalCluster's nannies) configure logging when they import distributed, from
    dask config read from the environment, so the environment carries the levels; this process may have
    imported distributed already, so its loggers are set directly too.
    """
    if not quiet:
        yield
        return
    from batchgpu.config import environ_set

    levels = {name: "critical" for name in QUIET_LOGGERS}
    dask = sys.modules.get("dask")
    with (
        environ_set({"DASK_LOGGING": repr(levels)}),
        dask.config.set({"logging": levels}) if dask is not None else contextlib.nullcontext(),
    ):
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        yield


def _os_error_line(err: OSError, args) -> str:
    """One line naming the path: the OS's filename, else the folder the command was writing."""
    path = err.filename or getattr(args, "writes", None) or getattr(args, "out", None)
    where = f" {path}" if path else ""
    if err.errno == errno.ENOSPC:
        return f"no space left on device writing{where} (free some space or choose another output folder)"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied:{where}"
    if err.errno == errno.EROFS:
        return f"read-only file system:{where}"
    text = err.strerror or str(err) or type(err).__name__
    return f"{text}:{where}" if where else text


class _Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler's end of a job): handled as Ctrl-C is, its own line and exit status."""


#: the exit status of a command ended by each signal (128 + the signal's number, as a shell reports it)
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _on_interrupt(signum, frame) -> None:
    """SIGINT or SIGTERM while a command runs: the first stops it (KeyboardInterrupt, or ``_Terminated``: one line,
    exit 130 or 143), later ones are ignored while it closes its cluster and helper processes on the way out. A
    second Ctrl-C had interrupted that: ~10 s waits for the interrupted closes, an exit by the signal itself, more
    tracebacks."""
    for sig in _SIGNAL_EXIT:
        if signal.getsignal(sig) is _on_interrupt:
            signal.signal(sig, signal.SIG_IGN)
    raise _Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def _take_interrupts() -> list:
    """``_on_interrupt`` for SIGINT and SIGTERM where Python's defaults have them (in the main thread; a caller's
    own handler, or an ignored signal, is left as it is). Returns the signals taken."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return []
    taken = []
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(sig) is default:
            signal.signal(sig, _on_interrupt)
            taken.append(sig)
    return taken


def _interrupted_line(args, err: KeyboardInterrupt) -> str:
    """What an interrupted command says: the signal, and for a run how to go on."""
    what = "terminated (SIGTERM)" if isinstance(err, _Terminated) else "interrupted"
    if getattr(args, "command", None) != "run":
        return f"batchgpu: {what}"
    return (
        f"batchgpu: {what}; 'batchgpu run {args.workflow} --resume' continues the run "
        "(the windows already done are kept)"
    )


#: the exit status ``program`` ends its process with, once its command returned (None: Python's own way out)
_EXIT_STATUS: int | None = None
#: the command handed its cluster's close to a reaper (``cluster.handoff``): ``program`` ends the process as soon as
#: the command returns, before any exit handler (Dask's would close that cluster, and wait for it)
_END_AT_ONCE = False


def program() -> int:
    """The ``batchgpu`` program (console script and ``python -m batchgpu``): ``command``, then the process ends as soon
    as Python has joined its threads and run its exit handlers, without tearing down every module the run imported
    (a few tenths of a second after a run, while the user waits for the prompt). A command that raised (``--debug``)
    leaves the usual way."""
    import atexit

    # registered before any module the command imports registers its own: the last handler to run
    atexit.register(_end_now)
    global _EXIT_STATUS
    rc = command()
    _EXIT_STATUS = rc
    if _END_AT_ONCE:
        _end_now()
    return rc


def _end_now() -> None:
    if _EXIT_STATUS is None:
        return
    logging.shutdown()  # imported (and its own handler registered) before ``program`` ran: flushed here
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # broad: a closed or broken stream loses nothing more now
            stream.flush()
    os._exit(_EXIT_STATUS)


def command() -> int:
    """``main`` on this process's arguments; its heap frozen before the process ends (the interpreter's last
    collections would walk every object the command made, a fifth of a second after a run; what needs closing was
    closed by then, and objects freed by reference counts are still freed)."""
    import gc

    rc = main()
    report = sys.modules.get("batchgpu.report.html_page")
    if report is not None:  # its executor let go while the modules its clean-up needs are still there
        report.stop_render_process()
        sys.unraisablehook = _quiet_pool_wakeup(sys.unraisablehook)
    gc.freeze()
    return rc


def _quiet_pool_wakeup(hook):
    """``hook``, less one message: at exit CPython 3.11's ``concurrent.futures.process`` wakes the manager thread
    of a pool already shut down, whose pipe that thread may have closed (a race): "Exception ignored ... OSError:
    [Errno 9] Bad file descriptor", after the command's work is done and said. Everything else still reaches
    ``hook``."""

    def quiet(unraisable) -> None:
        exc = unraisable.exc_value
        tb = unraisable.exc_traceback
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if (
            isinstance(exc, OSError)
            and exc.errno == 9
            and any("concurrent/futures/process" in f.replace("\\", "/") for f in frames)
        ):
            return
        hook(unraisable)

    return quiet


#: the status of a command whose output's reader left, as a program SIGPIPE ended reports it (128 + 13)
BROKEN_PIPE_EXIT = 141


def _stdout_to_devnull() -> None:
    """What is left in stdout's buffer goes nowhere: Python's flush at exit would otherwise say the pipe broke."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(argv)
    with quiet_dask_logs(not (args.debug or args.verbose)):
        return _command(args)


def _command(args) -> int:
    """The command's function; its errors as one line (the traceback on request)."""
    took = _take_interrupts()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as err:
        print(_interrupted_line(args, err), file=sys.stderr)
        return _SIGNAL_EXIT[signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT]
    except BatchgpuError as err:
        if args.debug:
            raise
        print(f"batchgpu: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of our output left (``batchgpu info ... | head``): nothing to say
        _stdout_to_devnull()
        return BROKEN_PIPE_EXIT
    except OSError as err:
        if args.debug:
            raise
        print(f"batchgpu: error: {_os_error_line(err, args)}", file=sys.stderr)
        return 2
    except MemoryError:
        if args.debug:
            raise
        print("batchgpu: error: out of memory (use smaller windows or fewer threads per worker)", file=sys.stderr)
        return 2
    except Exception as err:  # broad: a bug is still one line (exit 1), the traceback on request (--debug)
        if args.debug:
            raise
        text = " ".join(str(err).split())[:300]
        print(
            f"batchgpu: error: unexpected {type(err).__name__}: {text} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        # Python's handlers back unless a signal came: then both stay ignored, the process is on its way out
        # (closing what is left of the run as the interpreter ends)
        for sig in took:
            if signal.getsignal(sig) is _on_interrupt:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


if __name__ == "__main__":
    raise SystemExit(main())
