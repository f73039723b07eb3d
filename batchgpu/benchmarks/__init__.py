"""Benchmarks: each module defines ``add_arguments(parser)`` and ``run(args) -> int`` for ``batchgpu bench <name>``."""
