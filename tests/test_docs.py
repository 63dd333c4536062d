"""The docs name what exists: every file path and every dotted `jaxpipe...` name that a
docstring of jaxpipe/ or jaxpipe_bench/, or the README, names is there, and each package's
`__init__` docstring lists exactly its modules. Read statically (ast); nothing is imported.

A path with a folder (`jaxpipe/kv/manager.py`, `runtime/sizing.py`, `meshes/cpu-8.toml`) is
looked up from the repository's root, jaxpipe/ and jaxpipe_bench/; a bare file name
(`executor.py`) must be some file of the repository. A dotted name (`jaxpipe.engine.builder.
follow`) must be a module, or a module and a name its top level defines (or a module below it).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpipe", "jaxpipe_bench")
# Files of other projects that docstrings name (llama.cpp's converter).
FOREIGN_FILES = {"convert_hf_to_gguf.py"}
# Dotted names that are not Python modules: the gRPC package and the proto file.
NOT_MODULES = {"jaxpipe.v1", "jaxpipe.proto"}

PATH = re.compile(r"(?<![\w/.~<>{}*-])((?:[\w-]+/)*[\w-]+\.(?:py|pyi|cc|proto|toml))\b")
FOLDER = re.compile(r"(?<![\w/.~-])((?:jaxpipe|jaxpipe_bench)/(?:[\w-]+/)*)(?![\w<{*])")
DOTTED = re.compile(r"\b((?:jaxpipe|jaxpipe_bench|jaxpipe_peers)(?:\.[A-Za-z_]\w*)+)")
ENTRY = re.compile(r"^ {4}(\S+)(?: |$)", re.M)  # a listing line of an __init__ docstring


def docstrings(path: Path) -> list[str]:
    """The module's docstring and those of its classes and functions."""
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return [d for d in map(ast.get_docstring, nodes) if d]


def sources() -> list[Path]:
    """Every module of the packages whose docs are checked (not protoc's generated code)."""
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
                  if not p.name.startswith("jaxpipe_pb2"))


@cache
def texts() -> dict[str, str]:
    """Where -> text: each module's docstrings joined, and the README."""
    out = {str(p.relative_to(REPO)): "\n".join(docstrings(p)) for p in sources()}
    out["README.md"] = (REPO / "README.md").read_text()
    return out


@cache
def file_names() -> frozenset[str]:
    """The repository's file names, not those of its git store, its virtual environments
    (.venv, and .venv-newest / .venv-jax-latest that `make test-latest-deps` and
    `make test-jax-latest` leave behind) or node_modules."""
    def skipped(part: str) -> bool:
        return part in (".git", "node_modules") or part.startswith(".venv")

    return frozenset(p.name for p in REPO.rglob("*")
                     if p.is_file() and not any(map(skipped, p.relative_to(REPO).parts)))


def path_exists(name: str) -> bool:
    """A path with a folder from the root, jaxpipe/ or jaxpipe_bench/; a bare name anywhere."""
    if "/" not in name:
        return name in file_names() or name in FOREIGN_FILES
    return any((base / name).exists() for base in (REPO, REPO / "jaxpipe", REPO / "jaxpipe_bench"))


def missing_paths(text: str) -> list[str]:
    named = set(PATH.findall(text)) | set(FOLDER.findall(text))
    return sorted(n for n in named if not path_exists(n))


@cache
def top_level_names(path: Path) -> frozenset[str]:
    """The names a module's top level defines: functions, classes, assignments, imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def module_file(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or a module's top-level name (then anything after it)."""
    if any(dotted == n or dotted.startswith(n + ".") for n in NOT_MODULES):
        return True
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:k]))
        if path is not None:
            return k == len(parts) or parts[k] in top_level_names(path)
    return False


def test_a_stale_path_or_name_is_found():
    text = ("See `jaxpipe/runtime/runner.py`, `runtime/sampler.py`, executor.py, requests.py "
            "and jaxpipe/kv/; `jaxpipe.engine.builder.follow`, `jaxpipe.engine.follow`, "
            "`jaxpipe.runtime.sampling.SamplingParams`, `jaxpipe.sampling`, ~/.cache/jaxpipe/x.py")
    assert missing_paths(text) == ["requests.py", "runtime/sampler.py"]
    names = DOTTED.findall(text)
    assert [n for n in names if not resolves(n)] == ["jaxpipe.engine.follow", "jaxpipe.sampling"]


def test_every_path_named_exists():
    missing = {where: missing_paths(text) for where, text in texts().items()}
    assert {where: names for where, names in missing.items() if names} == {}


def test_every_dotted_name_resolves():
    stale = {where: sorted({n for n in DOTTED.findall(text) if not resolves(n)})
             for where, text in texts().items()}
    assert {where: names for where, names in stale.items() if names} == {}


def packages() -> list[Path]:
    """Every package of jaxpipe below the root, but the families' (listed by name)."""
    root = REPO / "jaxpipe"
    return sorted(p.parent for p in root.rglob("__init__.py")
                  if p.parent not in (root, root / "model" / "families"))


def members(package: Path) -> set[str]:
    """What a package's docstring must list: its modules (`x.py`) and subpackages (`x/`)."""
    return ({p.name for p in package.glob("*.py") if p.name != "__init__.py"}
            | {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()})


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.name)
def test_a_package_docstring_lists_its_modules(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = set(re.findall(r"(?<![\w/.])([\w-]+\.py|[\w-]+/)(?![\w.])", doc))
    entries = set(ENTRY.findall(doc))
    assert members(package) - named == set(), "modules the docstring does not list"
    assert {e for e in entries if not (package / e).exists()} == set(), "listed, not there"


def test_the_families_docstring_names_every_family_module():
    families = REPO / "jaxpipe" / "model" / "families"
    doc = ast.get_docstring(ast.parse((families / "__init__.py").read_text()))
    modules = {p.stem for p in families.glob("*.py") if p.stem != "__init__"}
    assert modules - set(re.findall(r"`(\w+)`", doc)) == set()


def test_the_root_docstring_names_every_subpackage():
    root = REPO / "jaxpipe"
    doc = ast.get_docstring(ast.parse((root / "__init__.py").read_text()))
    subpackages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert set(re.findall(r"^ {4}(\w+) {2,}", doc, re.M)) == subpackages
