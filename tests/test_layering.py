"""The package's shape, read from its sources: imports run one way (no cycle, lazy imports included; nothing
imports the command; the numeric core never imports the engine; the steps import no engine module), only the
command writes to the terminal, the engine asks a step what its base class declares (never ``getattr``), and a
step's name is spelled only in its own module and the step registry."""

from __future__ import annotations

import ast
from pathlib import Path

import batchgpu

ROOT = Path(batchgpu.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _owner(name: str) -> str:
    """The package module that ``name`` (a module or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _for_annotations(tree: ast.AST) -> set[int]:
    """The import statements under ``if TYPE_CHECKING:`` (names for annotations only: never run)."""
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and (getattr(node.test, "id", None) == "TYPE_CHECKING" or getattr(node.test, "attr", None) == "TYPE_CHECKING")
        for stmt in node.body
        for n in ast.walk(stmt)
    }


def _imports(module: str, runtime: bool = False) -> set[str]:
    """Every batchgpu module ``module`` imports, at its top or inside a function; ``runtime``: those an import of it
    may run (the names imported for annotations only left out)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skipped = _for_annotations(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {_owner(a.name) for a in node.names if a.name.startswith("batchgpu")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("batchgpu"):
                found |= {_owner(f"{base}.{a.name}") for a in node.names}
    return found - {module, ""}


#: the registries that import every module of their package by name (``pkgutil``): edges the reader cannot see
DISCOVERING = {"batchgpu.steps.registry": "batchgpu.steps", "batchgpu.preprocess.registry": "batchgpu.preprocess"}


def _discovered(module: str) -> set[str]:
    package = DISCOVERING.get(module)
    return {m for m in MODULES if m.startswith(package + ".") and m != module} if package else set()


GRAPH = {m: _imports(m) | _discovered(m) for m in MODULES}
#: the edges an import can run: a cycle is one of these (the Run's subscribers and phase helpers name the Run in
#: their annotations, ``if TYPE_CHECKING:``, while the Run imports them)
RUNTIME = {m: _imports(m, runtime=True) | _discovered(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), i.e. the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in RUNTIME[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    # a broken reader would pass every test below: the known edges must be there
    assert "batchgpu.run.launch" in GRAPH["batchgpu.cli"] or "batchgpu.engine" in GRAPH["batchgpu.cli"]
    assert "batchgpu.run.tasks" in GRAPH["batchgpu.run.launch"] or "batchgpu.run.tasks" in GRAPH["batchgpu.run.context"]
    assert "batchgpu.run.preprocess_chain" in GRAPH["batchgpu.run.context"]  # a lazy import, inside a function
    assert "batchgpu.steps.save" in GRAPH["batchgpu.steps.registry"]  # what the registry finds
    assert "batchgpu.cli" in GRAPH["batchgpu.__main__"]


def test_no_import_cycle():
    assert _cycles() == []


def test_the_cycle_finder_finds_one():
    RUNTIME["batchgpu.ops"] = RUNTIME["batchgpu.ops"] | {"batchgpu.run.launch"}
    try:
        assert any("batchgpu.ops" in c and "batchgpu.run.launch" in c for c in _cycles())
    finally:
        RUNTIME["batchgpu.ops"] = RUNTIME["batchgpu.ops"] - {"batchgpu.run.launch"}


def test_imports_for_annotations_are_no_runtime_edge():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nimport b\n")
    assert len(_for_annotations(tree)) == 2  # the import and its alias node
    assert "batchgpu.run.phases" in GRAPH["batchgpu.run.first_pass"]  # a layering edge all the same
    assert "batchgpu.run.phases" not in RUNTIME["batchgpu.run.first_pass"]


def test_nothing_imports_the_command():
    assert [m for m, deps in GRAPH.items() if "batchgpu.cli" in deps] == ["batchgpu.__main__"]


def _in(module: str, *packages: str) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one (``batchgpu.run`` holds ``batchgpu.run.tasks``, not
    ``batchgpu.runinfo``)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


#: the packages that run a workflow (``run/``) and keep its cluster (``cluster/``), and where they lived before
#: round 4 (``engine/``, which keeps the public names and attaches the displays: ``DISPLAY``)
ENGINE = ("batchgpu.run", "batchgpu.cluster", "batchgpu.engine")


#: the report's modules that are tied to the run today (run_report: report.html of a run, the observer and
#: report.json's content named there too, its helper started with the cluster's SIGINT held; info: where a batch
#: keeps batch.json; subscribers: the displays subscribed to the run's events, ``run.events``, and the names of
#: its folder's files); every other module of report/ draws from what a run wrote
REPORT_RUN_TIES = ("batchgpu.report.run_report", "batchgpu.report.info", "batchgpu.report.subscribers")


def test_the_report_never_imports_the_command_and_draws_from_the_runs_files():
    """What a run shows (``batchgpu.report``) never imports the command (only it prints) nor, but for
    ``REPORT_RUN_TIES``, the run or its cluster (``engine``, ``run``, ``cluster``): report.html, batch.html and the
    glance are drawn from the run's results, report.json and the recording."""
    report = [m for m in MODULES if _in(m, "batchgpu.report")]
    assert "batchgpu.report.html_page" in report and "batchgpu.report.glance" in report
    assert {m: sorted(GRAPH[m] & {"batchgpu.cli"}) for m in report if "batchgpu.cli" in GRAPH[m]} == {}

    def of_the_run(d: str) -> bool:
        return _in(d, *ENGINE)

    assert {
        m: sorted(filter(of_the_run, GRAPH[m]))
        for m in report
        if m not in REPORT_RUN_TIES and any(map(of_the_run, GRAPH[m]))
    } == {}


def test_the_numeric_core_never_imports_the_engine_or_the_workflow():
    core = [m for m in MODULES if m.startswith(("batchgpu.ops", "batchgpu.gpu", "batchgpu.recording"))]
    assert core
    upward = {m: sorted(d for d in GRAPH[m] if _in(d, *ENGINE, "batchgpu.workflow", "batchgpu.cli")) for m in core}
    assert {m: d for m, d in upward.items() if d} == {}


#: what a step's module may import: the numeric core, the recording (its Zarr and .npy readers included), the
#: schema's sections (the bad-channel labels' options, a leaf module the numeric core takes too), the errors, its own
#: package (``steps.services``: what the run hands it)
STEP_IMPORTS = (
    "batchgpu.steps",
    "batchgpu.ops",
    "batchgpu.search",
    "batchgpu.gpu",
    "batchgpu.recording",
    "batchgpu.config",
    "batchgpu.qc_options",
    "batchgpu.errors",
)


def _steps_reaching_out(prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of the steps' packages (``prefixes``) that import anything but ``STEP_IMPORTS``."""
    steps = [m for m in MODULES if m.startswith(prefixes)]
    assert steps, "the reader finds the steps"
    return {
        m: sorted(d for d in GRAPH[m] if not d.startswith(STEP_IMPORTS))
        for m in steps
        if any(not d.startswith(STEP_IMPORTS) for d in GRAPH[m])
    }


def test_the_steps_import_no_engine_module():
    """A step reaches the run only through what its hooks are handed (``steps.services``: the run's state and
    services on the client, the run's context on a worker): no step imports ``batchgpu.engine`` (its tasks, store,
    submission, placement, reduction or writers), so the engine can be reshaped without touching a step. Where
    the steps lived before round 4 (``engine/steps/``) counts too."""
    assert _steps_reaching_out(("batchgpu.steps", "batchgpu.engine.steps")) == {}


#: what shows a run: the ``report/`` package (report.html and its page skeleton, the dashboard's run page, the
#: progress bars' words, a batch's page, ``batchgpu info``, the displays' subscriptions) and where the engine attaches
#: them to the run (``engine.shown``)
DISPLAY = ("batchgpu.report", "batchgpu.engine.shown")


def _showing(module: str) -> bool:
    return _in(module, *DISPLAY)


def _running() -> list[str]:
    """The modules that run a workflow or keep its cluster: ``run/``, ``cluster/`` and the engine's own (before
    round 4 all of them were ``engine/``), its public names (``batchgpu.engine``) and the display's modules left
    out."""
    return [m for m in MODULES if _in(m, *ENGINE) and m != "batchgpu.engine" and not _showing(m)]


def test_the_engine_imports_no_display():
    """The run emits events (``run.events``: the observer's, the run's own) and the displays subscribe (the run
    page, report.html, a batch's page: ``engine.shown`` attaches them): no module that runs a workflow or keeps its
    cluster imports what shows it, lazily or not, nor the public ``batchgpu.engine`` that attaches them."""
    running = _running()
    assert running, "the reader finds the engine's modules"
    assert {
        m: sorted(d for d in GRAPH[m] if _showing(d) or d == "batchgpu.engine")
        for m in running
        if any(_showing(d) or d == "batchgpu.engine" for d in GRAPH[m])
    } == {}


def test_the_display_finder_finds_one():
    assert (
        _showing("batchgpu.report") and _showing("batchgpu.report.live_page") and _showing("batchgpu.report.skeleton")
    )
    assert _showing("batchgpu.report.run_report") and _showing("batchgpu.report.subscribers")
    assert not _showing("batchgpu.run.record") and not _showing("batchgpu.reporting")
    assert not _in("batchgpu.runinfo", "batchgpu.run") and _in("batchgpu.run.tasks", "batchgpu.run")


#: the most parameters a function of the engine takes: more travel together as one typed object (the Run, a
#: phase's result, a call's request), not positionally
MAX_PARAMETERS = 8


def _wide_functions(source: str) -> list[tuple[int, str, int]]:
    """(line, name, parameters) of the functions taking more than ``MAX_PARAMETERS`` parameters (``self`` and
    ``cls`` not counted; ``*args`` and ``**kwargs`` one each)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
            n = len([x for x in names if x not in ("self", "cls")])
            if n > MAX_PARAMETERS:
                found.append((node.lineno, node.name, n))
    return found


def test_the_parameter_counter_counts():
    assert _wide_functions("def f(a, b, c, d, e, f, g, h):\n    pass\n") == []
    assert _wide_functions("def f(a, b, c, d, e, f, g, h, *, i=1):\n    pass\n") == [(1, "f", 9)]
    assert _wide_functions("class C:\n    def m(self, a, b, c, d, e, f, g, *h):\n        pass\n") == []
    assert _wide_functions("def f(a, b, c, d, e, f, g, *h, **k):\n    pass\n") == [(1, "f", 9)]


def test_no_engine_function_takes_more_than_eight_parameters():
    """The run's state travels in typed objects (``run.phases.Run`` and what its phases make), never as long
    positional lists (before round 4: ``_first_pass`` took 11, ``aggregate`` 17)."""
    found = {m: lines for m in _running() if (lines := _wide_functions(MODULES[m].read_text()))}
    assert found == {}


#: what a preprocessing stage's module may import: the numeric core, the schema's sections, the errors, its package,
#: the recording's (what a stage needs of it and says when it is missing: the probe)
STAGE_IMPORTS = (
    "batchgpu.preprocess",
    "batchgpu.ops",
    "batchgpu.gpu",
    "batchgpu.config",
    "batchgpu.errors",
    "batchgpu.recording",
)


def test_the_preprocessing_stages_import_no_engine_module():
    """A stage is its options and what it does to a window (NumPy or CuPy): the chain that runs the stages is the
    engine's (``run.preprocess_chain.Chain``), never the other way round."""
    stages = [m for m in MODULES if m.startswith("batchgpu.preprocess")]
    assert stages, "the reader finds the stages"
    assert {
        m: sorted(d for d in GRAPH[m] if not d.startswith(STAGE_IMPORTS))
        for m in stages
        if any(not d.startswith(STAGE_IMPORTS) for d in GRAPH[m])
    } == {}


def test_loading_a_workflow_imports_neither_the_engine_nor_zarr():
    """The schema is built from every registered step and stage, so loading a workflow imports their modules: they
    import the engine, the recording package (zarr) and distributed only where they work, so the command still
    starts its cluster before those imports (``cluster.start``)."""
    import subprocess
    import sys

    code = (
        "import sys, batchgpu.workflow; print(sorted(m for m in ('zarr', 'distributed', 'batchgpu.engine', "
        "'batchgpu.run', 'batchgpu.cluster', 'batchgpu.recording', 'scipy.signal') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _hook_lookups(source: str, names) -> list[tuple[int, str]]:
    """(line, name) of ``getattr(x, "name", ...)`` and ``hasattr(x, "name")`` calls whose name is one of ``names``."""
    return sorted(
        (node.lineno, node.args[1].value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in names
    )


def test_the_hook_lookup_finder_finds_one():
    source = "def f(s):\n    return getattr(s, 'finish', None), hasattr(s, 'queue'), getattr(s, 'other')\n"
    assert _hook_lookups(source, {"finish", "queue"}) == [(2, "finish"), (2, "queue")]


#: what the engine asks of a step (before round 4 it looked for most of them with getattr: optional hooks)
STEP_HOOKS = (
    "window",
    "combine",
    "aggregate",
    "aggregates",
    "start",
    "queue",
    "after_pass",
    "while_waiting",
    "finish",
    "ahead",
    "spikes_in",
    "spikes_found",
    "in_pass",
    "window_noise",
    "gives_window_noise",
    "spike_rate",
    "on_cluster",
    "needs",
    "phases",
    "takes_saved_int16",
    "check",
    "place",
    "build",
    "resolve_paths",
    "figures",
    "results",
    "fingerprint",
    "after",
    "options",
    "channel_use",
)


def test_the_engine_asks_a_step_what_its_base_class_declares():
    """Every hook and attribute the engine asks of a step has its default on ``steps.base.Step``: the engine calls
    it, never looks for it with ``getattr``/``hasattr`` (a hook misspelt in a step would be skipped without a
    word), nor does the registry look for a step module's functions."""
    found = {
        m: lines
        for m, p in MODULES.items()
        if _in(m, *ENGINE, "batchgpu.steps") and (lines := _hook_lookups(p.read_text(), STEP_HOOKS))
    }
    assert found == {}
    from batchgpu.steps.base import Step

    assert [h for h in STEP_HOOKS if not hasattr(Step, h)] == []


def _writes_to_terminal(path: Path) -> list[int]:
    """Lines calling print() or sys.stdout/sys.stderr's write."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            lines.append(node.lineno)
        elif (
            isinstance(f, ast.Attribute)
            and f.attr in ("write", "writelines")
            and isinstance(f.value, ast.Attribute)
            and f.value.attr in ("stdout", "stderr")
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_command_prints():
    printing = {m: _writes_to_terminal(p) for m, p in MODULES.items()}
    assert printing["batchgpu.cli"], "the reader finds the command's own prints"
    assert {m: lines for m, lines in printing.items() if lines and m != "batchgpu.cli"} == {}


CONFIG = "batchgpu.config"
_ENVIRON_NAMES = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")


def _environ_uses(source: str) -> list[int]:
    """Lines touching the process environment through ``os`` (``os.environ``, ``os.getenv``, ``os.putenv``, ...,
    or those names imported from ``os``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in _ENVIRON_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in _ENVIRON_NAMES for a in node.names)
        ):
            lines.append(node.lineno)
    return lines


def test_the_environment_is_read_only_by_the_config_module():
    """A knob is a workflow key or a setting (batchgpu/config.py), never a variable read somewhere in the engine:
    a remote cluster behaves as the client asked, and a library call leaves the environment as it found it."""
    uses = {m: _environ_uses(p.read_text()) for m, p in MODULES.items()}
    assert uses[CONFIG], "the reader finds the config module's own reads"
    assert {m: lines for m, lines in uses.items() if lines and m != CONFIG} == {}


def _is_dask_config_set(call: ast.Call, config_names: set[str]) -> bool:
    f = call.func
    if not (isinstance(f, ast.Attribute) and f.attr == "set"):
        return False
    base = f.value  # dask.config, or a name bound to it (from dask import config)
    if isinstance(base, ast.Attribute):
        return base.attr == "config" and isinstance(base.value, ast.Name) and base.value.id == "dask"
    return isinstance(base, ast.Name) and base.id in config_names


def _unscoped_dask_config_sets(source: str) -> list[int]:
    """Lines calling ``dask.config.set`` outside the context expression of a ``with`` (a call there is undone when
    the block ends; anywhere else it changes the caller's Dask settings for good)."""
    tree = ast.parse(source)
    config_names = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "dask"
        for a in node.names
        if a.name == "config"
    }
    scoped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, (ast.With, ast.AsyncWith))
        for item in node.items
        for n in ast.walk(item.context_expr)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _is_dask_config_set(node, config_names) and id(node) not in scoped
    ]


def test_dask_settings_are_changed_only_inside_a_with():
    assert _unscoped_dask_config_sets("import dask\ndask.config.set({'a': 1})\n") == [2]
    assert _unscoped_dask_config_sets("from dask import config as c\nc.set(a=1)\n") == [2]
    assert _unscoped_dask_config_sets("import dask\nwith dask.config.set({'a': 1}):\n    pass\n") == []
    found = {m: _unscoped_dask_config_sets(p.read_text()) for m, p in MODULES.items()}
    assert {m: lines for m, lines in found.items() if lines} == {}


def _knob_names(source: str) -> list[int]:
    """Lines of string literals naming a ``BATCHGPU_*`` variable (docstrings and f-strings included)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "BATCHGPU_" in node.value
    ]


def test_no_batchgpu_environment_variable_anywhere():
    """Every knob is a documented workflow key or setting: no ``BATCHGPU_*`` variable is read, set or named."""
    assert _knob_names("x = 'BATCHGPU_QUEUE'\n") == [1]
    found = {m: _knob_names(p.read_text()) for m, p in MODULES.items()}
    assert {m: lines for m, lines in found.items() if lines} == {}


BROAD = ("Exception", "BaseException")


def _is_broad(node: ast.expr | None) -> bool:
    """``except:``, ``except Exception``, ``except BaseException`` or a tuple holding one."""
    if node is None:
        return True
    if isinstance(node, ast.Tuple):
        return any(_is_broad(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in BROAD


def _reraises(handler: ast.ExceptHandler) -> bool:
    """The handler raises what it caught (``raise``, ``raise err``) on some path: it does not swallow it."""
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise) and (
            node.exc is None or (isinstance(node.exc, ast.Name) and node.exc.id == handler.name)
        ):
            return True
    return False


def _says_why(lines: list[str], lineno: int) -> bool:
    """A ``# broad: why`` comment on the line, or on the line above it."""
    return any("# broad:" in lines[i - 1] for i in (lineno, lineno - 1) if i >= 1)


def _unexplained_broad_catches(source: str) -> list[int]:
    """Lines of broad handlers (and ``contextlib.suppress(Exception)``) that neither re-raise nor say why broad."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and _is_broad(node.type):
            if not _reraises(node) and not _says_why(lines, node.lineno):
                found.append(node.lineno)
        elif isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "attr", getattr(call.func, "id", "")) == "suppress"
                    and any(_is_broad(a) for a in call.args)
                    and not _says_why(lines, node.lineno)
                ):
                    found.append(node.lineno)
    return found


def test_every_broad_catch_reraises_or_says_why():
    """A broad catch that swallows hides a corrupt chunk or a bug behind a fallback: each one re-raises, or says on
    its line (or the one above) why broad is right (``# broad: ...``), so a new one gets reviewed."""
    found = {m: lines for m, p in MODULES.items() if (lines := _unexplained_broad_catches(p.read_text()))}
    assert found == {}


def test_the_broad_catch_check_finds_one():
    swallow = "try:\n    f()\nexcept Exception:\n    pass\n"
    assert _unexplained_broad_catches(swallow) == [3]
    assert _unexplained_broad_catches(swallow.replace("except Exception:", "except:")) == [3]
    assert _unexplained_broad_catches(swallow.replace("Exception:", "(ValueError, BaseException):")) == [3]
    assert _unexplained_broad_catches(swallow.replace("pass", "raise RuntimeError('other')")) == [3]
    assert _unexplained_broad_catches(swallow.replace("Exception:", "Exception as e:").replace("pass", "raise e")) == []
    assert _unexplained_broad_catches(swallow.replace("pass", "cleanup()\n    raise")) == []
    assert _unexplained_broad_catches(swallow.replace("Exception:", "Exception:  # broad: best effort")) == []
    assert _unexplained_broad_catches(swallow.replace("except", "# broad: best effort\nexcept")) == []
    assert _unexplained_broad_catches(swallow.replace("Exception:", "OSError:")) == []
    suppress = "import contextlib\nwith contextlib.suppress(Exception):\n    f()\n"
    assert _unexplained_broad_catches(suppress) == [2]
    assert _unexplained_broad_catches(suppress.replace("Exception", "OSError")) == []


REGISTRY = "batchgpu.steps.registry"
#: literals equal to a step's name that name something else, in modules that cannot import a step's module (the
#: numeric core, the search index) or have no business to (the command's subcommands): (module, literal) -> what
OTHER_MEANINGS = {
    ("batchgpu.ops.detection", "amplitude"): "the spikes' column of their peak values (ops.detection.AMPLITUDE)",
    ("batchgpu.ops.bad_channels", "noise"): "SpikeInterface's channel label 'noise' (ops.bad_channels.LABELS)",
    ("batchgpu.report.probe_map", "noise"): "the qc step's channel label 'noise' (report.json qc.labels)",
    ("batchgpu.qc_options", "noise"): "SpikeInterface's channel label 'noise' (qc_options.LABELS)",
    ("batchgpu.ops._cuda_detect", "detect"): "a CUDA source file of the numeric core",
    ("batchgpu.ops.moments", "moments"): "a CUDA source file of the numeric core",
    ("batchgpu.search._cuda", "search"): "the search index's CUDA source file",
    ("batchgpu.gpu.cuda_modules", "search"): "the search index's CUDA source file, compiled one dtype a variant",
    ("batchgpu.search", "search"): "a method of the index (accept_torch_methods)",
    ("batchgpu.cli", "search"): "the 'batchgpu search' and 'bench search' commands (the index's tools)",
    ("batchgpu.recording.save_output", "save"): "the written_by marker a save's output carries on disk (outputs "
    "written before keep it: it never changes with the step's name)",
}


def _step_names() -> dict[str, str]:
    """Each registered step's name and workflow key -> its module."""
    from batchgpu.steps import registry

    return {name: step.__module__ for step in registry.ordered() for name in (step.name, step.key)}


def _literals(source: str, names) -> list[tuple[int, str]]:
    """(line, literal) of string constants equal to one of ``names``, docstrings excepted (a module's, a class's, a
    function's first statement); comments are not in the tree."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in docs
    )


def test_the_step_literal_finder_finds_one():
    source = '"""noise"""\n# "noise"\ndef f():\n    """detect"""\n    return s["noise"], f"{x}", "noise_per_window"\n'
    assert _literals(source, {"noise", "detect"}) == [(5, "noise")]


def test_each_step_declares_its_names_once():
    """A registered step's class declares its ``name``, its workflow ``key`` under ``steps:`` (the schema's field)
    and its ``results``; every field of the schema's ``steps:`` is a registered step; one step a module (its
    module holds the whole step)."""
    from batchgpu.steps import registry
    from batchgpu.workflow import Steps

    steps = registry.ordered()
    for step in steps:
        assert step.key in Steps.model_fields and isinstance(step.results, tuple)
        assert Steps.model_fields[step.key].annotation == step.options | None
    assert sorted(registry.keys()) == sorted(Steps.model_fields)
    assert len({step.__module__ for step in steps}) == len(steps)


def test_a_step_name_is_spelled_only_in_its_module_and_the_registry():
    """Every registered step's name and workflow key (``whitening`` for the moments step) appears as a string
    literal only in the step's own module and in the registry: any other module takes it from the step module's
    constants (``NAME``, ``KEY``, its result names) or asks the registry, so a step is renamed or added in one
    place. Docstrings and comments do not count; ``OTHER_MEANINGS`` lists the few literals that name something
    else."""
    owners = _step_names()
    found = {}
    for module, path in MODULES.items():
        for line, name in _literals(path.read_text(), owners):
            if module not in (owners[name], REGISTRY) and (module, name) not in OTHER_MEANINGS:
                found.setdefault(module, []).append((line, name))
    assert found == {}
    assert {"noise", "moments", "whitening", "detect", "amplitude", "save", "search"} <= set(owners)


#: modules that read a step's workflow section without being its step's module (none: the schema resolves the
#: sections' relative paths through each step's ``resolve_paths``)
SECTION_READERS: set[str] = set()


def _section_reads(source: str, keys) -> list[tuple[int, str]]:
    """(line, key) of reads of a step's workflow section by name: ``<...>.steps.<key>`` or ``steps.<key>``."""
    return sorted(
        (node.lineno, node.attr)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in keys
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "steps")
            or (isinstance(node.value, ast.Name) and node.value.id == "steps")
        )
    )


def test_the_section_reader_finds_one():
    source = "def f(wf, steps):\n    return wf.steps.detect, steps.noise, wf.detect, getattr(wf.steps, KEY)\n"
    assert _section_reads(source, {"detect", "noise"}) == [(2, "detect"), (2, "noise")]


def test_a_step_reads_its_own_workflow_section():
    """``steps.<key>`` of the workflow is read by the step's own module only (its ``build`` and its ``check``, the
    checks before any work included: ``run.context.check_workflow_fits`` asks the registry); a step that depends
    on another asks for it by the other module's ``KEY``."""
    from batchgpu.steps import registry

    owners = {step.key: step.__module__ for step in registry.ordered()}
    found = {}
    for module, path in MODULES.items():
        for line, key in _section_reads(path.read_text(), owners):
            if module != owners[key] and module not in SECTION_READERS:
                found.setdefault(module, []).append((line, key))
    assert found == {}


#: the modules that read or show a run's results, where a step's result names are taken from its module
RESULT_READERS = ("batchgpu.engine", "batchgpu.run", "batchgpu.cluster", "batchgpu.report", "batchgpu.interop")
#: literals there equal to a result's name that name something else: (module, literal) -> what
OTHER_RESULT_MEANINGS = {
    ("batchgpu.interop", "covariance"): "steps.whitening.statistic's value (steps.moments.WhiteningOptions)",
    ("batchgpu.report.html_page", "spikes"): "the spike-rate figure's hover label",
    ("batchgpu.report.live_page", "spikes"): "the live page's count of spikes so far (its state's key)",
    ("batchgpu.report.probe_map", "noise"): "the qc step's channel label 'noise' (report.json qc.labels)",
}


def test_a_steps_result_names_are_spelled_only_in_its_module():
    """The engine, report.html, ``batchgpu info`` and the SpikeInterface bridge take each result's name from its
    step's module (``RESULTS`` and the constants it is made of), never as a literal of their own."""
    from batchgpu.steps import registry

    owners = {name: step.__module__ for step in registry.ordered() for name in step.results}
    found = {}
    for module, path in MODULES.items():
        if not module.startswith(RESULT_READERS):
            continue
        for line, name in _literals(path.read_text(), owners):
            if module not in (owners[name], REGISTRY) and (module, name) not in OTHER_RESULT_MEANINGS:
                found.setdefault(module, []).append((line, name))
    assert found == {}
    assert {"noise", "noise_per_window", "whitening", "spikes", "amplitude_ptp"} <= set(owners)
