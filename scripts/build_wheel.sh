#!/usr/bin/env bash
# Builds the release wheel of megatron-eopt into OUT_DIR against the torch installed in this
# Python:
#
#   scripts/build_wheel.sh OUT_DIR
#
# CUDA kernels for MEGATRON_EOPT_CUDA_ARCHS (default 80;90;100: machine code for A100, H100,
# B200 and PTX that newer GPUs compile at load time) when nvcc is found. Both libraries use the
# LibTorch stable ABI only, compiled for the stable-ABI version of MEGATRON_EOPT_TORCH_FLOOR
# (default 2.11): the wheel loads on that torch and every later one, which its metadata states
# (torch>=FLOOR). The CUDA kernels load where torch's CUDA major matches the build's (13 for a
# CUDA 13 nvcc); elsewhere the CPU ops work and the reason is reported. Platform tag: the build
# machine's (py3-none-linux_x86_64: no Python ABI dependency).
set -euo pipefail
OUT=${1:?usage: scripts/build_wheel.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}")
export MEGATRON_EOPT_CUDA_ARCHS=${MEGATRON_EOPT_CUDA_ARCHS:-80;90;100}
export MEGATRON_EOPT_TORCH_FLOOR=${MEGATRON_EOPT_TORCH_FLOOR:-2.11}
FLOOR=$MEGATRON_EOPT_TORCH_FLOOR

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$TMP" .
WHEEL=$(ls "$TMP"/*.whl)
# The metadata must promise what the libraries were compiled for.
"$PY" - "$WHEEL" "$FLOOR" <<'PY'
import sys, zipfile
wheel, floor = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [l for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist: torch")]
    libs = [n for n in z.namelist() if n.endswith(".so")]
if requires != [f"Requires-Dist: torch>={floor}"]:
    sys.exit(f"build_wheel.sh: {meta} requires {requires}, expected torch>={floor} (pyproject.toml's dependency)")
print("libraries:", ", ".join(sorted(libs)))
PY
cp "$WHEEL" "$OUT"/
ls "$OUT"/*.whl
