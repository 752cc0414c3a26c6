#!/usr/bin/env python3
"""Runs a Megatron-LM training script (pretrain_gpt.py, pretrain_mamba.py, ...) with megatron-eopt's
optimizers installed into Megatron-LM's emerging-optimizer registry, without editing the script.

    torchrun --nproc-per-node 8 examples/megatron_launch.py /path/to/Megatron-LM/pretrain_gpt.py \\
        <the script's usual arguments> --optimizer muon --muon-momentum 0.95 ...

Everything after the script's path is passed to it unchanged. `--optimizer muon` and
`--optimizer adaptive_muon` then build megatron-eopt's TensorParallelMuon /
TensorParallelAdaptiveMuon from the usual `--muon-*` flags (see examples/megatron_muon.md).

`--eopt-allow-torch-fsdp2` (taken by this launcher, not passed on) lets the script run our optimizer
with `--use-torch-fsdp2 --ckpt-format torch_dcp`, which Megatron-LM's argument check refuses for every
emerging optimizer (see docs/megatron.md, "Torch-FSDP2").
"""

from __future__ import annotations

import os
import runpy
import sys
import typing


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    allow_fsdp2 = "--eopt-allow-torch-fsdp2" in sys.argv[2:]
    script = os.path.abspath(sys.argv[1])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_launch: no such script: {script}")

    # Megatron-LM's scripts import helpers that sit next to them (gpt_builders, model_provider).
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *(a for a in sys.argv[2:] if a != "--eopt-allow-torch-fsdp2")]

    # Megatron-LM imports Emerging-Optimizers when it is installed; its 0.3.0 release needs
    # typing.override (Python >= 3.12). Provide it on older Pythons when typing_extensions can.
    if not hasattr(typing, "override"):
        try:
            import typing_extensions

            typing.override = typing_extensions.override
        except ImportError:
            pass

    # Before the script builds its optimizer: Megatron's factory reads the registry at that point.
    from megatron_eopt.integrations import megatron as eopt_megatron

    eopt_megatron.install()
    if allow_fsdp2:
        eopt_megatron.allow_torch_fsdp2()
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron-eopt: Megatron-LM optimizers {eopt_megatron.installed()} are megatron-eopt's", file=sys.stderr)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
