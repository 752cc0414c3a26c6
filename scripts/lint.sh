#!/usr/bin/env bash
# Lints the sources: ruff on the Python code (rules in pyproject.toml), clang-format on the C++ / CUDA
# files of csrc/ (include/ is under it) and tests/cpp/ (style in .clang-format). Versions are pinned in
# scripts/install_test_deps.sh. Every C++ file must conform (`clang-format -i FILE` fixes one).
#
#   bash scripts/lint.sh                      check (exit 1 on any finding)
#   bash scripts/lint.sh --list-unformatted   print the C++ files clang-format would change
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
cxx_files() { git ls-files 'csrc/*' 'tests/cpp/*' | grep -E '\.(c|cc|cpp|cxx|h|hpp|cu|cuh)$'; }
clang_format() { if command -v clang-format >/dev/null; then clang-format "$@"; else "$PY" -m clang_format "$@"; fi; }

if [ "${1:-}" = "--list-unformatted" ]; then
  cxx_files | while read -r f; do clang_format --dry-run --Werror "$f" >/dev/null 2>&1 || echo "$f"; done
  exit 0
fi

status=0
echo "== ruff check"
if command -v ruff >/dev/null; then ruff check --quiet . || status=1; else "$PY" -m ruff check --quiet . || status=1; fi

echo "== clang-format --dry-run --Werror"
mapfile -t files < <(cxx_files)
if [ "${#files[@]}" -gt 0 ]; then clang_format --dry-run --Werror "${files[@]}" || status=1; fi
echo "   ${#files[@]} files checked"
exit $status
