#!/usr/bin/env python3
"""Host time per call: megatron-eopt's ops and optimizer step on tiny tensors, next to plain ATen ops.

    python benchmarks/op_overhead.py [--device cpu|cuda] [--calls N] [--profile]

On tiny tensors a call's time is its host work: argument checks, the dispatcher, scratch
allocation, the algorithm choice, kernel and GEMM launches. Each row times N calls back to back
(CUDA: enqueued without synchronizing, then one synchronize) and reports microseconds per call,
the best of five such runs. The ATen rows are the floor one dispatcher call costs. The last rows
time a whole Muon step of the demo model's 16 matrices (examples/train_gpt.py), eager; below the
table, the Python calls of one such step (a count, steady where a shared machine's timings move).

``--profile`` adds torch.profiler's table (CPU and, on a GPU, CUDA activity) of a few Newton–Schulz
calls at 1024² and of a few demo steps: where the host time goes.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if glob.glob(os.path.join(REPO_ROOT, "megatron_eopt", "_C*.so")):
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

import env_info  # noqa: E402
import param_sets  # noqa: E402

import megatron_eopt as me  # noqa: E402
from megatron_eopt.ops._newton_schulz import _ns_arguments  # noqa: E402


def per_call_us(fn, device: torch.device, calls: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(10, calls // 10)):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def latency_us(fn, device: torch.device, calls: int) -> float:
    """Per call with a synchronize after each: host work plus GPU time, nothing overlapped."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one():
        fn()
        sync()

    return per_call_us(one, device, calls)


def demo_step(device: torch.device, precision: str):
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in param_sets.demo_gpt()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt = me.optim.Muon(params, lr=0.02, fp32_matmul_prec=precision)
    return opt.step


def rows(device: torch.device, calls: int, precision: str) -> list[tuple[str, float]]:
    tiny = torch.randn(8, 8, device=device)
    coeffs, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, precision, "auto")
    op = torch.ops.megatron_eopt.newton_schulz.default
    a = [torch.randn(64, device=device)]
    b = [torch.randn(64, device=device)]
    out: list[tuple[str, float]] = []

    def add(name, fn, n=calls):
        out.append((name, per_call_us(fn, device, n)))
        print(f"{name}: {out[-1][1]:.1f} us", file=sys.stderr, flush=True)

    add("aten: torch.mm 8x8", lambda: torch.mm(tiny, tiny))
    add("aten: torch._foreach_add_ (1 tensor of 64)", lambda: torch._foreach_add_(a, b, alpha=0.5))
    add("newton_schulz 8x8, 5 steps (op)",
        lambda: op(tiny, coeffs, 5, repeat_last, 1e-7, None, precision, "auto", "clamp", 1.0, False, False))
    add("newton_schulz 8x8, 5 steps (Python wrapper)",
        lambda: me.newton_schulz(tiny, 5, eps=1e-7, precision=precision))
    add("foreach_update_ (1 tensor of 64)", lambda: me.foreach_update_(a, b, [1.0], lr=0.5))
    add("Muon step, demo model (16 matrices)", demo_step(device, precision), max(20, calls // 20))
    if device.type == "cuda":
        big = torch.randn(1024, 1024, device=device)
        fn = lambda: me.newton_schulz(big, 5, eps=1e-7, precision=precision)  # noqa: E731
        out.append(("newton_schulz 1024², 5 steps: back to back", per_call_us(fn, device, 200)))
        out.append(("newton_schulz 1024², 5 steps: synchronized each call", latency_us(fn, device, 200)))
        step = demo_step(device, precision)
        out.append(("Muon step, demo model: synchronized each step", latency_us(step, device, 100)))
    return out


def python_calls_per_step(device: torch.device, precision: str, steps: int = 20) -> float:
    """Python-level calls (cProfile's count, calls into C included) of one eager demo-model step: a
    figure of the step's host work that, unlike its time, does not move with the machine's load."""
    import cProfile
    import pstats

    step = demo_step(device, precision)
    for _ in range(3):  # the plan's layouts and the state are made by the first steps
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    return pstats.Stats(prof).total_calls / steps


def profile(device: torch.device, precision: str) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    big = torch.randn(1024, 1024, device=device)
    step = demo_step(device, precision)
    for _ in range(3):
        me.newton_schulz(big, 5, eps=1e-7, precision=precision)
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    tables = []
    for name, fn in (("newton_schulz 1024² x 10", lambda: me.newton_schulz(big, 5, eps=1e-7, precision=precision)),
                     ("Muon step, demo model x 10", step)):
        with torch_profile(activities=activities) as prof:
            for _ in range(10):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        tables.append(f"### {name}\n\n```\n"
                      + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n```\n")
    return "\n".join(tables)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--precision", choices=["medium", "high", "highest"], default=None,
                        help="default: medium on cuda, highest on cpu")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = args.precision or ("medium" if device.type == "cuda" else "highest")
    env = env_info.collect(device)
    measured = rows(device, args.calls, precision)
    lines = [f"## Host time per call, {env['device_name']} ({device.type})", "",
             f"Measured by `python benchmarks/op_overhead.py`: commit `{env['git_commit']}`; torch {env['torch']}; "
             f"date {env['date_utc']}; precision {precision}; best of five runs of back-to-back calls.", "",
             "| call | µs per call |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in measured]
    lines += ["", f"Python calls per demo-model step (cProfile's count, calls into C included): "
                  f"{python_calls_per_step(device, precision):.0f}."]
    print("\n".join(lines))
    if args.profile:
        print()
        print(profile(device, precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
