"""The package's import graph, read statically (ast) from every module under jaxpipe/: no
cycles, no module that names the tools package (`jaxpipe_bench`: benchmarks, peers, soak,
profiler, calibration, the papers' reproductions, which import jaxpipe one way), and
`import jaxpipe` reaches neither it nor the planner (`jaxpipe.planner`), which the engine loads
only for `"auto"` layouts.

An edge A -> B means that running A's imports starts (or needs the finished) B:
  `import a.b.c` and `from a.b import c` start a.b.c when c is a module, and every package
  above it that is not also above A (those are already being imported when A runs);
  `from a.b import name` where `name` is not a module needs a.b's __init__ to have defined it,
  so it is an edge to a.b even when a.b is A's own package; where a.b loads `name` lazily
  (jaxpipe's public names, its `_HOMES`), it is an edge to the module `name` comes from too
  (`from jaxpipe import Engine` starts jaxpipe.engine.engine; `import jaxpipe` alone does not).
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


def lazy_homes(root: Path = ROOT) -> dict[str, str]:
    """`package.name` -> the module a package's PEP 562 `__getattr__` loads it from: each
    package's `_HOMES` dict, read statically."""
    homes = {}
    for name, path in modules(root).items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "_HOMES" for t in node.targets):
                homes.update({f"{name}.{k}": v for k, v in ast.literal_eval(node.value).items()})
    return homes


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             known: set[str], lazy: dict[str, str]) -> set[str]:
    """What the statement starts or needs, before the package filter and ancestor rule."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = _base(node, importer, is_package)
    subs = {f"{base}.{alias.name}" for alias in node.names} & known
    homes = {lazy[f"{base}.{alias.name}"] for alias in node.names
             if f"{base}.{alias.name}" in lazy}
    attributes = len(subs) < len(node.names)  # names that are not modules, or "*"
    return subs | homes | ({base} if attributes or base not in _ancestors(importer) else set())


def edges(source: str, importer: str, is_package: bool, known: set[str],
          module_level: bool, lazy: dict[str, str] | None = None) -> set[str]:
    """The modules of `known` that `importer` (whose text is `source`) imports; `lazy`:
    `lazy_homes()`."""
    above = set(_ancestors(importer)) | {importer}
    out = set()
    for node in import_nodes(ast.parse(source), module_level):
        for target in _targets(node, importer, is_package, known, lazy or {}):
            out.update(a for a in _ancestors(target) if a not in above)
            out.add(target)
    return {m for m in out if m in known and m != importer}


def graph(module_level: bool, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    found, lazy = modules(root), lazy_homes(root)
    return {name: edges(path.read_text(), name, path.name == "__init__.py", set(found),
                        module_level, lazy)
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
    assert len(g) > 50 and "jaxpipe.engine.executor" in g["jaxpipe.engine.builder"]
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


def test_import_jaxpipe_and_its_public_names_reach_no_tool_statically():
    g = graph(True)
    reached = closure(g, PACKAGE)
    for home in set(lazy_homes().values()):
        reached |= closure(g, home)
    assert "jaxpipe.engine.executor" in reached
    assert sorted(m for m in reached if m.startswith(TOOLS)) == []


def test_a_lazy_public_name_is_an_edge_to_its_home(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('_HOMES = {"Engine": "pkg.engine"}\n')
    (pkg / "engine.py").write_text("from pkg import tools\nclass Engine: ...\n")
    (pkg / "tools.py").write_text("from pkg import Engine\n")
    assert lazy_homes(pkg) == {"pkg.Engine": "pkg.engine"}
    assert graph(True, pkg)["pkg"] == set()
    assert find_cycle(graph(True, pkg)) == ["pkg.engine", "pkg.tools", "pkg.engine"]


def _tool_modules_after(code: str) -> list[str]:
    """The jaxpipe_bench / jaxpipe.planner modules loaded after running `code` in a fresh
    interpreter."""
    script = (f"import json, sys\n{code}\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({TOOLS}))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_jaxpipe_loads_no_tool():
    assert _tool_modules_after("import jaxpipe\njaxpipe.Engine") == []


def _loads_jax(code: str) -> bool:
    """Whether running `code` in a fresh interpreter loads jax."""
    script = f"import sys\n{code}\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout
    return out.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("code", [
    "import jaxpipe",
    "import jaxpipe.config.checks, jaxpipe.config.flags",
    "import jaxpipe.scheduler",
    "import jaxpipe_bench.soak",  # the soak driver's imports (scripts/soak.py)
    "from jaxpipe.config.flags import add_flags, config_from_args\n"
    "from jaxpipe_bench.soak import Soak, SoakConfig\nSoakConfig()",
])
def test_jax_free_modules_load_no_jax(code):
    assert not _loads_jax(code)


def test_the_public_names_load_on_use_and_are_listed():
    script = ("import sys, jaxpipe\nfrom jaxpipe import Engine, SamplingParams\n"
              "assert Engine.__module__ == 'jaxpipe.engine.engine' and jaxpipe.Engine is Engine\n"
              "assert set(jaxpipe.__all__) <= set(dir(jaxpipe))\n"
              "assert jaxpipe.__version__\n"
              "try:\n    jaxpipe.Nope\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout
    assert "has no attribute 'Nope'" in out


def test_building_and_running_an_engine_loads_no_tool(tiny_smollm2):
    """Default scheduler, layouts and dtype on one device, a few greedy tokens (on the
    two-layer SmolLM2 of tests/conftest.py: what an engine imports does not depend on the
    model's size, and SmolLM2-135M's random weights took 20 s on 2 cores)."""
    code = ("from jaxpipe import Engine, SamplingParams\n"
            f"e = Engine(model={tiny_smollm2!r}, max_model_len=64, max_num_seqs=2, "
            "kv_cache_tokens=256, warmup=False, show_progress=False)\n"
            "e.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams("
            "max_tokens=2, temperature=0.0), use_tqdm=False)\ne.close()")
    assert _tool_modules_after(code) == []


# ---- the layers (jaxpipe.LAYERS) ------------------------------------------------------------


def layer_index(module: str, layers=None) -> int | None:
    """The layer of `jaxpipe.<sub>...` in `layers` (default: jaxpipe.LAYERS); None for the
    package's own __init__ (the public names' facade)."""
    from jaxpipe import LAYERS

    parts = module.split(".")
    if len(parts) == 1:
        return None
    for i, names in enumerate(layers or LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: {parts[1]} is in no layer of jaxpipe.LAYERS")


def upward_imports(g: dict[str, set[str]], layers=None) -> list[str]:
    """Every edge of `g` from a module to one of a higher layer."""
    out = []
    for a, targets in sorted(g.items()):
        for b in sorted(targets):
            la, lb = layer_index(a, layers), layer_index(b, layers)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} -> {b}")
    return out


def test_every_import_goes_down_the_layers():
    """Every import of the package, function-local ones included, is of a module of the same
    layer or a lower one (jaxpipe.LAYERS), and every module lives in a subpackage of a layer:
    the root holds only the public names."""
    g = graph(module_level=False)
    assert upward_imports(g) == []
    assert [m for m in g if m.count(".") == 1 and m.split(".")[1] not in
            {n for names in __import__("jaxpipe").LAYERS for n in names}] == []


def test_an_upward_import_is_found():
    g = {"p.low.a": {"p.high.b"}, "p.high.b": {"p.low.a"}, "p": {"p.high.b"}}
    assert upward_imports(g, layers=(("low",), ("high",))) == ["p.low.a -> p.high.b"]


def test_imports_inside_functions_say_why():
    """An import inside a function is a lazy load (an optional dependency, or one kept off a
    path that must stay light, e.g. `--help` without jax): each says why, in a `# lazy:`
    comment on its line or above it in its group of imports."""
    unexplained = []
    for name, path in modules().items():
        if path.name.endswith("_pb2_grpc.py"):
            continue
        lines = path.read_text().splitlines()
        for node in import_nodes(ast.parse(path.read_text()), module_level=False):
            if _inside_function(path, node) and not _says_why(lines, node.lineno - 1):
                unexplained.append(f"{name}:{node.lineno}")
    assert unexplained == []


def _says_why(lines: list[str], i: int) -> bool:
    """Whether line i, or a line of the imports, comments and blank lines right above it,
    holds a `# lazy:` comment."""
    first = True
    while i >= 0 and (first or not lines[i].strip()
                      or lines[i].lstrip().startswith(("import ", "from ", "#"))):
        if "# lazy:" in lines[i]:
            return True
        first, i = False, i - 1
    return False


def _inside_function(path: Path, node) -> bool:
    tree = ast.parse(path.read_text())
    return any(node.lineno in range(fn.lineno, fn.end_lineno + 1)
               for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)))
