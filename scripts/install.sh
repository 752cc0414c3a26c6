#!/usr/bin/env bash
# Installs what megatron-eopt and its demo need on a fresh machine and builds the package against
# the installed torch. torch is pinned to 2.14.1 (a local CUDA 13.0 build on these machines): a
# looser requirement would make pip download a newer release. The test suite's own requirements
# (references, linters, GoogleTest) are scripts/install_test_deps.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
"$PY" -m pip install -q torch==2.14.1
"$PY" -m pip install -q "scikit-build-core>=0.10" ninja "cmake>=3.26" numpy matplotlib
# The demo times its step against Emerging-Optimizers 0.3.0's Muon (no torch from its requirements;
# it declares Python >= 3.12 and runs on 3.11 with typing_extensions' override).
"$PY" -m pip install -q --no-deps --ignore-requires-python emerging-optimizers==0.3.0 absl-py typing_extensions
# CUDA architectures: the package default (80;90;100 plus PTX) unless MEGATRON_EOPT_CUDA_ARCHS
# names others; one architecture (e.g. 90) builds about three times faster.
"$PY" -m pip install -q --no-build-isolation .
