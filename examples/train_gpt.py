#!/usr/bin/env python3
"""Trains a small character-level GPT with megatron-eopt's Muon, against an all-AdamW baseline.

The text is the Python standard library's own sources (found through `sysconfig`), so the example
runs on any machine without downloads. Muon updates the 2-D hidden matrices of the transformer
blocks; AdamW updates the embeddings, the output head and the norms (the usual Muon recipe). The
baseline trains the same model from the same initialization on the same batches with AdamW alone.

At the end it prints both final losses, times one optimizer step of megatron-eopt's Muon against
Emerging-Optimizers' Muon (same hyper-parameters, same parameters and gradients), and saves the
loss curves to --out (PNG). A few minutes on a 2-core CPU with the defaults; uses a GPU when present.

    python examples/train_gpt.py [--steps 300] [--out train_gpt_loss.png] [--device cpu|cuda]
                                 [--state-dtype fp32|bf16|int8|fp8[,...]]

--state-dtype stores Muon's momentum in a low-memory format; a comma-separated list trains one
Muon run per state dtype (same initialization, same batches) and prints each final validation loss
with the bytes its Muon state takes.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
import sysconfig
import time
import typing

import torch
import torch.nn as nn
import torch.nn.functional as F

# Emerging-Optimizers 0.3.0 (timed against ours at the end) imports typing.override (Python >= 3.12).
if not hasattr(typing, "override"):
    try:
        import typing_extensions

        typing.override = typing_extensions.override
    except ImportError:
        pass

import megatron_eopt
from megatron_eopt.optim import Muon
from megatron_eopt.optim import state_bytes


# ------------------------------------------------------------------ data
def load_stdlib_text(max_bytes: int) -> tuple[bytes, bytes]:
    """(train, validation) text: this Python's standard-library .py files in a fixed order, every
    tenth file held out for validation, up to max_bytes in all. Generated code (the `encodings`
    tables) and the test suites are left out: they would make the losses meaningless."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py")))
    train, val, total = [], [], 0
    for path in files:
        top = os.path.relpath(path, root).split(os.sep)[0]
        if top in ("site-packages", "encodings") or top.startswith("test"):
            continue
        with open(path, "rb") as f:
            data = f.read()
        (val if (len(train) + len(val)) % 10 == 9 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    train_text, val_text = b"".join(train), b"".join(val)
    if len(train_text) < 100_000 or len(val_text) < 10_000:
        raise SystemExit(f"found too little Python source under {root} ({total} bytes)")
    return train_text, val_text


class Batches:
    """Random windows of a byte string (vocabulary: the 256 byte values), reproducible per seed."""

    def __init__(self, data: torch.Tensor, batch: int, block: int, seed: int, device: torch.device):
        self.data, self.batch, self.block, self.device = data, batch, block, device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.block - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[s : s + self.block] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + self.block] for s in starts.tolist()])
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


# ------------------------------------------------------------------ model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc_out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.norm2(x))))


class CharGPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, block: int, vocab: int = 256):
        super().__init__()
        self.tok_embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_embed(idx) + self.pos_embed(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ------------------------------------------------------------------ optimizers
def muon_kwargs(args) -> dict:
    """One Muon configuration (Emerging-Optimizers' constructor arguments, which megatron-eopt's
    Muon shares): Keller Jordan's recipe with decoupled weight decay and bf16 Newton–Schulz."""
    return dict(
        lr=args.muon_lr,
        momentum=0.95,
        nesterov=True,
        weight_decay=args.weight_decay,
        weight_decay_method="decoupled",
        fp32_matmul_prec="medium",
        coefficient_type="quintic",
        num_ns_steps=5,
        scale_mode="shape_scaling",
        extra_scale_factor=1.0,
    )


def build_run_optimizers(model: CharGPT, args, use_muon: bool, state_dtype: str = "fp32") -> list[torch.optim.Optimizer]:
    if use_muon:
        # megatron-eopt's routing: 2-D hidden matrices -> Muon; embeddings, head, norms -> AdamW.
        kw = dict(muon_kwargs(args), state_dtype=state_dtype)
        optimizers, table = megatron_eopt.build_optimizers(
            model,
            muon_lr=kw.pop("lr"),
            momentum=kw.pop("momentum"),
            nesterov=kw.pop("nesterov"),
            weight_decay=kw.pop("weight_decay"),
            adamw_lr=args.adam_lr,
            adamw_weight_decay=0.0,
            adamw_betas=(0.9, 0.95),
            muon_kwargs=kw,
        )
        routed = ", ".join(f"{opt}: {n} tensors / {numel / 1e6:.2f} M" for opt, (n, numel) in table.summary().items())
        print(f"parameter routing: {routed}")
        return optimizers
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.adam_lr, betas=(0.9, 0.95))]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ training
@torch.no_grad()
def evaluate(model, batches: Batches, n: int) -> float:
    model.eval()
    losses = [float(model(*batches.next())) for _ in range(n)]
    model.train()
    return sum(losses) / n


def train(label: str, use_muon: bool, args, train_data, val_data, device, state_dtype: str = "fp32") -> dict:
    torch.manual_seed(args.seed)  # same initialization for every run
    model = CharGPT(args.d_model, args.layers, args.heads, args.block_size).to(device)
    optimizers = build_run_optimizers(model, args, use_muon, state_dtype)
    # Linear warm-up, then linear decay to 10 %; every optimizer reads its groups' lr at each step.
    schedulers = megatron_eopt.build_schedulers(optimizers, args.warmup, args.steps, decay="linear", min_lr_ratio=0.1)
    batches = Batches(train_data, args.batch_size, args.block_size, args.seed + 1, device)
    val_batches_seed = args.seed + 2
    curve = {"step": [], "train": [], "val_step": [], "val": []}
    muon_step_ms = []
    start = time.perf_counter()
    for step in range(args.steps):
        loss = model(*batches.next())
        loss.backward()
        for opt in optimizers:
            if isinstance(opt, Muon):
                sync(device)
                t0 = time.perf_counter()
                opt.step()
                sync(device)
                muon_step_ms.append((time.perf_counter() - t0) * 1e3)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        curve["step"].append(step)
        curve["train"].append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = evaluate(model, Batches(val_data, args.batch_size, args.block_size, val_batches_seed, device),
                           args.eval_batches)
            curve["val_step"].append(step)
            curve["val"].append(val)
            recent = curve["train"][-args.eval_every:]
            elapsed = time.perf_counter() - start
            print(f"[{label}] step {step + 1:4d}/{args.steps}  train {sum(recent) / len(recent):.3f}  "
                  f"val {val:.3f}  ({elapsed / (step + 1):.2f} s/step)", flush=True)
    muon_state = sum(state_bytes(opt.state[p]) for opt in optimizers if isinstance(opt, Muon)
                     for group in opt.param_groups for p in group["params"] if p in opt.state)
    return {"label": label, "model": model, "curve": curve, "muon_step_ms": muon_step_ms,
            "seconds": time.perf_counter() - start, "muon_state_bytes": muon_state}


# ------------------------------------------------------------------ optimizer-step timing
def time_muon_steps(model: CharGPT, batches: Batches, args, device) -> dict[str, float | str]:
    """Median optimizer-step time of megatron-eopt's Muon and Emerging-Optimizers' Muon on the same
    matrices and gradients (each optimizer on its own copy of the parameters)."""
    results: dict[str, float | str] = {}
    candidates = {"megatron-eopt Muon": Muon}
    try:
        from emerging_optimizers.orthogonalized_optimizers import Muon as EOMuon

        candidates["Emerging-Optimizers Muon"] = EOMuon
    except Exception as exc:
        results["Emerging-Optimizers Muon"] = f"not available ({type(exc).__name__}: {exc})"

    model.zero_grad(set_to_none=True)
    model(*batches.next()).backward()
    source = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")]  # Muon's
    optimizers = {}
    for name, cls in candidates.items():
        params = [nn.Parameter(p.detach().clone()) for p in source]
        for p, s in zip(params, source):
            p.grad = s.grad.clone()
        opt = cls(params, **muon_kwargs(args))
        for _ in range(3):  # warm-up, lazy state
            opt.step()
        optimizers[name] = opt
    # Interleaved, one step of each in turn: a machine whose speed drifts affects both alike.
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.timing_repeats):
        for name, opt in optimizers.items():
            sync(device)
            t0 = time.perf_counter()
            opt.step()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    for name, samples in times.items():
        results[name] = statistics.median(samples)
    return results


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run, color in zip(runs, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        c = run["curve"]
        k = 10  # running mean of the training loss
        smooth = [sum(c["train"][max(0, i - k + 1) : i + 1]) / (i - max(0, i - k + 1) + 1) for i in range(len(c["train"]))]
        ax.plot(c["step"], smooth, color=color, alpha=0.6, label=f"{run['label']} train (mean of {k})")
        ax.plot(c["val_step"], c["val"], "o-", color=color, label=f"{run['label']} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("Character-level GPT on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--adam-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--data-mb", type=float, default=4.0, help="megabytes of standard-library source to use")
    p.add_argument("--timing-repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--out", default="train_gpt_loss.png", help="path of the loss-curve PNG")
    p.add_argument("--state-dtype", default="fp32",
                   help="Muon's state: fp32 | bf16 | int8 | fp8, or a comma-separated list (one Muon run each)")
    args = p.parse_args(argv)
    args.state_dtypes = [s.strip() for s in args.state_dtype.split(",") if s.strip()]
    for s in args.state_dtypes:
        if s not in megatron_eopt.low_memory_state.STATE_DTYPES:
            p.error(f"--state-dtype: {s!r} is not one of {', '.join(megatron_eopt.low_memory_state.STATE_DTYPES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    train_text, val_text = load_stdlib_text(int(args.data_mb * 2**20))
    train_data = torch.frombuffer(bytearray(train_text), dtype=torch.uint8).long()
    val_data = torch.frombuffer(bytearray(val_text), dtype=torch.uint8).long()
    n_params = sum(p.numel() for p in CharGPT(args.d_model, args.layers, args.heads, args.block_size).parameters())
    print(f"megatron-eopt {megatron_eopt.__version__} | torch {torch.__version__} | device {device} | "
          f"{(len(train_text) + len(val_text)) / 2**20:.1f} MiB of stdlib source | model {n_params / 1e6:.2f} M params | {args.steps} steps")

    runs = [train("Muon + AdamW" + ("" if sd == "fp32" and len(args.state_dtypes) == 1 else f" ({sd} state)"), True,
                  args, train_data, val_data, device, sd) for sd in args.state_dtypes]
    runs.append(train("AdamW", False, args, train_data, val_data, device))
    timing = time_muon_steps(runs[0]["model"], Batches(train_data, args.batch_size, args.block_size, 7, device),
                             args, device)
    plot(runs, args.out)

    print("\nfinal losses (validation, last evaluation):")
    for run in runs:
        state = f"   Muon state {run['muon_state_bytes'] / 2**20:.2f} MiB" if run["muon_state_bytes"] else ""
        print(f"  {run['label']:14s} val {run['curve']['val'][-1]:.4f}   train (last {args.eval_every}) "
              f"{statistics.mean(run['curve']['train'][-args.eval_every:]):.4f}   {run['seconds']:.0f} s{state}")
    if runs[0]["muon_step_ms"]:
        print("megatron-eopt Muon step inside the training loop (caches cold after forward/backward): "
              f"median {statistics.median(runs[0]['muon_step_ms']):.2f} ms")
    print("optimizer step on the hidden matrices, same hyper-parameters (bf16 Newton–Schulz, the default "
          f"precision; interleaved, median of {args.timing_repeats}):")
    ours = timing.get("megatron-eopt Muon")
    for name, value in timing.items():
        if isinstance(value, str):
            print(f"  {name:26s} {value}")
        else:
            ratio = f"  ({value / ours:.2f}x ours)" if name != "megatron-eopt Muon" and ours else ""
            print(f"  {name:26s} {value:8.2f} ms{ratio}")
    print(f"loss curves saved to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
