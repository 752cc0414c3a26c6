#!/usr/bin/env bash
# Installs everything, then runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Run from outside the checkout so `import megatron_eopt` is the installed package.
examples=$PWD/examples
cd "$(mktemp -d)" && cp -r "$examples" . && python3 examples/train_gpt.py --out "$OLDPWD/train_gpt_loss.png" "$@"
