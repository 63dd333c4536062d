"""What a newcomer meets in the package, read statically (`scripts/code_report.py`): the
longest functions, the classes with the most methods, imports inside functions, packages (and
root modules) that import each other both ways or in a cycle, and imports going up the
package's written layer order (`LAYERS`), every import counted (those inside functions too),
the modules at the package root, and `engine.py`'s length.

Run it on two checkouts (`--root OLD/jaxpipe`, `--root NEW/jaxpipe`) for before/after figures
from the same code. Only the files are read (ast); nothing is imported.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ReportConfig:
    """What `scripts/code_report.py` reads and prints (its flags).

    root: the package directory to read
    top: how many of the longest functions and the largest classes to list
    json_path: also write the report here as JSON
    """

    root: str = "jaxpipe"
    top: int = 10
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under `root` (a package is its __init__)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method."""
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def classes(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(name, methods, lines) of every class."""
    return [(node.name, sum(isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef))
                            for c in node.body), node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def local_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement inside a function."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                out.append(("." * node.level + (node.module or ""), node.lineno))
    return sorted(set(out), key=lambda x: x[1])


def imported(tree: ast.Module, importer: str, is_package: bool) -> set[str]:
    """Every module name an import statement anywhere in the module names (absolute; for
    `from a import b` both a and a.b)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, importer, is_package)
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def area(module: str, root_name: str) -> str:
    """The package a module belongs to (`jaxpipe.kv.manager` -> `jaxpipe.kv`); modules at the
    root are their own area."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else root_name


def two_way(deps: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of areas that import each other."""
    return sorted({tuple(sorted((a, b))) for a, bs in deps.items() for b in bs
                   if a != b and a in deps.get(b, set())})


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The groups of areas that reach each other through imports (strongly connected
    components of more than one area), Tarjan's algorithm."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(deps.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return sorted(out)


def layers(root: Path) -> tuple[tuple[str, ...], ...] | None:
    """The package's written layer order (`LAYERS` in its __init__, read statically), or None
    where it has none."""
    init = root / "__init__.py"
    if not init.exists():
        return None
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LAYERS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def upward(deps: dict[str, set[str]], order) -> list[str]:
    """Imports from an area to one of a higher layer of `order` (areas outside every layer,
    root modules among them, count as violations too)."""
    index = {name: i for i, names in enumerate(order) for name in names}

    def layer(area_name: str):
        return index.get(area_name.split(".")[1] if "." in area_name else "", len(order))

    return sorted(f"{a} -> {b}" for a, bs in deps.items() for b in bs if layer(b) > layer(a))


def report(cfg: ReportConfig) -> dict:
    """Every figure of the report for the package at `cfg.root`."""
    root = Path(cfg.root)
    mods = modules(root)
    fns, cls, local, deps = [], [], [], {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        fns += [(f"{name}.{f}", n) for f, n in functions(tree)]
        cls += [(f"{name}.{c}", m, n) for c, m, n in classes(tree)]
        local += [(f"{name}:{line}", what) for what, line in local_imports(tree)]
        mine = area(name, root.name)
        if mine == root.name:  # the package's own __init__: the public names' facade
            continue
        for other in imported(tree, name, path.name == "__init__.py"):
            if other in mods and area(other, root.name) not in (mine, root.name):
                deps.setdefault(mine, set()).add(area(other, root.name))
    fns.sort(key=lambda x: -x[1])
    cls.sort(key=lambda x: -x[1])
    lengths = sorted(n for _, n in fns)
    engine = next((p for p in (root / "engine" / "engine.py", root / "engine.py") if p.exists()),
                  root / "engine.py")
    return {
        "root": str(root), "modules": len(mods),
        "root_modules": sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py"),
        "functions": len(fns), "median_function_lines": lengths[len(lengths) // 2],
        "longest_functions": fns[:cfg.top],
        "largest_classes": [{"class": c, "methods": m, "lines": n} for c, m, n in cls[:cfg.top]],
        "function_local_imports": len(local),
        "function_local_imports_of_the_package": sum(
            w.startswith((root.name, ".")) for _, w in local),
        "two_way_package_pairs": two_way(deps),
        "import_cycles": cycles(deps),
        "layers": layers(root),
        "upward_imports": None if layers(root) is None else upward(deps, layers(root)),
        "engine_py_lines": len(engine.read_text().splitlines()) if engine.exists() else None,
    }


def format_report(r: dict) -> str:
    lines = [f"{r['root']}: {r['modules']} modules ({len(r['root_modules'])} at the root), "
             f"{r['functions']} functions, median {r['median_function_lines']} lines",
             "longest functions:"]
    lines += [f"  {n:>4}  {name}" for name, n in r["longest_functions"]]
    lines.append("most methods:")
    lines += [f"  {c['methods']:>4}  {c['class']} ({c['lines']} lines)"
              for c in r["largest_classes"]]
    lines.append(f"imports inside functions: {r['function_local_imports']} "
                 f"({r['function_local_imports_of_the_package']} of the package itself)")
    pairs = r["two_way_package_pairs"]
    lines.append(f"packages importing each other both ways: {len(pairs)}"
                 + "".join(f"\n  {a} <-> {b}" for a, b in pairs))
    groups = r["import_cycles"]
    lines.append(f"groups of packages and root modules that import each other in a cycle: "
                 f"{len(groups)}" + "".join(f"\n  {' -> '.join(g)}" for g in groups))
    if r["layers"] is None:
        lines.append("layer order: none written down")
    else:
        lines.append(f"imports going up the layer order ({len(r['layers'])} layers, every "
                     f"import counted): {len(r['upward_imports'])}"
                     + "".join(f"\n  {x}" for x in r["upward_imports"]))
    lines.append(f"engine.py: {r['engine_py_lines']} lines")
    return "\n".join(lines)


def run(cfg: ReportConfig) -> dict:
    """`report`, printed, and written to `cfg.json_path` if given."""
    r = report(cfg)
    print(format_report(r))
    if cfg.json_path:
        write(r, cfg.json_path)
    return r


def write(r: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(r, indent=1))
