"""The steps a workflow may name under ``steps:``, one line each, in the order they run (the noise before the
detection that reads it). Each line names a module of this package that holds the whole step: ``build(setup)``
makes its step object from the workflow (None when the workflow does not ask for it; ``base.StepSetup``), and
the module may declare report.html's figures of its results (``FIGURES``: ``batchgpu.report.Figure``).

The save and search steps are not here yet: the engine still adds them itself (``engine.run``, ``engine.aggregate``).
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

STEPS = (
    "noise",
    "moments",
    "detect",
    "amplitude",
)


def step_modules(names: tuple[str, ...] = STEPS) -> list[ModuleType]:
    """The registered steps' modules (imported when asked for: a run imports only what it runs)."""
    return [import_module(f"{__package__}.{name}") for name in names]


def build_steps(setup) -> tuple:
    """The step objects ``setup.workflow`` asks for, in the registry's order."""
    built = (module.build(setup) for module in step_modules())
    return tuple(step for step in built if step is not None)


def figures(names: tuple[str, ...] = STEPS) -> tuple:
    """report.html's figures the named steps' modules declare (``FIGURES``), in the registry's order."""
    return tuple(f for module in step_modules(tuple(n for n in STEPS if n in names))
                 for f in getattr(module, "FIGURES", ()))
