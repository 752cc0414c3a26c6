#!/usr/bin/env bash
# Builds the wheel (scripts/build_wheel.sh), installs it into a fresh virtual environment that
# reuses this Python's torch (no download), and runs the op and optimizer tests there against the
# installed wheel: proves the wheel is complete (both libraries, the Python package) and loads.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$(command -v "${PYTHON:-python3}")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
bash scripts/build_wheel.sh "$WORK/dist"
"$PY" -m venv --system-site-packages "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --no-deps --force-reinstall "$WORK"/dist/*.whl
cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
import megatron_eopt, os, sys
where = os.path.dirname(megatron_eopt.__file__)
assert where.startswith(sys.prefix), f"megatron_eopt imported from {where}, not the wheel in {sys.prefix}"
print("wheel:", where, "| CUDA kernels:", megatron_eopt.cuda_kernels_built())
PY
"$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/tests/python/test_library_loading.py" \
  "$ROOT/tests/python/test_foreach_ops.py" "$ROOT/tests/python/test_newton_schulz.py" \
  "$ROOT/tests/python/test_second_moment_ops.py" "$ROOT/tests/python/test_optim_drop_in.py"
