#!/usr/bin/env bash
# Downloads the wheels scripts/gpu_verify.sh installs on a GPU machine that has no network
# (Python 3.12, x86-64) into .whl/ at the repository root (ignored by git). Run it on a machine
# with access to the package index, then carry .whl/ along with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  emerging-optimizers==0.3.0 absl-py typing_extensions megatron-core==0.19.2 expecttest \
  gram-newton-schulz==0.1.6
ls -l .whl
