#!/usr/bin/env python3
"""One ``megatron_eopt.nanochat.MuonAdamW`` step against a ``torch.compile``d plain-PyTorch
equivalent, on the CPU (single process, fp32: nanochat's compute dtype without a GPU).

    python benchmarks/nanochat_step.py [--layers L] [--width D] [--vocab V] [--repeats N] [--results-md FILE]

The parameter set is a nanochat-style GPT: per layer q, k, v, o (D x D) and the MLP (4D x D,
D x 4D) in Muon groups of one shape; embedding, LM head and two scalars in AdamW groups. The
peer runs the same math (Nesterov momentum, MuonEq, Polar Express with a 1.01 divisor, Muon+,
variance reduction, cautious decay; AdamW) with one compiled function per Muon group (stacked,
as nanochat) and one per AdamW parameter. Both step the same parameters and grads, interleaved
call by call; the figure is the median call. With --results-md the table becomes that file's
"nanochat MuonAdamW step" section.
"""

from __future__ import annotations

import argparse
import glob
import math
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
import report  # noqa: E402

from megatron_eopt.compat.nanochat_stacked import NANOCHAT_POLAR_EXPRESS  # noqa: E402
from megatron_eopt.nanochat import MuonAdamW  # noqa: E402


def param_set(layers: int, width: int, vocab: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    muon = []
    for _ in range(layers):
        muon += [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]
    adamw = [(vocab, width), (vocab, width), (layers,), (layers,)]
    return muon, adamw


def groups_for(params_muon, params_adamw):
    groups = [dict(kind="adamw", params=params_adamw[:1], lr=0.004, betas=(0.8, 0.96), eps=1e-10, weight_decay=0.01),
              dict(kind="adamw", params=params_adamw[1:2], lr=0.2, betas=(0.8, 0.995), eps=1e-10, weight_decay=0.001),
              dict(kind="adamw", params=params_adamw[2:], lr=0.005, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)]
    for shape in sorted({p.shape for p in params_muon}):
        groups.append(dict(kind="muon", params=[p for p in params_muon if p.shape == shape], lr=0.02,
                           momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=0.2))
    return groups


def _muon_group_math(P, G, M, V, momentum, lr, wd, beta2):
    """The peer's fused Muon group step (fp32, stacked (k, m, n)), in place on P, M, V."""
    M.lerp_(G, 1 - momentum)
    X = G.lerp(M, momentum)
    target = X.norm(dim=(-2, -1), keepdim=True) / math.sqrt(X.shape[-2])
    X = X * (target / X.norm(dim=-1, keepdim=True).clamp_min(1e-6))
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    for a, b, c in NANOCHAT_POLAR_EXPRESS:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    X = X * (math.sqrt(min(X.shape[-2:])) / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6))
    dim = -1 if X.shape[-2] >= X.shape[-1] else -2
    V.lerp_(X.square().mean(dim=dim, keepdim=True), 1 - beta2)
    U = X * V.clamp_min(1e-10).rsqrt()
    U = U * (X.norm(dim=(-2, -1), keepdim=True) / U.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))
    P.sub_(lr * U + lr * wd * P * ((U * P) >= 0))


def _adamw_math(p, g, m, v, step, lr, beta1, beta2, eps, wd):
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.lerp_(g.square(), 1 - beta2)
    denom = (v / (1 - beta2**step)).sqrt() + eps
    p.sub_(lr / (1 - beta1**step) * m / denom)


class CompiledPeer:
    """The plain-PyTorch step, compiled once per shape (hyper-parameters as 0-dim tensors)."""

    def __init__(self, groups):
        self.groups = groups
        self.muon = torch.compile(_muon_group_math, fullgraph=True, dynamic=False)
        self.adamw = torch.compile(_adamw_math, fullgraph=True, dynamic=False)
        self.state = {}

    @torch.no_grad()
    def step(self):
        for gi, group in enumerate(self.groups):
            params = group["params"]
            if group["kind"] == "muon":
                m, n = params[0].shape
                st = self.state.setdefault(gi, dict(
                    M=torch.zeros(len(params), m, n), V=torch.zeros((len(params), m, 1) if m >= n else (len(params), 1, n))))
                P = torch.stack([p.detach() for p in params])
                G = torch.stack([p.grad for p in params])
                self.muon(P, G, st["M"], st["V"], torch.tensor(group["momentum"]),
                          torch.tensor(group["lr"] * max(1.0, m / n) ** 0.5), torch.tensor(group["weight_decay"]),
                          torch.tensor(group["beta2"]))
                torch._foreach_copy_([p.detach() for p in params], list(P.unbind(0)))
            else:
                for p in params:
                    st = self.state.setdefault(id(p), dict(m=torch.zeros_like(p), v=torch.zeros_like(p), t=0))
                    st["t"] += 1
                    b1, b2 = group["betas"]
                    self.adamw(p.detach(), p.grad, st["m"], st["v"], torch.tensor(float(st["t"])),
                               torch.tensor(group["lr"]), torch.tensor(b1), torch.tensor(b2), torch.tensor(group["eps"]),
                               torch.tensor(group["weight_decay"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results-md", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    muon_shapes, adamw_shapes = param_set(args.layers, args.width, args.vocab)
    shapes = muon_shapes + adamw_shapes
    base = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    ours_p = [torch.nn.Parameter(b.clone()) for b in base]
    peer_p = [torch.nn.Parameter(b.clone()) for b in base]
    k = len(muon_shapes)
    ours = MuonAdamW(groups_for(ours_p[:k], ours_p[k:]))
    peer = CompiledPeer(groups_for(peer_p[:k], peer_p[k:]))
    for ps in (ours_p, peer_p):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
    compile_start = time.perf_counter()
    peer.step()  # compiles
    compile_s = time.perf_counter() - compile_start
    ours.step()
    diff = max(float((a.detach() - b.detach()).norm() / (b.detach() - c).norm().clamp_min(1e-30))
               for a, b, c in zip(ours_p, peer_p, base))
    times = {"megatron-eopt": [], "compiled plain PyTorch": []}
    for _ in range(args.repeats):
        for name, opt in (("megatron-eopt", ours), ("compiled plain PyTorch", peer)):
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    info = env_info.collect(torch.device("cpu"))
    numel = sum(math.prod(s) for s in shapes)
    lines = [
        f"## nanochat MuonAdamW step, {info['device_name']} (cpu)",
        "",
        f"torch {torch.__version__}, commit `{info['git_commit']}`, {info['date_utc']}, {torch.get_num_threads()} "
        "threads; "
        f"`python benchmarks/nanochat_step.py --layers {args.layers} --width {args.width} --vocab {args.vocab}`: "
        f"{len(muon_shapes)} Muon matrices + {len(adamw_shapes)} AdamW tensors, {numel / 1e6:.1f}M parameters, fp32 "
        f"(nanochat's compute dtype on a CPU), medians of {args.repeats} interleaved steps. The peer's first "
        f"call (compilation) took {compile_s:.0f} s; rel. difference of the first step's parameter change "
        f"{diff:.1e}; load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| implementation | median ms | peer / ours |",
        "|---|---|---|",
        f"| megatron-eopt `MuonAdamW` | {med['megatron-eopt']:.1f} | 1.00x |",
        f"| compiled plain PyTorch | {med['compiled plain PyTorch']:.1f} | "
        f"{med['compiled plain PyTorch'] / med['megatron-eopt']:.2f}x |",
        "",
    ]
    text = "\n".join(lines)
    report.publish(text, args.results_md, "nanochat_muonadamw: cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
