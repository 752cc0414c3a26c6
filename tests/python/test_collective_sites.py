"""Every call site of a collective in the package is listed in docs/limits.md ("Collectives, and
what keeps the ranks together") with what keeps the ranks together there: a new collective cannot
land without saying whether the ranks agree before it (docs/sharded.md, "Ranks that differ")."""

import ast
import os
import re

import pytest

# torch.distributed's collectives, called through megatron_eopt._collectives or directly
COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all_single", "all_to_all", "all_gather_object",
               "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
               "scatter", "gather"}
# The checkout these tests belong to (its sources and docs, whichever package is installed)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_eopt")
LIMITS = os.path.join(ROOT, "docs", "limits.md")


def _is_collective(call: ast.Call) -> bool:
    fn = call.func
    if isinstance(fn, ast.Attribute):
        if fn.attr == "full_tensor":  # DTensor's all-gather
            return True
        if fn.attr in COLLECTIVES:
            owner = fn.value
            return (isinstance(owner, ast.Name) and owner.id in ("collectives", "dist")) or (
                isinstance(owner, ast.Attribute) and owner.attr == "distributed")
    # getattr(t, "full_tensor", None): a DTensor's all-gather called when present
    return (isinstance(fn, ast.Name) and fn.id == "getattr" and len(call.args) >= 2
            and isinstance(call.args[1], ast.Constant) and call.args[1].value == "full_tensor")


def call_sites() -> set[tuple[str, str]]:
    """(path from the repository root, qualified function) of every collective call in the package."""
    sites = set()
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or name == "_collectives.py":
                continue
            rel = os.path.relpath(path, os.path.dirname(PACKAGE)).replace(os.sep, "/")
            stack = []

            def visit(node):
                scoped = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                if scoped:
                    stack.append(node.name)
                if isinstance(node, ast.Call) and _is_collective(node):
                    sites.add((rel, ".".join(stack)))
                for child in ast.iter_child_nodes(node):
                    visit(child)
                if scoped:
                    stack.pop()

            with open(path) as f:
                visit(ast.parse(f.read()))
    return sites


def documented() -> set[tuple[str, str]]:
    """(path, function) pairs of the table's rows: each row's paths, each followed by its functions."""
    with open(LIMITS) as f:
        text = f.read()
    section = text.split("## Collectives, and what keeps the ranks together", 1)[1]
    out = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        path = None
        for token in re.findall(r"`([^`]+)`", cell):
            if token.startswith("megatron_eopt/"):
                path = token
            elif path is not None:
                out.add((path, token))
    return out


@pytest.mark.skipif(not os.path.exists(LIMITS) or not os.path.isdir(PACKAGE), reason="not in a checkout")
def test_every_collective_call_site_is_documented():
    sites = call_sites()
    assert len(sites) >= 15, sites  # the scan finds the sites it should (the sharded step's among them)
    assert ("megatron_eopt/optim/multirank/owner_exchange.py", "_Transfer._start_hop") in sites
    missing = sorted(sites - documented())
    assert not missing, ("collective call sites not in docs/limits.md 'Collectives, and what keeps the ranks "
                         f"together' (say what keeps the ranks together there): {missing}")
    stale = sorted(documented() - sites)
    assert not stale, f"docs/limits.md lists call sites that no longer call a collective: {stale}"
