"""The package's import structure: no module imports one that imports it back (directly or through
others), and the layers import downwards only (docs/design.md §2.1). Every import counts, those
inside functions and under TYPE_CHECKING too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_eopt")


def _modules() -> dict[str, str]:
    out = {}
    root = os.path.abspath(PACKAGE)
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package modules ``name`` imports (a package's __init__ counts only where it is named)."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            parent = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (parent, node.module or "") if p)
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _is_package(name: str) -> bool:
    return os.path.basename(_modules()[name]) == "__init__.py"


def test_no_module_imports_itself_back(graph):
    """Strongly connected components of the module graph, package __init__ files left out (they
    re-export their modules, and a module importing its package's leaf goes through them)."""
    nodes = [n for n in graph if not _is_package(n)]
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index and w in nodes:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("lower,upper", [
    ("megatron_eopt.compat", "megatron_eopt.integrations"),
    ("megatron_eopt.optim.multirank", "megatron_eopt.optim.step"),
    ("megatron_eopt.ops", "megatron_eopt.optim"),
    ("megatron_eopt.optim", "megatron_eopt.compat"),
    ("megatron_eopt.optim", "megatron_eopt.integrations"),
    ("megatron_eopt.clipping", "megatron_eopt.compat"),
])
def test_layers_import_downwards(graph, lower, upper):
    arrows = sorted((a, b) for a, targets in graph.items() if a == lower or a.startswith(lower + ".")
                    for b in targets if b == upper or b.startswith(upper + "."))
    assert arrows == []


def test_step_imports_no_optimizer_class(graph):
    """The fused step's modules import the optimizer package's leaves (configuration, matrix view,
    EO's extension points), never a class module that mixes them in."""
    leaves = {"megatron_eopt.optim._config", "megatron_eopt.optim._recipe", "megatron_eopt.optim._eo_hooks",
              "megatron_eopt.optim.matrix_view"}
    arrows = sorted((a, b) for a, targets in graph.items() if a.startswith("megatron_eopt.optim.step.")
                    for b in targets if b.startswith("megatron_eopt.optim.") and b not in leaves
                    and not b.startswith(("megatron_eopt.optim.step", "megatron_eopt.optim.multirank")))
    assert arrows == []


# File names that repeat on purpose, each an import path users write: the one-import drop-ins
# megatron_eopt.muon / .nanochat / .torch_optim re-export compat/'s modules of the same name, and
# megatron_eopt.optim.muon is the Muon class's own module.
PUBLIC_REPEATED_NAMES = {"muon.py", "nanochat.py", "torch_optim.py"}


def test_no_two_modules_share_a_file_name():
    """A file name says which module it is: two modules named alike (two plan.py, two
    tensor_parallel.py) are read, searched and edited in place of each other."""
    by_name = defaultdict(list)
    for name, path in _modules().items():
        if os.path.basename(path) != "__init__.py":
            by_name[os.path.basename(path)].append(name)
    repeated = {f: sorted(names) for f, names in by_name.items() if len(names) > 1 and f not in PUBLIC_REPEATED_NAMES}
    assert repeated == {}
    assert all(len(by_name[f]) > 1 for f in PUBLIC_REPEATED_NAMES), "a public repeat is gone: drop it from the list"


MAX_LINES = 650


def test_no_package_file_is_too_long():
    """A module does one job: one over MAX_LINES lines holds several; split it by job into modules
    of one purpose each (as optim/multirank/ and compat/nanochat_* are)."""
    root = os.path.dirname(os.path.abspath(PACKAGE))
    lengths = {}
    for path in _modules().values():
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        with open(path) as f:
            lengths[rel] = sum(1 for _ in f)
    assert len(lengths) > 50, lengths  # the package's modules were found
    too_long = {rel: n for rel, n in lengths.items() if n > MAX_LINES}
    assert too_long == {}, f"split these by job (at most {MAX_LINES} lines each): {too_long}"


def test_tests_are_organised_like_the_package():
    """A test file sits in tests/python/ (package-level modules) or in the folder named like the
    subpackage it tests (tests/python/optim/step/ for megatron_eopt/optim/step/); shared helpers
    (references, workers, the harness) sit in tests/python/support/ and hold no tests."""
    tests = os.path.dirname(os.path.abspath(__file__))
    package = os.path.abspath(PACKAGE)
    misplaced = []
    for dirpath, dirnames, files in os.walk(tests):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, tests)
        for f in files:
            if not f.endswith(".py"):
                continue
            where = os.path.join(rel, f)
            if rel == "support":
                if f.startswith("test_"):
                    misplaced.append(f"{where}: a test among the shared helpers")
            elif rel == ".":
                if f != "conftest.py" and not f.startswith("test_"):
                    misplaced.append(f"{where}: a helper outside support/")
            elif not os.path.isdir(os.path.join(package, rel)):
                misplaced.append(f"{where}: megatron_eopt has no subpackage {rel}")
            elif not f.startswith("test_"):
                misplaced.append(f"{where}: a helper outside support/")
    assert not misplaced, misplaced
