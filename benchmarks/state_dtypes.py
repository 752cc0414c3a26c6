#!/usr/bin/env python3
"""State bytes and speed of each ``state_dtype`` (fp32, bf16, int8, fp8) on whole models' matrices.

    python benchmarks/state_dtypes.py [--device cpu|cuda] [--quick] [--results-md FILE] [--repeats N]

Per parameter set and state dtype: the bytes of Muon's state per parameter (codes and block scales
counted, measured on the optimizer's own state tensors), the momentum op alone (fp32 state:
``foreach_momentum_``; others: ``foreach_momentum_quantized_``, writing the same fp32 NS input),
and a whole Muon step at the default settings (``fp32_matmul_prec="medium"``, quintic, 5 steps).
Everything is timed interleaved (one call of each state dtype in turn) and reported as the median
with its ratio to fp32 state (> 1: faster than fp32 state). CPU sets: GPT-2 124M and one
Llama-3.2-1B layer; on a GPU also all of Llama-3.2-1B and four Llama-3-8B layers.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if glob.glob(os.path.join(REPO_ROOT, "megatron_eopt", "_C*.so")):
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

import env_info  # noqa: E402
import param_sets  # noqa: E402
import report  # noqa: E402

from megatron_eopt import low_memory_state as lms  # noqa: E402
from megatron_eopt.optim import Muon  # noqa: E402
from megatron_eopt.optim import state_bytes  # noqa: E402

STATE_DTYPES = lms.STATE_DTYPES


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(fns: dict, repeats: int, device) -> dict[str, float]:
    """Median ms of each callable, called in turn (one of each per round) after one warm-up round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rnd in range(repeats + 1):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if rnd:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_set(label: str, shapes, device, repeats: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    numel = sum(m * n for m, n in shapes)
    grads = [torch.randn(m, n, device=device, generator=gen) for m, n in shapes]
    # the momentum op alone, on its own state per dtype
    op_calls = {}
    mu = torch.full((), 0.95, dtype=torch.float64, device=device)
    wd = torch.zeros((), dtype=torch.float64, device=device)
    seed = torch.zeros((), dtype=torch.int64, device=device)
    ns = [torch.empty(m, n, device=device) for m, n in shapes]
    for sd in STATE_DTYPES:
        if sd == "fp32":
            bufs = [torch.zeros(m, n, device=device) for m, n in shapes]
            op_calls[sd] = lambda b=bufs: torch.ops.megatron_eopt.foreach_momentum_(grads, b, ns, [], mu, True, wd,
                                                                                  "decoupled")
        else:
            dtype = lms.momentum_dtype(sd)
            codes = [torch.zeros(m, n, device=device, dtype=dtype) for m, n in shapes]
            scales = ([torch.zeros(lms.scales_shape((m, n), 256), device=device) for m, n in shapes]
                      if lms.has_scales(dtype) else [])
            op_calls[sd] = lambda c=codes, s=scales: torch.ops.megatron_eopt.foreach_momentum_quantized_(
                grads, c, s, ns, [], mu, True, wd, "decoupled", 256, seed)
    op_ms = _interleaved(op_calls, repeats * 3, device)
    del op_calls, ns
    # whole Muon steps at the default settings
    optimizers, bytes_per_param = {}, {}
    for sd in STATE_DTYPES:
        params = [torch.nn.Parameter(torch.randn(m, n, device=device, generator=gen) * 0.02) for m, n in shapes]
        for p, g in zip(params, grads):
            p.grad = g
        opt = Muon(params, lr=0.02, state_dtype=sd)
        opt.init_state()
        bytes_per_param[sd] = sum(state_bytes(opt.state[p]) for p in params) / numel
        optimizers[sd] = opt
    step_ms = _interleaved({sd: opt.step for sd, opt in optimizers.items()}, repeats, device)
    rows = []
    for sd in STATE_DTYPES:
        rows.append(dict(set=label, params=numel, state_dtype=sd, bytes_per_param=bytes_per_param[sd],
                         smaller=bytes_per_param["fp32"] / bytes_per_param[sd], op_ms=op_ms[sd],
                         op_vs_fp32=op_ms["fp32"] / op_ms[sd], step_ms=step_ms[sd],
                         step_vs_fp32=step_ms["fp32"] / step_ms[sd]))
    return rows


def markdown(rows: list[dict], env: dict, repeats: int) -> str:
    lines = [
        f"## State dtypes: {env['device_name']}",
        "",
        f"commit {env['git_commit']}, torch {env['torch']}, {env['date_utc']}; Muon state per parameter "
        "(codes and block scales of 256 values counted), the momentum op alone, and a whole Muon step at the "
        f"default settings (bf16 Newton–Schulz, quintic, 5 steps); medians of {repeats} (op: {3 * repeats}) "
        "interleaved calls. \"vs fp32\": fp32 state's time / this state's (> 1: faster).",
        "",
        "| parameter set | state | bytes / param | fp32 / this | momentum op ms | vs fp32 | Muon step ms | vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['set']} ({r['params'] / 1e6:.0f} M) | {r['state_dtype']} | {r['bytes_per_param']:.3f} | "
            f"{r['smaller']:.2f}x | {r['op_ms']:.2f} | {r['op_vs_fp32']:.2f}x | {r['step_ms']:.1f} | "
            f"{r['step_vs_fp32']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--results-md", metavar="FILE", help="update this device's state-dtype section")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sets = {"GPT-2 124M": param_sets.gpt2_124m, "Llama-3.2-1B layer": param_sets.llama_1b_layer}
    if device.type == "cuda" and not args.quick:
        sets.update({"Llama-3.2-1B": param_sets.llama_1b, "Llama-3-8B, 4 layers": param_sets.llama_8b_layers})
    repeats = args.repeats or (2 if args.quick else (20 if device.type == "cuda" else 5))
    rows = []
    for label, shapes_fn in sets.items():
        shapes = shapes_fn()
        if args.quick:
            shapes = [(max(1, m // 32), max(1, n // 32)) for m, n in shapes]
        rows.extend(measure_set(label, shapes, device, repeats))
    env = env_info.collect(device)
    body = markdown(rows, env, repeats)
    report.publish(body, args.results_md, f"state dtypes: {env['device_name'].split(',')[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
