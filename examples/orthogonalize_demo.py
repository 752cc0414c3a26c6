"""Orthogonalizes a batch of matrices with megatron-eopt and with a plain-PyTorch loop.

Prints how close the results are, how orthogonal they are, and the time each takes.
Runs on a GPU when one is present, else on the CPU.
"""

import argparse
import statistics
import time

import torch

import megatron_eopt as me
from megatron_eopt.newton_schulz import get_coefficients


def plain_pytorch_loop(xs, steps=5):
    """The textbook per-matrix loop (Emerging-Optimizers / Keller Jordan style) in bf16."""
    outs = []
    for x in xs:
        X = x.mT if x.size(0) > x.size(1) else x
        X = torch.nn.functional.normalize(X, p=2, dim=(-2, -1), eps=1e-7).bfloat16()
        for a, b, c in get_coefficients("quintic", steps):
            A = X @ X.mT
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a, alpha=1.0)
        X = X.float()
        outs.append(X.mT if x.size(0) > x.size(1) else X)
    return torch.stack(outs)


def median_time(fn, device, repeats):
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # first run warms up


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"megatron-eopt {me.__version__}, torch {torch.__version__}, device {device}, "
          f"CUDA kernels built: {me.cuda_kernels_built()}")
    x = torch.randn(args.batch, args.rows, args.cols, device=device)

    ours = me.newton_schulz(x, steps=5, coefficient_type="quintic", precision="medium")
    loop = plain_pytorch_loop(x)
    diff = float((ours - loop).norm() / loop.norm())
    s = torch.linalg.svdvals(ours[0].double().cpu())
    print(f"batch of {args.batch} x ({args.rows} x {args.cols}) fp32, quintic NS, 5 steps, bf16 compute")
    print(f"  relative difference to the plain loop: {diff:.2e}")
    print(f"  singular values of the first result: min {float(s.min()):.3f}, max {float(s.max()):.3f}")

    t_ours = median_time(lambda: me.newton_schulz(x, precision="medium"), device, args.repeats)
    t_loop = median_time(lambda: plain_pytorch_loop(x), device, args.repeats)
    print(f"  megatron-eopt batched op: {t_ours * 1e3:8.2f} ms")
    print(f"  plain PyTorch loop:       {t_loop * 1e3:8.2f} ms   ({t_loop / t_ours:.2f}x ours)")


if __name__ == "__main__":
    main()
