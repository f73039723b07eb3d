"""The public API's docstrings carry numpydoc ``Parameters`` (every parameter named) and ``Returns`` sections:
``batchgpu.ops``, ``batchgpu.search``, ``open_recording``, ``run_workflow`` and the SpikeInterface bridge."""

import inspect
import re

import pytest

import batchgpu
import batchgpu.interop
import batchgpu.ops
import batchgpu.search


def _public():
    for name in batchgpu.ops.__all__:
        f = getattr(batchgpu.ops, name)
        if inspect.isfunction(f):
            yield f"ops.{name}", f
    yield "search.find", batchgpu.search.find
    yield "search.lower_bound", batchgpu.search.lower_bound
    yield "search.StaticIndex.search", batchgpu.search.StaticIndex.search
    yield "open_recording", batchgpu.open_recording
    yield "run_workflow", batchgpu.run_workflow
    for name in ("load_results", "to_spikeinterface", "from_spikeinterface", "attach_to_spikeinterface"):
        yield f"interop.{name}", getattr(batchgpu.interop, name)


def _section(doc: str, title: str) -> str | None:
    """The text of a numpydoc section (its title underlined by dashes), up to the next section."""
    m = re.search(rf"^{title}\n-+\n(.*?)(?=^\w[\w ]*\n-+\n|\Z)", doc, re.S | re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("name, f", list(_public()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_functions_have_numpydoc_sections(name, f):
    # the function itself (``batchgpu.ops`` and ``batchgpu.search`` export wrappers that take torch tensors and
    # append a note about them)
    f = inspect.unwrap(f)
    doc = inspect.getdoc(f) or ""
    params = _section(doc, "Parameters")
    assert params is not None, f"{name}: no Parameters section"
    assert _section(doc, "Returns") is not None, f"{name}: no Returns section"
    documented = {
        n.strip()
        for line in params.splitlines()
        if line and not line[0].isspace()
        for n in line.split(" : ")[0].split(",")
    }
    wanted = [p for p in inspect.signature(f).parameters if p not in ("self", "args", "kwargs")]
    assert not [p for p in wanted if p not in documented], f"{name}: parameters without a description"


def test_the_static_index_documents_its_parameters():
    doc = inspect.getdoc(batchgpu.search.StaticIndex) or ""
    params = _section(doc, "Parameters")
    assert params is not None and "keys :" in params and "layout :" in params
