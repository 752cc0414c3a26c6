#!/usr/bin/env bash
# Installs what the test suite needs beyond scripts/install.sh: pytest, the linters, GoogleTest and
# the reference implementations the parity tests compare against.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! dpkg -s libgtest-dev >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
fi
"$PY" -m pip install -q pytest numpy expecttest torch==2.14.1
# Linters of scripts/lint.sh (pinned: a new release may add rules or change the C++ layout).
"$PY" -m pip install -q ruff==0.17.6 clang-format==23.1.5
# Emerging-Optimizers 0.4.0 is not on the package index and is not installed: its behaviour is
# re-expressed in float64 in tests/python/support/eo040_reference.py, which the 0.4 parity tests compare to.
# Benchmark peer: Dao-AILab's gram-newton-schulz (its torch backend only; its GPU kernels' packages,
# quack-kernels and nvidia-cutlass-dsl, are not needed for that).
"$PY" -m pip install -q --no-deps gram-newton-schulz==0.1.6
# Hugging Face Trainer, for the tests of its Muon + AdamW optimizer factory (pinned: Trainer's
# optimizer entry points change between releases).
"$PY" -m pip install -q "transformers==5.24.0" "accelerate==1.15.0" torch==2.14.1
# Megatron-LM's optimizer factory, for the integration tests. megatron-core 0.19.2 declares
# Python >= 3.12, but its optimizer factory and GPTModel import on 3.11 and need nothing beyond
# torch, numpy and packaging (its extras pull Transformer Engine, Apex etc.: not wanted here).
"$PY" -m pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2 "packaging>=24.2"
