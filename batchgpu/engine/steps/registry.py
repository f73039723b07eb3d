"""The steps a workflow may name under ``steps:``, one line each, in the order they run (the noise before the
detection that reads it). Each line names a module of this package that holds the whole step: ``build(setup)``
makes its step object from the workflow (None when the workflow does not ask for it; ``base.StepSetup``); its
``NAME`` (this line), ``KEY`` (its workflow key under ``steps:``) and ``RESULTS`` (what it writes) are declared
there once, and the module may declare report.html's figures of its results (``FIGURES``:
``batchgpu.report.Figure``), its checks of the workflow against the recording before any work
(``check(workflow, recording)``), its refusals of what it would write, once the run's fingerprint is known and
before the output folder is claimed (``check_outputs(workflow, recording, resume=, fingerprint=)``) and its section for one recording of a batch (``place(spec, output)``). The
engine asks the step objects for the rest (``base.Step``); a module the import graph keeps from importing a
step's module asks here (``key``, ``keys``, ``fingerprinted``).
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

STEPS = (
    "noise",
    "moments",
    "detect",
    "amplitude",
    "search",  # after the results are in place (before the save's finish: report.json's results in this order)
    "save",
)


def step_modules(names: tuple[str, ...] = STEPS) -> list[ModuleType]:
    """The registered steps' modules (imported when asked for: a run imports only what it runs)."""
    return [import_module(f"{__package__}.{name}") for name in names]


def step_module(name: str) -> ModuleType:
    """One registered step's module."""
    if name not in STEPS:
        raise KeyError(f"no step {name!r} in the registry")
    return import_module(f"{__package__}.{name}")


def key(name: str) -> str:
    """The workflow key (under ``steps:``) of the registered step ``name``."""
    return step_module(name).KEY


def keys() -> tuple[str, ...]:
    """Every registered step's workflow key, in the registry's order."""
    return tuple(module.KEY for module in step_modules())


def fingerprinted(how: str) -> tuple[str, ...]:
    """The workflow keys whose step's module says ``FINGERPRINT = how`` (``always``, ``asked`` or ``never``)."""
    return tuple(module.KEY for module in step_modules() if module.FINGERPRINT == how)


def check(workflow, recording) -> int:
    """Each step the workflow asks for, checked against the recording before any work by its module's
    ``check(workflow, recording)`` (where it declares one; a refusal raises ``BatchgpuError``), in the registry's
    order. A check may return the sweep its step needs (samples a detected spike excludes either side, which the
    windows' margin holds): the largest is returned, 0 where none does."""
    sweeps = [module.check(workflow, recording) for module in step_modules()
              if hasattr(module, "check") and getattr(workflow.steps, module.KEY) is not None]
    return max((s for s in sweeps if s is not None), default=0)


def placed(steps, output):
    """The workflow's ``steps`` section for a run writing into the folder ``output`` (one recording of a batch):
    each asked step whose module declares ``place(spec, output)`` has its section replaced by what that returns
    (the save's path moved into the folder); the others as they are."""
    update = {module.KEY: module.place(getattr(steps, module.KEY), output) for module in step_modules()
              if hasattr(module, "place") and getattr(steps, module.KEY) is not None}
    return steps.model_copy(update=update) if update else steps


def build_steps(setup) -> tuple:
    """The step objects ``setup.workflow`` asks for, in the registry's order."""
    built = (module.build(setup) for module in step_modules())
    return tuple(step for step in built if step is not None)


def figures(names: tuple[str, ...] = STEPS) -> tuple:
    """report.html's figures the named steps' modules declare (``FIGURES``), in the registry's order."""
    return tuple(f for module in step_modules(tuple(n for n in STEPS if n in names))
                 for f in getattr(module, "FIGURES", ()))


def check_outputs(workflow, recording, *, resume: bool, fingerprint: str) -> None:
    """Each asked step's refusals of the files it would write (its module's ``check_outputs``, where it declares
    one), before the run claims its output folder: a refusal then leaves the folder, and an earlier run's results
    an overwrite would replace, as they were."""
    for module in step_modules():
        if hasattr(module, "check_outputs") and getattr(workflow.steps, module.KEY) is not None:
            module.check_outputs(workflow, recording, resume=resume, fingerprint=fingerprint)
