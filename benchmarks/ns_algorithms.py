#!/usr/bin/env python3
"""megatron-eopt's Newton–Schulz algorithms against each other, over matrix shapes.

    python benchmarks/ns_algorithms.py [--device cpu|cuda] [--precision P] [--coefficients TYPE]
                                       [--variants V [V ...]] [--shapes MxN [MxN ...]] [--target-s S]
                                       [--quick] [--results-md FILE]

For each shape, the variants are timed interleaved call by call (same inputs, medians), next to
the ratio of the standard and Gram FLOPs (full GEMMs) and what algorithm="auto" runs there. A
variant is "standard" or "gram", optionally with CUDA's opt-in symmetric products:
"standard@4" runs them with at most 4 block columns of at least --min-panel rows
(megatron_eopt.set_cuda_symmetric_products); or, on a CPU, with how "medium" computes its bf16
products: "standard+bf16" (ATen's bf16 GEMMs) or "standard+fp32" (fp32 GEMMs of bf16 values;
megatron_eopt.set_cpu_bf16_products). This is the measurement the "auto" rule of
csrc/include/megatron_eopt/ns_algorithm.h is calibrated on. With --results-md the table becomes
that file's "algorithms: <device>" section.
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
import hyper  # noqa: E402
import ns_flops  # noqa: E402
import report  # noqa: E402

import megatron_eopt as me  # noqa: E402

# Gram sides from launch-bound to compute-bound, aspect ratios from square to 4:1, and the
# shapes of the model sets (GPT-2 MLP and QKV, Qwen3 MoE experts, Llama FFN).
SIDES = [32, 64, 128, 256, 512, 1024]
RATIOS = [1, 1.5, 2, 3, 4]
MODEL_SHAPES = [(768, 2304), (3072, 768), (768, 2048), (2048, 768), (2048, 8192)]


# On a GPU small sides are launch-bound: the sides where the products' FLOPs decide, and the large
# shapes of 8B-70B models (Llama-8B attention and MLP, a 70B MLP's 8192 x 28672).
CUDA_SIDES = [256, 512, 1024, 2048, 4096]
CUDA_RATIOS = [1, 2, 4]
CUDA_MODEL_SHAPES = [(4096, 11008), (4096, 14336), (8192, 8192), (8192, 28672), (14336, 4096)]


def shapes(quick: bool, device_type: str) -> list[tuple[int, int]]:
    if quick:
        return [(32, 128), (64, 256)]
    if device_type == "cuda":
        return [(s, int(s * r)) for s in CUDA_SIDES for r in CUDA_RATIOS] + CUDA_MODEL_SHAPES
    out = [(s, int(s * r)) for s in SIDES for r in RATIOS]
    out += [(4096, 1024)]  # a tall one: the transpose is a choice of products
    return out + MODEL_SHAPES


def parse_variant(name: str) -> tuple[str, int, str]:
    """"gram@4" -> ("gram", 4, "auto"): the algorithm, the symmetric products' most blocks (1: off)
    and the CPU's bf16 products ("standard+fp32" -> ("standard", 1, "fp32"))."""
    name, _, products = name.partition("+")
    algorithm, _, blocks = name.partition("@")
    if (algorithm not in ("standard", "gram") or (blocks and not blocks.isdigit())
            or products not in ("", "bf16", "fp32")):
        raise SystemExit(f"ns_algorithms.py: bad variant {name!r} (standard, gram, standard@K, gram@K, "
                         "standard+bf16, standard+fp32)")
    return algorithm, int(blocks or 1), products or "auto"


def time_variants(x: torch.Tensor, device: torch.device, variants: list[str], min_panel: int, target_s: float,
                  max_repeats: int) -> dict[str, float]:
    def make(name):
        algorithm, blocks, products = parse_variant(name)

        def run():
            if device.type == "cuda":
                me.set_cuda_symmetric_products(blocks, min_panel)
            else:
                me.set_cpu_bf16_products(products)
            return me.newton_schulz(x, steps=hyper.NS_STEPS, coefficient_type=hyper.COEFFICIENT_TYPE,
                                    precision=hyper.PRECISION, algorithm=algorithm)

        return run

    fns = {v: make(v) for v in variants}
    for fn in fns.values():  # first calls: plans, caches
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    sync()
    estimate = (time.perf_counter() - start) / 2
    repeats = int(min(max_repeats, max(3, target_s / max(estimate, 1e-9))))
    samples = {a: [] for a in fns}
    for _ in range(repeats):
        for a, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[a].append(time.perf_counter() - t0)
    if device.type == "cuda":
        me.set_cuda_symmetric_products(None)  # back to the default
    else:
        me.set_cpu_bf16_products("auto")
    return {a: statistics.median(v) * 1e3 for a, v in samples.items()}


def auto_choice(x: torch.Tensor) -> str:
    kwargs = dict(steps=hyper.NS_STEPS, coefficient_type=hyper.COEFFICIENT_TYPE, precision=hyper.PRECISION)
    auto = me.newton_schulz(x, **kwargs)
    return "gram" if torch.equal(auto, me.newton_schulz(x, algorithm="gram", **kwargs)) else "standard"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--precision", choices=["medium", "high", "highest"], default=None)
    parser.add_argument("--coefficients", default=None, metavar="TYPE")
    parser.add_argument("--variants", nargs="+", default=None, metavar="V",
                        help="default: standard gram (cpu); standard gram standard@4 gram@4 standard@8 (cuda)")
    parser.add_argument("--min-panel", type=int, default=256,
                        help="smallest block column of the symmetric products (default 256)")
    parser.add_argument("--target-s", type=float, default=None,
                        help="seconds of timed calls per shape (default 3; 1 on cuda)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="MxN", help="these shapes only")
    parser.add_argument("--quick", action="store_true", help="two tiny shapes: a smoke run")
    parser.add_argument("--results-md", metavar="FILE")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hyper.configure(device.type, args.coefficients, args.precision)
    env = env_info.collect(device)
    load_start = os.getloadavg() if device.type == "cpu" else None
    gen = torch.Generator(device=device).manual_seed(7)
    variants = args.variants or (["standard", "gram", "standard@4", "gram@4", "standard@8"]
                                 if device.type == "cuda" else ["standard", "gram"])
    if device.type != "cuda" and any(parse_variant(v)[1] > 1 for v in variants):
        raise SystemExit("ns_algorithms.py: symmetric-product variants (@K) are CUDA's")
    if device.type == "cuda" and any(parse_variant(v)[2] != "auto" for v in variants):
        raise SystemExit("ns_algorithms.py: bf16-product variants (+bf16, +fp32) are the CPU's")
    for v in variants:
        parse_variant(v)
    target_s = 0.2 if args.quick else (args.target_s or (1.0 if device.type == "cuda" else 3.0))
    rows = []
    chosen = shapes(args.quick, device.type)
    if args.shapes:
        try:
            chosen = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
        except ValueError:
            raise SystemExit(f"ns_algorithms.py: --shapes takes MxN, got {args.shapes}") from None
    for m, n in chosen:
        x = torch.randn(m, n, device=device, generator=gen)
        ms = time_variants(x, device, variants, args.min_panel, target_s=target_s,
                           max_repeats=5 if args.quick else 25)
        flop_ratio = hyper.ns_flops(m, n) / ns_flops.ours_matrix_flops(m, n, device.type, "gram")
        base = ms[variants[0]]
        row = [f"{m}x{n}"] + [f"{ms[v]:.4g}" for v in variants] + [f"{base / ms[v]:.2f}x" for v in variants[1:]]
        row += [f"{flop_ratio:.2f}", auto_choice(x)]
        print(" | ".join(row), file=sys.stderr, flush=True)
        rows.append(row)
    load_end = os.getloadavg() if device.type == "cpu" else None

    columns = (["shape"] + [f"{v} ms" for v in variants] + [f"{variants[0]} / {v}" for v in variants[1:]]
               + ["FLOP ratio", "auto runs"])
    table = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] * len(columns)) + "|"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    facts = [f"commit `{env['git_commit']}`", f"torch {env['torch']}", f"date {env['date_utc']}"]
    if load_start is not None:
        facts.append(f"load average (1, 5, 15 min) {[round(v, 2) for v in load_start]} at the start, "
                     f"{[round(v, 2) for v in load_end]} at the end")
    body = "\n".join([
        f"## Newton–Schulz algorithms, {env['device_name']} ({device.type})",
        "",
        f"Measured by `python benchmarks/ns_algorithms.py`: {'; '.join(facts)}. NS {hyper.COEFFICIENT_TYPE} "
        f"x{hyper.NS_STEPS}, precision {hyper.PRECISION}; variants interleaved call by call"
        + (f" (@K: CUDA's symmetric products, at most K block columns of at least {args.min_panel} rows)"
           if any("@" in v for v in variants) else "")
        + (" (+bf16 / +fp32: the CPU's \"medium\" products as bf16 GEMMs / fp32 GEMMs of bf16 values)"
           if any("+" in v for v in variants) else "")
        + ". FLOP ratio: standard over Gram FLOPs with full GEMMs (the CPU also computes symmetric products "
        "as blocks above the diagonal, in both algorithms).",
        "",
        *table,
        "",
    ])
    report.publish(body, args.results_md, f"algorithms: {env['device_name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
