"""What README.md, docs/*.md and examples/*.md point at exists: the repository paths they name (in
backticks, code blocks and links), the headings their links jump to, and the ``megatron_eopt.*``
names they cite. Skipped where the documentation is not next to the tests (an installed wheel's
tests run from elsewhere do not need it)."""

from __future__ import annotations

import glob
import importlib
import os
import re
import warnings

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if not (os.path.isfile(os.path.join(ROOT, "README.md")) and os.path.isdir(os.path.join(ROOT, "docs"))):
    pytest.skip(f"no README.md and docs/ at {ROOT}", allow_module_level=True)

DOC_GLOBS = ("README.md", "docs/*.md", "examples/*.md")
README_MAX_LINES = 250
# Paths from the repository root; their first component names them as such.
TOP_DIRS = ("megatron_eopt", "csrc", "tests", "benchmarks", "scripts", "examples", "docs", "cmake", ".ci")
# Paths written relative to the package, the C++ tree or the test folder (`optim/multirank/agreement.py`,
# `kernels/qk_clip.cu`): their first component, and where they are looked up.
INNER_DIRS = {"ops", "optim", "compat", "integrations", "step", "multirank", "cpu", "cuda", "include", "kernels"}
INNER_BASES = ("megatron_eopt", "megatron_eopt/optim", "csrc", "csrc/cuda", "tests/python")
_TOP_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./<>*{}$-]*)" % "|".join(re.escape(d) for d in TOP_DIRS))
_INNER_PATH = re.compile(r"(?<![\w./-])((%s)/[\w./-]*\.\w+)" % "|".join(sorted(INNER_DIRS)))
_PLACEHOLDER = re.compile(r"[<>*{}$]")  # `tests/python/<file>`, `megatron_eopt/_C*.so`: patterns, not paths
_FENCE = re.compile(r"^\s*(```+|~~~+)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_DOTTED = re.compile(r"(?<![\w.])(megatron_eopt(?:\.\w+)+)")


def _doc_files() -> list[str]:
    files = []
    for pattern in DOC_GLOBS:
        files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return files


def _lines(text: str):
    """(line number, line, whether it is code: a fenced or indented block)."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        yield number, line, in_fence or line.startswith("    ")


def references(doc: str, text: str) -> list[tuple[int, str, str]]:
    """(line, kind, target) of every repository reference in ``text`` (the file ``doc``): "path" (a
    path from the root), "inner" (a path under the package or csrc/), "link" (a link's file, resolved
    from ``doc``'s folder, with its "#anchor" if any), "name" (a dotted ``megatron_eopt`` name)."""
    out = []
    for number, line, code in _lines(text):
        spans = [line] if code else [m.group(2) for m in _INLINE_CODE.finditer(line)]
        for span in spans:
            for path in _TOP_PATH.findall(span):
                path = path.rstrip(".,:;)")
                if not _PLACEHOLDER.search(path):
                    out.append((number, "path", path))
            out += [(number, "inner", m[0]) for m in _INNER_PATH.findall(span)]
            out += [(number, "name", name) for name in _DOTTED.findall(span)]
        if not code:
            for target in _LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                out.append((number, "link", f"{resolved}#{anchor}" if anchor else resolved))
    return out


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text: lower case, punctuation other than
    "-" and "_" dropped, spaces as "-", a repeated heading suffixed "-1", "-2", ..."""
    anchors, seen = set(), {}
    for _, line, code in _lines(text):
        m = None if code else _HEADING.match(line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _exists(kind: str, target: str) -> bool:
    if kind == "path":
        return os.path.exists(os.path.join(ROOT, target))
    if kind == "inner":
        return any(os.path.exists(os.path.join(ROOT, base, target)) for base in INNER_BASES)
    return os.path.exists(os.path.join(ROOT, target.partition("#")[0]))


def _all_references() -> list[tuple[str, int, str, str]]:
    out = []
    for doc in _doc_files():
        with open(os.path.join(ROOT, doc)) as f:
            out += [(doc, line, kind, target) for line, kind, target in references(doc, f.read())]
    return out


def test_the_scanner_finds_every_kind_of_reference():
    text = ("See `megatron_eopt/_library.py` and `optim/_rank_agreement.py`, [ops](ops.md#fake-kernels),\n"
            "[home](#top), `tests/python/<file>` and `megatron_eopt.optim.Muon()`.\n"
            "\n"
            "    python3 benchmarks/run.py --results-md benchmarks/RESULTS.md\n"
            "\n"
            "```text\n"
            "scripts/lint.sh, https://example.com/docs/x.md\n"
            "```\n"
            "# A heading: `x` and Newton–Schulz\n")
    assert references("docs/example.md", text) == [
        (1, "path", "megatron_eopt/_library.py"), (1, "inner", "optim/_rank_agreement.py"),
        (1, "link", "docs/ops.md#fake-kernels"), (2, "name", "megatron_eopt.optim.Muon"),
        (2, "link", "docs/example.md#top"),
        (4, "path", "benchmarks/run.py"), (4, "path", "benchmarks/RESULTS.md"),
        (7, "path", "scripts/lint.sh"),
    ]
    assert not _exists("inner", "optim/_rank_agreement.py") and _exists("inner", "optim/multirank/agreement.py")
    assert heading_anchors(text) == {"a-heading-x-and-newtonschulz"}
    assert heading_anchors("## 2.1 Source tree\n## Notes\n## Notes\n") == {"21-source-tree", "notes", "notes-1"}


def test_every_path_the_docs_name_exists():
    refs = [r for r in _all_references() if r[2] in ("path", "inner", "link")]
    assert len(refs) > 100, "the scan found almost nothing: has the docs' syntax changed?"
    missing = [f"{doc}:{line}: {target}" for doc, line, kind, target in refs if not _exists(kind, target)]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_link_anchor_exists():
    anchors: dict[str, set[str]] = {}
    broken = []
    for doc, line, kind, target in _all_references():
        path, _, anchor = target.partition("#")
        if kind != "link" or not anchor or not path.endswith(".md") or not _exists(kind, target):
            continue
        if path not in anchors:
            with open(os.path.join(ROOT, path)) as f:
                anchors[path] = heading_anchors(f.read())
        if anchor not in anchors[path]:
            broken.append(f"{doc}:{line}: {target}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and not (e.name == "megatron_eopt" or e.name.startswith("megatron_eopt.")):
                raise  # a missing optional dependency, not a missing name of ours
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_every_megatron_eopt_name_the_docs_use_resolves():
    names = {}
    for doc, line, kind, target in _all_references():
        if kind == "name":
            names.setdefault(target, f"{doc}:{line}")
    assert len(names) > 20
    broken, unverifiable = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, where in sorted(names.items()):
            try:
                _resolve(name)
            except ModuleNotFoundError as e:
                if e.name is not None and not e.name.startswith("megatron_eopt"):
                    unverifiable.append(name)  # an optional dependency (megatron-core, transformers) is missing
                else:
                    broken.append(f"{where}: {name} ({e})")
            except AttributeError as e:
                broken.append(f"{where}: {name} ({e})")
    assert not broken, "megatron_eopt names in the docs that do not exist:\n" + "\n".join(broken)
    assert len(unverifiable) < len(names)


def test_readme_stays_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"
