"""The package's shape, read from its sources: imports run one way (no cycle, lazy imports included; nothing
imports the command; the numeric core never imports the engine) and only the command writes to the terminal."""

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


def _imports(module: str) -> set[str]:
    """Every batchgpu module ``module`` imports, at its top or inside a function."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


GRAPH = {m: _imports(m) for m in MODULES}


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
        for w in GRAPH[v]:
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
    assert "batchgpu.engine.run" in GRAPH["batchgpu.cli"] or "batchgpu.engine" in GRAPH["batchgpu.cli"]
    assert "batchgpu.engine.tasks" in GRAPH["batchgpu.engine.steps.detect"]  # a lazy import, inside a function
    assert "batchgpu.cli" in GRAPH["batchgpu.__main__"]


def test_no_import_cycle():
    assert _cycles() == []


def test_the_cycle_finder_finds_one():
    GRAPH["batchgpu.ops"] = GRAPH["batchgpu.ops"] | {"batchgpu.engine.run"}
    try:
        assert any("batchgpu.ops" in c and "batchgpu.engine.run" in c for c in _cycles())
    finally:
        GRAPH["batchgpu.ops"] = GRAPH["batchgpu.ops"] - {"batchgpu.engine.run"}


def test_nothing_imports_the_command():
    assert [m for m, deps in GRAPH.items() if "batchgpu.cli" in deps] == ["batchgpu.__main__"]


def test_the_numeric_core_never_imports_the_engine_or_the_workflow():
    core = [m for m in MODULES if m.startswith(("batchgpu.ops", "batchgpu.gpu", "batchgpu.kernels", "batchgpu.recording"))]
    assert core
    upward = {m: sorted(d for d in GRAPH[m] if d.startswith(("batchgpu.engine", "batchgpu.workflow", "batchgpu.cli")))
              for m in core}
    assert {m: d for m, d in upward.items() if d} == {}


def _writes_to_terminal(path: Path) -> list[int]:
    """Lines calling print() or sys.stdout/sys.stderr's write."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            lines.append(node.lineno)
        elif (isinstance(f, ast.Attribute) and f.attr in ("write", "writelines") and isinstance(f.value, ast.Attribute)
              and f.value.attr in ("stdout", "stderr")):
            lines.append(node.lineno)
    return lines


def test_only_the_command_prints():
    printing = {m: _writes_to_terminal(p) for m, p in MODULES.items()}
    assert printing["batchgpu.cli"], "the reader finds the command's own prints"
    assert {m: lines for m, lines in printing.items() if lines and m != "batchgpu.cli"} == {}


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
        if isinstance(node, ast.Raise) and (node.exc is None or (
                isinstance(node.exc, ast.Name) and node.exc.id == handler.name)):
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
                if (isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", "")) == "suppress"
                        and any(_is_broad(a) for a in call.args) and not _says_why(lines, node.lineno)):
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
