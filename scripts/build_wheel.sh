#!/usr/bin/env bash
# Builds the release wheel of megatron-eopt into OUT_DIR against the torch installed in this
# Python (build it once per torch version you ship for):
#
#   scripts/build_wheel.sh OUT_DIR
#
# CUDA kernels for MEGATRON_EOPT_CUDA_ARCHS (default 80;90;100: machine code for A100, H100,
# B200 and PTX that newer GPUs compile at load time) when nvcc is found. The libraries link torch's
# C++ ABI, so the wheel's metadata requires the torch major.minor it was built with; its platform
# tag is the build machine's (py3-none-linux_x86_64: no Python ABI dependency).
set -euo pipefail
OUT=${1:?usage: scripts/build_wheel.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}")
export MEGATRON_EOPT_CUDA_ARCHS=${MEGATRON_EOPT_CUDA_ARCHS:-80;90;100}
"$PY" -c "import wheel" 2>/dev/null || "$PY" -m pip install -q wheel

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$TMP/raw" .
TORCH_MM=$("$PY" -c "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))")
"$PY" -m wheel unpack -d "$TMP/unpacked" "$TMP"/raw/*.whl >/dev/null
META=$(ls "$TMP"/unpacked/*/*.dist-info/METADATA)
sed -i "s/^Requires-Dist: torch\b.*/Requires-Dist: torch==${TORCH_MM}.*/" "$META"
grep -q "^Requires-Dist: torch==${TORCH_MM}\.\*$" "$META" || { echo "build_wheel.sh: could not pin torch in $META" >&2; exit 1; }
"$PY" -m wheel pack -d "$OUT" "$TMP"/unpacked/* >/dev/null
ls "$OUT"/*.whl
