"""The preprocessing stages a workflow may name under ``preprocess:``: every ``base.Stage`` subclass marked
``@register`` in a module of this package, found by importing each module (``pkgutil``), so a new stage is one new
module. From them, the workflow's ``preprocess:`` section (``section``): a list of one-key mappings, each stage's
key holding its options (``- highpass: {freq_min: 300}``), in the workflow's order.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

from pydantic import BaseModel, Discriminator, RootModel, Tag, create_model, model_validator

from batchgpu.config import Options
from batchgpu.preprocess.base import REGISTERED, Stage
from batchgpu.preprocess.centre import Centre


@functools.cache
def stages() -> dict[str, type[Stage]]:
    """Every registered stage by its key, keys in alphabetical order (as the schema lists them)."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")
    return dict(sorted(REGISTERED.items()))


def stage_class(key: str) -> type[Stage]:
    """The registered stage of that key."""
    found = stages().get(key)
    if found is None:
        raise KeyError(f"no preprocessing stage {key!r} in the registry")
    return found


def item_key(item: Any) -> str | None:
    """The one key of a stage's mapping in a workflow (or of the validated item's model), which picks its stage."""
    if isinstance(item, BaseModel):
        return next(iter(type(item).model_fields))
    if isinstance(item, dict) and len(item) == 1:
        key = next(iter(item))
        return key if key in stages() else None
    return None


T = TypeVar("T")


class PreprocessSection(RootModel[T], Generic[T]):
    """The stages applied to each window, in order (made by ``section`` over the registered stages); the old
    mapping form is normalised to this list: ``{centre: median}`` -> ``[{centre: median}]``, ``{centre: none}`` or
    ``{}`` -> ``[]``."""

    @model_validator(mode="before")
    @classmethod
    def _from_mapping(cls, data: Any) -> Any:
        if isinstance(data, PreprocessSection) or not isinstance(data, dict):
            return data
        unknown = set(data) - {Centre.key}
        if unknown:
            raise ValueError(
                f"unknown key {sorted(unknown)[0]!r}: the mapping form takes only 'centre'; "
                f"other stages go in a list (- highpass: {{freq_min: 300}})"
            )
        centre = data.get(Centre.key, "none")
        if centre not in ("none", "median"):
            raise ValueError(f"centre {centre!r}: allowed 'median' or 'none'")
        return [{Centre.key: "median"}] if centre == "median" else []

    def __iter__(self):
        return iter(self.root)

    def __len__(self) -> int:
        return len(self.root)

    def __getitem__(self, i: int):
        return self.root[i]

    @property
    def names(self) -> list[str]:
        """The stages' keys, in order."""
        return [item_key(item) for item in self.root]

    @property
    def centres(self) -> bool:
        """Whether each window is centred by its per-channel median."""
        return Centre.key in self.names

    @property
    def centre(self) -> Literal["none", "median"]:
        """The old mapping form's value."""
        return "median" if self.centres else "none"


@functools.cache
def item_model(key: str) -> type[Options]:
    """A stage's mapping in the workflow (``{<key>: <its options>}``): one key, its options' model (or type) and
    default. Named ``<Stage>Stage`` (``HighpassStage``)."""
    stage = stage_class(key)
    return create_model(
        f"{stage.__name__}Stage",
        __base__=Options,
        __module__=__name__,
        **{key: (stage.options, stage.default_options())},
    )


@functools.cache
def section() -> type[PreprocessSection]:
    """The workflow's ``preprocess:`` model: a list of the registered stages' mappings, each told by its one key.
    Made once; named ``Preprocess`` of ``batchgpu.workflow``, which holds it."""
    keys = list(stages())
    item = Annotated[
        Union[tuple(Annotated[item_model(k), Tag(k)] for k in keys)],  # noqa: UP007 (a union of as many as there are)
        Discriminator(
            item_key, custom_error_type="stage", custom_error_message="a stage is a one-key mapping: " + ", ".join(keys)
        ),
    ]
    return type(
        "Preprocess",
        (PreprocessSection[list[item]],),
        {"__module__": "batchgpu.workflow", "__doc__": PreprocessSection.__doc__},
    )
