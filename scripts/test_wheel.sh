#!/usr/bin/env bash
# Builds the release wheel once (scripts/build_wheel.sh) and runs the op and optimizer tests
# against the installed wheel in two fresh virtual environments:
#   - this Python's torch (reused, no download): the build's own torch;
#   - torch 2.13.0, CPU build (a local wheel on the CI machines): another torch version and build,
#     where the wheel's stable-ABI libraries must load, the CPU ops work and the CUDA kernels are
#     skipped with one warning.
# Set MEGATRON_EOPT_WHEEL_TORCHES to a space-separated list of torch requirements to change the
# second environment(s), or to "" to skip them.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$(command -v "${PYTHON:-python3}")
TORCHES=${MEGATRON_EOPT_WHEEL_TORCHES-torch==2.13.0}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
bash scripts/build_wheel.sh "$WORK/dist"
# The ops (eager, opcheck, torch.compile) and the optimizers on the CPU; the parity tests against
# other packages stay in the main suite.
TESTS=(test_library_loading.py ops/test_foreach_ops.py ops/test_newton_schulz.py ops/test_newton_schulz_gram.py
       ops/test_newton_schulz_compile.py ops/test_second_moment_ops.py ops/test_split_newton_schulz.py
       optim/test_optim_drop_in.py optim/test_optim_compile.py optim/test_optim_state.py optim/test_hybrid_muon.py)

run_in() {  # run_in VENV: install the wheel without touching torch, then the tests from outside the checkout
  local venv=$1
  "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$WORK"/dist/*.whl
  (cd "$WORK" && "$venv/bin/python" - <<'PY'
import megatron_eopt, os, sys, torch
where = os.path.dirname(megatron_eopt.__file__)
assert where.startswith(sys.prefix), f"megatron_eopt imported from {where}, not the wheel in {sys.prefix}"
print(f"wheel: {where} | torch {torch.__version__} | CUDA kernels: {megatron_eopt.cuda_kernels_built()}")
PY
  )
  (cd "$WORK" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]/#/$ROOT/tests/python/}")
}

"$PY" -m venv --system-site-packages "$WORK/venv"
run_in "$WORK/venv"

for req in $TORCHES; do
  venv="$WORK/venv-${req//[^a-zA-Z0-9.]/_}"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$req" pytest numpy expecttest
  run_in "$venv"
done
