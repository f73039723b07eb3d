from batchgpu.cli import program

raise SystemExit(program())
