"""Every ```python block of README.md, docs/*.md and examples/*.md runs as written.

Each block runs in a fresh Python process (``sys.executable -c``) in an empty temporary folder, on
the CPU, within TIMEOUT_S; a failure names the block's file and line and shows its output's tail. A
block whose first line is ``# not run: <reason>`` (several processes, a GPU, a Megatron-LM training
script) is compiled instead, and its imports of ``megatron_eopt``, ``torch`` and the standard
library are resolved: the modules import and the imported names exist. The blocks run WORKERS at a
time (each test waits for its own block), so the file takes about 1 / WORKERS of the blocks' sum.
"""

from __future__ import annotations

import ast
import glob
import importlib
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOC_GLOBS = ("README.md", "docs/*.md", "examples/*.md")
PYTHON_TAGS = ("python", "py", "python3")
NOT_RUN = "# not run:"
# The imports a "not run" block must resolve here: ours, torch's and the standard library's.
CHECKED_PACKAGES = ("megatron_eopt", "torch", *sorted(sys.stdlib_module_names))
TIMEOUT_S = 120
WORKERS = 2

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the block's first line of code (1-based)
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def not_run_reason(self) -> str | None:
        first = self.code.lstrip("\n").split("\n", 1)[0].strip()
        return first[len(NOT_RUN):].strip() if first.startswith(NOT_RUN) else None


def _doc_files() -> list[str]:
    files = []
    for pattern in DOC_GLOBS:
        files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return files


def _fences(path: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) of every fenced block of ``path``."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        marker = m.group(2)
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(marker[0]) * len(marker)}+\s*$", lines[end]):
            end += 1
        out.append((i + 1, m.group(3), textwrap.dedent("\n".join(lines[i + 1:end]))))
        i = end + 1
    return out


def _python_blocks() -> list[Block]:
    return [Block(path, line + 1, body) for path in _doc_files() for line, tag, body in _fences(path)
            if tag.lower() in PYTHON_TAGS]


BLOCKS = _python_blocks()
RUN = [b for b in BLOCKS if b.not_run_reason is None]
NOT_RUN_BLOCKS = [b for b in BLOCKS if b.not_run_reason is not None]


def _run(block: Block) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, stdout + stderr, seconds)."""
    with tempfile.TemporaryDirectory(prefix="docs_example_") as cwd:
        start = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-c", block.code], cwd=cwd, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            errors = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            return None, output + errors, time.monotonic() - start
        return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def runs(request) -> dict[str, Future]:
    """Starts every selected runnable block (WORKERS at a time); each test waits for its own."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "callspec", None) is not None and item.originalname == "test_block_runs"]
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    try:
        yield {block.id: pool.submit(_run, block) for block in selected}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a stopped session (-x) waits only for the running ones


def test_the_docs_have_python_blocks():
    files = {b.path for b in BLOCKS}
    assert {"README.md", "docs/compatibility.md", "docs/optimizers.md", "docs/megatron.md"} <= files, files
    assert len(RUN) >= 10


def test_every_fence_names_its_language():
    """A Python block without its tag would escape this test: every fence says what it holds."""
    untagged = [f"{path}:{line}" for path in _doc_files() for line, tag, _ in _fences(path) if not tag]
    assert not untagged, f"fenced blocks without a language (use ```text for non-code): {untagged}"


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block: Block, runs):
    status, output, seconds = runs[block.id].result()
    print(f"{block.id}: {seconds:.1f} s")
    tail = output[-6000:]
    if status is None:
        pytest.fail(f"{block.id}: still running after {TIMEOUT_S} s\n--- output (tail) ---\n{tail}", pytrace=False)
    if status != 0:
        pytest.fail(f"{block.id}: exit status {status} after {seconds:.1f} s\n--- output (tail) ---\n{tail}",
                    pytrace=False)


def _check_imports(block: Block) -> list[str]:
    """Imports the block's ``megatron_eopt`` / ``torch`` modules and checks the imported names;
    returns the imports left unchecked, each with the reason."""
    unchecked = []
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in CHECKED_PACKAGES:
                    importlib.import_module(alias.name)
                else:
                    unchecked.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{block.id}: a relative import in a documentation block"
            if node.module.split(".")[0] not in CHECKED_PACKAGES:
                unchecked.append(f"from {node.module} import ...")
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:  # a submodule not imported by its package
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    pytest.fail(f"{block.id}: {node.module} has no name {alias.name!r}", pytrace=False)
    reason = "only megatron_eopt, torch and standard-library imports are resolved"
    return [f"{u} (not checked: {reason})" for u in unchecked]


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=[b.id for b in NOT_RUN_BLOCKS])
def test_block_marked_not_run_compiles_and_imports(block: Block):
    assert block.not_run_reason, f"{block.id}: '{NOT_RUN}' needs a reason after it"
    compile(block.code, block.id, "exec")
    for line in _check_imports(block):
        print(f"{block.id}: {line}")
