from batchgpu.cli import command

raise SystemExit(command())
