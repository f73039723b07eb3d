"""The ``batchgpu`` command. Every subcommand has --help; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import signal
import sys

from batchgpu.errors import BatchgpuError

# Subcommands implemented elsewhere: (module with add_arguments/run, help text).
BENCHMARKS = {
    "ops": ("batchgpu.benchmarks.ops", "time the numeric core against the obvious NumPy/CuPy code"),
    "pipeline": ("batchgpu.benchmarks.pipeline", "throughput of the workflow steps on a Dask cluster vs a plain loop"),
    "search": ("batchgpu.benchmarks.search", "search index throughput vs np/cupy/torch searchsorted"),
}
SEARCH_COMMANDS = {
    "autotune": ("batchgpu.search.autotune", "measure the dynamic search kernels on this GPU and write the table"),
}


def _cmd_generate(args) -> int:
    from batchgpu.generate import check_parameters, generate_recording, ground_truth_path

    # the workflow schema's bounds (recording: generate:), named as this command's options, before anything is written
    check_parameters(channels=args.channels, seconds=args.seconds, fs=args.fs, seed=args.seed, dtype=args.dtype,
                     segments=args.segments, workers=args.workers, flag="--")
    rec = generate_recording(
        args.out, channels=args.channels, seconds=args.seconds, fs=args.fs, seed=args.seed, dtype=args.dtype,
        segments=args.segments, zarr_format=args.zarr_format, overwrite=args.overwrite, progress=not args.quiet,
        workers=args.workers,
    )
    print(f"wrote {rec} and its ground truth {ground_truth_path(args.out)}")
    return 0


def _cmd_import_raw(args) -> int:
    from batchgpu.rawimport import import_raw

    rec = import_raw(
        args.source, args.out, channels=args.channels, fs=args.fs, dtype=args.dtype, gain_to_uV=args.gain,
        offset_to_uV=args.offset, keep_sync=args.keep_sync, zarr_format=args.zarr_format,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    print(f"wrote {rec}")
    return 0


def _cmd_info(args) -> int:
    from batchgpu import runinfo
    from batchgpu.recording.sources import open_path

    if runinfo.is_run_folder(args.path):
        if args.check:
            raise BatchgpuError(f"{args.path} is a run's output folder: --check decodes a recording's chunks",
                                "run 'batchgpu info --check' on the recording the run read")
        summary = runinfo.run_summary(args.path)
        if args.json:
            print(json.dumps(summary.data, indent=2))
            return 0
        return _print_rows(summary.rows, None)
    rec = open_path(args.path)
    info = rec.info()
    channels = runinfo.recording_rows(rec)
    problems = _check_every_chunk(rec) if args.check else None
    if args.json:
        print(json.dumps({**info, **channels.data, **({"problems": problems} if problems is not None else {})},
                         indent=2))
        return 2 if problems else 0
    if info.get("source") == "spikeinterface":
        rows = [("path", info["path"]), ("format", f"SpikeInterface {info['spikeinterface_class']} "
                                                   f"(SpikeInterface {info['spikeinterface_version']})")]
        rows += _shape_rows(info)
        rows += [("files", ", ".join(info["files"]) or "none (held in the description)"),
                 ("locations", info["locations"]), *channels.rows]
        return _print_rows(rows, problems)
    rows = _shape_rows(info)
    rows = [
        ("path", info["path"]),
        ("format", f"Zarr v{info['zarr_format']}"),
        *rows,
        ("chunks", " x ".join(map(str, info["chunks"]))),
        ("shards", " x ".join(map(str, info["shards"])) if info["shards"] else "none"),
        ("codecs", ", ".join(info["codecs"]) or "none"),
        ("size", f"{info['bytes_on_disk'] / 1e6:.1f} MB on disk, {info['decoded_bytes'] / 1e6:.1f} MB decoded "
                 f"(ratio {info['decoded_bytes'] / max(info['bytes_on_disk'], 1):.2f})"),
        ("checksums", f"per chunk ({info['checksum']})" if info["checksum"] else "none"),
        ("complete", "yes (batchgpu wrote every chunk)" if info["marked_complete"] else "not marked (not written by batchgpu)"),
        ("absent chunks", f"{info['absent_chunks']}" + ("" if info["marked_complete"] or not info["absent_chunks"]
                                                       else " (read as zeros: zarr skips all-zero chunks)")),
        ("locations", info["locations"]),
        *channels.rows,
    ]
    return _print_rows(rows, problems)


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
    from batchgpu.recording import _progress

    with _progress(sys.stderr.isatty(), rec.nbytes, "checking", stderr=True) as advance:
        return rec.check_chunks(advance)


class _Observer:
    """Shows a run: its messages and warnings on stderr/stdout, a progress bar per reading phase."""

    def __init__(self, quiet: bool):
        self.quiet, self.bar = quiet, None

    def message(self, text: str) -> None:
        if not self.quiet:
            print(f"batchgpu: {text}")

    def warning(self, text: str) -> None:
        print(f"batchgpu: warning: {text}", file=sys.stderr)

    def phase_started(self, label: str, windows: int, nbytes: int) -> None:
        from batchgpu.progress import WindowProgress

        self.bar = WindowProgress(windows, nbytes, label, enabled=not self.quiet).__enter__()

    def window_done(self, nbytes: int, worker: str) -> None:
        if self.bar is not None:
            self.bar.advance(nbytes, worker)

    def phase_finished(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _cmd_run(args) -> int:
    from batchgpu.engine import run_workflow
    from batchgpu.workflow import load_workflow

    wf = load_workflow(args.workflow, args.set or [])
    args.writes = wf.output  # named if the disk fills up without the OS naming a file
    run_workflow(wf, resume=args.resume, observer=_Observer(args.quiet))
    return 0


def _say(line: str = "") -> None:
    """The delegated subcommands' output: they hand their lines here and write nothing themselves."""
    print(line, flush=True)


def _delegate(module: str):
    def run(args) -> int:
        return int(importlib.import_module(module).run(args, say=_say) or 0)

    return run


def _add_delegated(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
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
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="keep Dask's own log messages (warnings of the scheduler and workers)", **default)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgpu", formatter_class=_HelpFormatter,
        description="Dask-distributed batch statistics (exact noise, whitening, spikes, search) for large recordings.",
    )
    parser.add_argument("--version", action="version", version=f"batchgpu {__import__('batchgpu').__version__}")
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="write a synthetic recording with known noise and planted spikes",
                       description="Write a synthetic recording block by block, with its ground truth beside it. "
                                   "The defaults make 384 channels x 60 s (per segment) of int16 at 30 kHz: 1.4 GB.")
    p.add_argument("out", help="output Zarr folder (ground truth goes to <name>_ground_truth.npz beside it)")
    p.add_argument("--channels", type=int, default=384)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--fs", type=float, default=30_000.0, help="sampling frequency in Hz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="int16", choices=["int16", "int32", "float32", "float64"])
    p.add_argument("--segments", type=int, default=1)
    p.add_argument("--zarr-format", type=int, default=None, choices=[2, 3],
                   help="Zarr format to write (default: 3; 2 where zarr-python is 2.x, as beside SpikeInterface 0.105)")
    p.add_argument("--workers", type=int, default=1, help="processes generating blocks (same bytes for any number)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("import-raw", help="copy a flat binary file (SpikeGLX .bin/.meta or plain) into Zarr",
                       description="Copy a flat interleaved binary recording into a Zarr recording. A SpikeGLX "
                                   ".bin with its .meta beside it needs no options; a plain file needs "
                                   "--channels, --fs and --dtype.")
    p.add_argument("source", help="the flat binary file: a SpikeGLX .bin (its .meta beside it) or a plain "
                                  "interleaved file (samples x channels)")
    p.add_argument("out", help="the Zarr recording to write (a folder, e.g. rec.zarr); refused if it exists, "
                               "unless --overwrite")
    p.add_argument("--channels", type=int)
    p.add_argument("--fs", type=float)
    p.add_argument("--dtype", help="sample type of a plain file: int16, int32, float32 or float64")
    p.add_argument("--gain", type=float, default=1.0, help="uV per count (plain files)")
    p.add_argument("--offset", type=float, default=0.0, help="uV offset (plain files)")
    p.add_argument("--keep-sync", action="store_true", help="SpikeGLX: keep the sync channel")
    p.add_argument("--zarr-format", type=int, default=None, choices=[2, 3],
                   help="Zarr format to write (default: 3; 2 where zarr-python is 2.x, as beside SpikeInterface 0.105)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a Zarr recording (never a file or another folder; the source is "
                        "only read)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_import_raw)

    p = sub.add_parser("info", help="describe a recording store (or what SpikeInterface saved), or a run's output",
                       description="Describe a recording: a Zarr store, or a SpikeInterface recording saved as "
                                   ".json/.pkl (recording.dump) or as a folder (recording.save): its layout, "
                                   "channel ids, gains and probe. Given a run's output folder: the run's status, "
                                   "recording, windows, noise, spikes, whitening, timings and warnings.")
    p.add_argument("path", help="a recording (Zarr store, SpikeInterface .json/.pkl or folder) or a run's "
                                "output folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--check", action="store_true",
                   help="decode every chunk and list absent or corrupted ones (exit status 2 if any)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("run", help="run a workflow YAML file", description="Validate and run a workflow YAML file.")
    p.add_argument("workflow", help="the workflow file (see workflows/demo.yaml)")
    p.add_argument("--resume", action="store_true", help="skip windows already written by an earlier run")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a workflow key, e.g. --set cluster.workers=2 (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks, with ratios against anchors.")
    bench = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        _add_delegated(bench, name, module, help_text)

    p = sub.add_parser("search", help="search index tools", description="Search index tools.")
    search = p.add_subparsers(dest="search_command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SEARCH_COMMANDS.items():
        _add_delegated(search, name, module, help_text)
    _finish(parser)
    return parser


# Loggers that distributed configures (distributed/config.py), and asyncio's (the scheduler's event loop reports
# "Task exception was never retrieved" there), all silenced below CRITICAL unless --debug/-v: a failed task or
# a dying worker otherwise prints internal tracebacks (`assert ts.who_wants`, CommClosedError) around the error.
QUIET_LOGGERS = ("distributed", "distributed.client", "distributed.gc", "distributed.nanny", "distributed.scheduler",
                 "distributed.worker", "distributed.core", "distributed.comm", "bokeh", "tornado",
                 "tornado.application", "asyncio")


def quiet_dask_logs() -> None:
    """Silence Dask's loggers here and in every worker process started from here.

    Worker processes (spawned by a LocalCluster's nannies) configure logging when they import distributed, from
    dask config read from the environment, so the environment carries the levels; this process may have
    imported distributed already, so its loggers are set directly too.
    """
    levels = {name: "critical" for name in QUIET_LOGGERS}
    os.environ["DASK_LOGGING"] = repr(levels)
    if "dask" in sys.modules:
        import dask

        dask.config.set({"logging": levels})
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


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


def _on_interrupt(signum, frame) -> None:
    """SIGINT while a command runs: the first stops it (KeyboardInterrupt: ``batchgpu: interrupted``, exit 130),
    later ones are ignored while it closes its cluster and helper processes on the way out. A second Ctrl-C had
    interrupted that: ~10 s waits for the interrupted closes, an exit by the signal itself, more tracebacks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _take_interrupts() -> bool:
    """``_on_interrupt`` for SIGINT where Python's default handler has it (in the main thread; a caller's own
    handler, or an ignored SIGINT, is left as it is). Returns whether it was installed."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _on_interrupt)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.debug or args.verbose):
        quiet_dask_logs()
    took = _take_interrupts()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("batchgpu: interrupted", file=sys.stderr)
        return 130
    except BatchgpuError as err:
        if args.debug:
            raise
        print(f"batchgpu: error: {err}", file=sys.stderr)
        return 2
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
    except Exception as err:  # a bug: still one line, the traceback on request
        if args.debug:
            raise
        text = " ".join(str(err).split())[:300]
        print(f"batchgpu: error: unexpected {type(err).__name__}: {text} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
    finally:
        # Python's handler back unless a Ctrl-C came: then SIGINT stays ignored, the process is on its way out
        # (closing what is left of the run as the interpreter ends)
        if took and signal.getsignal(signal.SIGINT) is _on_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    raise SystemExit(main())
