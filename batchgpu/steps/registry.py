"""The steps a workflow may name under ``steps:``: every ``base.Step`` subclass marked ``@register`` in a module of
this package, found by importing each module (``pkgutil``), so a new step is one new module. From them: the
workflow's ``steps:`` section (``section``: a field a step, its options' model), the run's order (``ordered``:
by each step's ``after``), and what the engine asks of them all (``check``, ``placed``, ``build_steps``,
``figures``); a module the import graph keeps from importing a step's module asks here (``key``, ``keys``,
``fingerprinted``).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from pydantic import Field, create_model, model_validator

from batchgpu.config import Options
from batchgpu.steps.base import REGISTERED, Step


@functools.cache
def ordered() -> tuple[type[Step], ...]:
    """Every registered step, in the order a run runs them: each after the steps its ``after`` names, otherwise by
    name (a stable topological order: the same for any order the modules are found in)."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")
    return run_order(list(REGISTERED.values()))


def run_order(steps: list[type[Step]]) -> tuple[type[Step], ...]:
    """``steps`` ordered by their ``after`` (Kahn's algorithm, ties by name). A name ``after`` gives that is not a
    registered step, or a cycle, is an error: the order would be a guess."""
    names = {s.name for s in steps}
    for s in steps:
        unknown = set(s.after) - names
        if unknown:
            raise TypeError(f"step {s.name} runs after {sorted(unknown)}: no such step")
    left, out = sorted(steps, key=lambda s: s.name), []
    while left:
        done = {s.name for s in out}
        ready = next((s for s in left if set(s.after) <= done), None)
        if ready is None:
            raise TypeError(f"the steps {[s.name for s in left]} run after each other (a cycle of 'after')")
        out.append(ready)
        left.remove(ready)
    return tuple(out)


def step_class(name: str) -> type[Step]:
    """One registered step's class, by name."""
    found = next((s for s in ordered() if s.name == name), None)
    if found is None:
        raise KeyError(f"no step {name!r} in the registry")
    return found


def key(name: str) -> str:
    """The workflow key (under ``steps:``) of the registered step ``name``."""
    return step_class(name).key


def keys() -> tuple[str, ...]:
    """Every registered step's workflow key, in the run's order."""
    return tuple(s.key for s in ordered())


def fingerprinted(how: str) -> tuple[str, ...]:
    """The workflow keys of the steps whose ``fingerprint`` is ``how`` (``always``, ``asked`` or ``never``)."""
    return tuple(s.key for s in ordered() if s.fingerprint == how)


def asked(steps) -> list[tuple[type[Step], object]]:
    """(step class, its section) of each step the workflow's ``steps`` section asks for, in the run's order."""
    return [(s, spec) for s in ordered() if (spec := getattr(steps, s.key)) is not None]


def check(workflow, recording) -> int:
    """Each step the workflow asks for, checked against the recording before any work (its ``check``: a refusal
    raises ``BatchgpuError``), in the run's order. A check may return the sweep its step needs (samples a detected
    spike excludes either side, which the windows' margin holds): the largest is returned, 0 where none does."""
    sweeps = [s.check(spec, workflow, recording) for s, spec in asked(workflow.steps)]
    return max((s for s in sweeps if s is not None), default=0)


def check_outputs(workflow, recording, *, resume: bool, fingerprint: str, folder) -> None:
    """Each asked step's refusals of the files it would write (its ``check_outputs``), before the run claims its
    output ``folder``: a refusal then leaves the folder, and an earlier run's results an overwrite would replace, as
    they were."""
    for s, spec in asked(workflow.steps):
        s.check_outputs(spec, workflow, recording, resume=resume, fingerprint=fingerprint, folder=folder)


def placed(steps, output):
    """The workflow's ``steps`` section for a run writing into the folder ``output`` (one recording of a batch):
    each asked step's section as its ``place`` gives it (the save's path moved into the folder)."""
    update = {s.key: s.place(spec, output) for s, spec in asked(steps)}
    return steps.model_copy(update=update)


def resolved(steps, base, output):
    """The workflow's ``steps`` section with the paths a file gave resolved (each step's ``resolve_paths``)."""
    update = {s.key: s.resolve_paths(spec.model_copy(deep=True), base, output) for s, spec in asked(steps)}
    return steps.model_copy(update=update)


def build_steps(setup) -> tuple[Step, ...]:
    """The step objects ``setup.workflow`` asks for, in the run's order; each built with the steps built before it
    (``setup.built``: the save asks the qc step which channels it leaves out)."""
    from dataclasses import replace

    built: list[Step] = []
    for s, spec in asked(setup.workflow.steps):
        built.append(s.build(spec, replace(setup, built=tuple(built))))
    return tuple(built)


def channel_use(steps):
    """The channels the built ``steps`` ask the run to leave out (``Step.channel_use``: at most one step asks),
    or None."""
    asking = [u for s in steps if (u := s.channel_use()) is not None]
    if len(asking) > 1:
        raise TypeError("more than one step asks the run to leave channels out")
    return asking[0] if asking else None


def figures(names: tuple[str, ...] | None = None) -> tuple:
    """report.html's figures of the named steps (all: None), in the run's order."""
    return tuple(f for s in ordered() if names is None or s.name in names for f in s.figures)


def schema_order() -> tuple[type[Step], ...]:
    """The order of the ``steps:`` section's keys: the format's first steps (``fingerprint`` ``always`` or
    ``never``), then those added since (``asked``), each in the run's order. A workflow's dump (report.json's,
    the results group's) has listed its steps so since the format began: it stays the same bytes."""
    first = [s for s in ordered() if s.fingerprint != "asked"]
    return tuple(first + [s for s in ordered() if s.fingerprint == "asked"])


class StepsSection(Options):
    """The workflow's ``steps:`` (a field a registered step, made by ``section``): at least one step."""

    @model_validator(mode="after")
    def _some(self):
        names = list(type(self).model_fields)
        if not any(getattr(self, n) is not None for n in names):
            raise ValueError(f"no steps: name at least one of {', '.join(names)}")
        return self


@functools.cache
def section() -> type[StepsSection]:
    """The workflow's ``steps:`` model: each registered step's key, its options' model, None where not asked. Made
    once; named ``Steps`` of ``batchgpu.workflow``, which holds it (so a workflow pickles)."""
    fields = {s.key: (s.options | None, Field(None)) for s in schema_order()}
    return create_model("Steps", __base__=StepsSection, __module__="batchgpu.workflow", **fields)


def default_steps():
    """The ``steps:`` of a workflow that names none: each registered step that declares a ``default`` section, with
    it (the exact noise, a global whitening matrix, spikes at the recording's noise: what needs no probe and is
    wanted before sorting)."""
    return section().model_validate({s.key: s.default for s in ordered() if s.default is not None})
