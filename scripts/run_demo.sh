#!/usr/bin/env bash
# Installs everything, then runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 examples/orthogonalize_demo.py "$@"
