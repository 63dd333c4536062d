"""The package's import graph, read statically (ast) from every module under jaxpipe/: no
cycles, no module that names the tools package (`jaxpipe_bench`: benchmarks, peers, soak,
profiler, calibration, the papers' reproductions, which import jaxpipe one way), and
`import jaxpipe` reaches neither it nor the planner (`jaxpipe.planner`), which the engine loads
only for `"auto"` layouts.

An edge A -> B means that running A's imports starts (or needs the finished) B:
  `import a.b.c` and `from a.b import c` start a.b.c when c is a module, and every package
  above it that is not also above A (those are already being imported when A runs);
  `from a.b import name` where `name` is not a module needs a.b's __init__ to have defined it,
  so it is an edge to a.b even when a.b is A's own package (`from jaxpipe import Engine`).
Imports under `if TYPE_CHECKING:` never run and are not edges.

Which imports count: module-level ones (including those in class bodies and top-level
if/try blocks) are what Python runs on import, so a cycle among them can leave a module half
initialised; they are checked for cycles, and for what `import jaxpipe` pulls in. Imports inside
functions run later, on purpose (a planner feature the user asks for, an optional dependency);
they are checked for cycles too, as the stronger rule, but not for the closure of jaxpipe.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "jaxpipe"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
TOOLS = ("jaxpipe_bench", "jaxpipe.planner")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.Module, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: at import time only (module_level), or anywhere."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             known: set[str]) -> set[str]:
    """What the statement starts or needs, before the package filter and ancestor rule."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = _base(node, importer, is_package)
    subs = {f"{base}.{alias.name}" for alias in node.names} & known
    attributes = len(subs) < len(node.names)  # names that are not modules, or "*"
    return subs | ({base} if attributes or base not in _ancestors(importer) else set())


def edges(source: str, importer: str, is_package: bool, known: set[str],
          module_level: bool) -> set[str]:
    """The modules of `known` that `importer` (whose text is `source`) imports."""
    above = set(_ancestors(importer)) | {importer}
    out = set()
    for node in import_nodes(ast.parse(source), module_level):
        for target in _targets(node, importer, is_package, known):
            out.update(a for a in _ancestors(target) if a not in above)
            out.add(target)
    return {m for m in out if m in known and m != importer}


def graph(module_level: bool, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    found = modules(root)
    return {name: edges(path.read_text(), name, path.name == "__init__.py", set(found),
                        module_level)
            for name, path in found.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `g` as [a, b, ..., a], or None if it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(g):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def closure(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module reachable from `start`, itself included."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(g.get(node, ()))
    return seen


# ---- the checker itself ---------------------------------------------------------------------


def test_find_cycle_finds_a_cycle_in_a_small_graph():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_edges_follow_pythons_import_semantics():
    known = {"p", "p.a", "p.b", "p.sub", "p.sub.c", "p.sub.d"}
    source = "from p import a, Thing\nimport p.sub.c\nfrom . import b\nfrom .sub import d\n"
    # `Thing` is an attribute of p, so p's __init__ must have run; `a` and `b` are modules
    assert edges(source, "p.x", False, known, True) == {"p", "p.a", "p.b", "p.sub", "p.sub.c",
                                                        "p.sub.d"}
    assert edges("from p import a\n", "p.x", False, known, True) == {"p.a"}
    assert edges("from . import c\n", "p.sub", True, known, True) == {"p.sub.c"}
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n"
    assert edges(typing_only, "p.x", False, known, True) == set()
    assert edges("from p.sub import c\n", "p.sub.d", False, known, True) == {"p.sub.c"}
    inner = "def f():\n    import p.b\n"
    assert edges(inner, "p.x", False, known, True) == set()
    assert edges(inner, "p.x", False, known, False) == {"p.b"}


def test_a_cycle_written_in_files_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.engine import Engine\n")
    (pkg / "engine.py").write_text("from pkg import tools\nclass Engine: ...\n")
    (pkg / "tools.py").write_text("from pkg import Engine\n")
    assert find_cycle(graph(True, pkg)) == ["pkg", "pkg.engine", "pkg.tools", "pkg"]


# ---- the package ----------------------------------------------------------------------------


@pytest.mark.parametrize("module_level", [True, False], ids=["module-level", "all"])
def test_the_package_has_no_import_cycle(module_level):
    g = graph(module_level)
    assert len(g) > 50 and "jaxpipe.engine" in g["jaxpipe"]
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_package_never_imports_the_tools_package():
    """`jaxpipe_bench` imports jaxpipe, one way: no module of jaxpipe names it, at any depth."""
    named = []
    for name, path in modules().items():
        for node in import_nodes(ast.parse(path.read_text()), module_level=False):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [_base(node, name, path.name == "__init__.py")])
            named += [f"{name} -> {t}" for t in targets if t.split(".")[0] == "jaxpipe_bench"]
    assert named == []


def test_import_jaxpipe_reaches_no_tool_statically():
    reached = closure(graph(True), PACKAGE)
    assert "jaxpipe.executor" in reached
    assert sorted(m for m in reached if m.startswith(TOOLS)) == []


def _tool_modules_after(code: str) -> list[str]:
    """The jaxpipe_bench / jaxpipe.planner modules loaded after running `code` in a fresh
    interpreter."""
    script = (f"import json, sys\n{code}\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({TOOLS}))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_jaxpipe_loads_no_tool():
    assert _tool_modules_after("import jaxpipe") == []


def test_building_and_running_an_engine_loads_no_tool():
    """Default scheduler and layouts on one device, a few greedy tokens."""
    code = ("from jaxpipe import Engine, SamplingParams\n"
            "e = Engine(random_weights=True, max_model_len=64, max_num_seqs=2, "
            "kv_cache_tokens=256, warmup=False, show_progress=False)\n"
            "e.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams("
            "max_tokens=2, temperature=0.0), use_tqdm=False)\ne.close()")
    assert _tool_modules_after(code) == []
