#!/usr/bin/env bash
# Installs everything (the package, then the tests' requirements), lints the sources (scripts/lint.sh), then runs the whole test suite: GoogleTest
# (ctest) for the torch-free C++, pytest for the ops and optimizers (GPU-marked tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_test_deps.sh
bash scripts/lint.sh

cmake -S . -B build/cpp-tests -G Ninja -DMEGATRON_EOPT_BUILD_TESTS=ON >/dev/null
cmake --build build/cpp-tests
ctest --test-dir build/cpp-tests --output-on-failure

# Run from outside the checkout so `import megatron_eopt` is the installed package.
cd "$(mktemp -d)"
python3 -m pytest "$OLDPWD/tests/python" -q -rs "$@"

# The release wheel: built, installed into a fresh venv, its op and optimizer tests run there.
bash "$OLDPWD/scripts/test_wheel.sh"
