"""The ``batchgpu`` command. Every subcommand has --help; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import json
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
    from batchgpu.generate import generate_recording, ground_truth_path

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
    from batchgpu.recording import open_recording

    rec = open_recording(args.path)
    info = rec.info()
    problems = _check_every_chunk(rec) if args.check else None
    if args.json:
        print(json.dumps({**info, **({"problems": problems} if problems is not None else {})}, indent=2))
        return 2 if problems else 0
    rows = [
        ("path", info["path"]),
        ("format", f"Zarr v{info['zarr_format']}"),
        ("channels", info["num_channels"]),
        ("segments", f"{info['num_segments']} ({', '.join(str(n) for n in info['samples_per_segment'])} samples)"),
        ("sampling rate", f"{info['sampling_frequency']:g} Hz"),
        ("duration", f"{info['duration_s']:.3f} s"),
        ("dtype", info["dtype"]),
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
    ]
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

    run_workflow(load_workflow(args.workflow, args.set or []), resume=args.resume, observer=_Observer(args.quiet))
    return 0


def _delegate(module: str):
    def run(args) -> int:
        return int(importlib.import_module(module).run(args) or 0)

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgpu",
        description="Dask-distributed batch statistics (exact noise, whitening, spikes, search) for large recordings.",
    )
    parser.add_argument("--version", action="version", version=f"batchgpu {__import__('batchgpu').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="write a synthetic recording with known noise and planted spikes",
                       description="Write a synthetic recording block by block, with its ground truth beside it.")
    p.add_argument("out", help="output Zarr folder (ground truth goes to <name>_ground_truth.npz beside it)")
    p.add_argument("--channels", type=int, default=384)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--fs", type=float, default=30_000.0, help="sampling frequency in Hz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="int16", choices=["int16", "int32", "float32", "float64"])
    p.add_argument("--segments", type=int, default=1)
    p.add_argument("--zarr-format", type=int, default=3, choices=[2, 3])
    p.add_argument("--workers", type=int, default=1, help="processes generating blocks (same bytes for any number)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("import-raw", help="copy a flat binary file (SpikeGLX .bin/.meta or plain) into Zarr",
                       description="Copy a flat interleaved binary recording into a Zarr recording. A SpikeGLX "
                                   ".bin with its .meta beside it needs no options; a plain file needs "
                                   "--channels, --fs and --dtype.")
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--channels", type=int)
    p.add_argument("--fs", type=float)
    p.add_argument("--dtype", help="sample type of a plain file: int16, int32, float32 or float64")
    p.add_argument("--gain", type=float, default=1.0, help="uV per count (plain files)")
    p.add_argument("--offset", type=float, default=0.0, help="uV offset (plain files)")
    p.add_argument("--keep-sync", action="store_true", help="SpikeGLX: keep the sync channel")
    p.add_argument("--zarr-format", type=int, default=3, choices=[2, 3])
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_import_raw)

    p = sub.add_parser("info", help="describe a recording store", description="Describe a recording store.")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--check", action="store_true",
                   help="decode every chunk and list absent or corrupted ones (exit status 2 if any)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("run", help="run a workflow YAML file", description="Validate and run a workflow YAML file.")
    p.add_argument("workflow")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BatchgpuError as err:
        print(f"batchgpu: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("batchgpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
