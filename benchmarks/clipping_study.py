#!/usr/bin/env python3
"""Which gradient-clipping policy suits Muon + AdamW: the measurement behind ``clip_grad_norm_``'s default.

    python benchmarks/clipping_study.py --out-json clipping.json --plot docs/clipping.png [--quick]

Four settings, all at ``max_norm=1.0``, with the demo's optimizers (``examples/train_gpt.py``:
``megatron_eopt.build_optimizers``, megatron-eopt's ``Muon`` on the hidden matrices, AdamW on the
embeddings, the head and the norms): no clip, torch's global clip, ``policy="adamw"`` and
``policy="separate"`` of :func:`megatron_eopt.clip_grad_norm_`.

(a) Huge gradient norm: the demo GPT trained with its loss multiplied by ``--loss-scale``, a
    stand-in for a model whose gradient norm is 1e4..1e6 or more (Megatron-LM issue #5394). Both
    optimizers are scale-invariant, so without a clip the run matches the unscaled one; a global
    clip multiplies every gradient by about 1 / loss-scale.
(a2) One layer's gradients ``--imbalance`` times the others' (what #5394 describes: GatedDeltaNet
    layers dwarfing the rest): a clip by a norm that includes that layer shrinks every other
    gradient by ~1 / imbalance. Muon with Megatron-LM's ns_eps 1e-7 and with this package's 1e-15.
(b) One gradient spike: an unscaled run whose gradients are multiplied by ``--spike`` at one step
    (before clipping), against the same run without the spike (same state up to that step, same
    batches after it): the loss excess and the cosine between the two runs' updates.
(c) DeepSpeed issue #8439's table: four square matrices, one Muon step, lr 0.02, with and without
    a global clip of 1.0, applied to the gradient before Newton–Schulz (torch's and Megatron's
    order, ours) and to the orthogonalized update (DeepSpeed's order, emulated).

Every run of a part starts from the same initialization and sees the same batches. ``--quick`` is
a smoke run of the same code on a tiny model (the tests run it); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import train_gpt as demo  # noqa: E402  (the demo's data, model and optimizers, not a copy of them)

import megatron_eopt as me  # noqa: E402
from megatron_eopt.newton_schulz import NS_EPS  # noqa: E402  (Muon's default ns_eps, which the demo keeps)

POLICIES = ("none", "global", "adamw", "separate")
MAX_NORM = 1.0
SCHEMA = "megatron-eopt-benchmarks/clipping-study/1"

# The demo's model at width 192 and block 64 (its defaults: 256, 128): ~0.1 s a step on one core of
# the 2-core CPU this was written on, so the 18 training runs of (a), (a2) and (b) (1960 steps)
# take about three and a half minutes, (c) under a minute. The spike comes at step 80 of 160, after the warm-up, with 80 steps left
# for Muon's momentum (0.95: a spike 50x the EMA's usual size decays to it in ~76 steps) to forget
# it. --quick: a model small enough for a test; its figures mean nothing.
SIZES = {
    "full": dict(d_model=192, layers=4, heads=6, block_size=64, batch_size=8, steps=160, spike_step=80, eval_every=40,
                 eval_batches=8, data_mb=2.0, widths=(128, 512, 2048, 4096), imbalanced_steps=60),
    "quick": dict(d_model=32, layers=1, heads=2, block_size=16, batch_size=2, steps=10, spike_step=4, eval_every=5,
                  eval_batches=2, data_mb=0.5, widths=(32, 64), imbalanced_steps=6),
}


# ------------------------------------------------------------------ the demo, set up once
def demo_args(size: dict, seed: int) -> argparse.Namespace:
    """The demo's hyper-parameters (its parse_args defaults: Muon lr 0.02, AdamW lr 3e-3, weight
    decay 0.01, 20 warm-up steps) with this study's model and batch sizes."""
    args = demo.parse_args([])
    for key in ("d_model", "layers", "heads", "block_size", "batch_size", "steps", "eval_batches", "data_mb"):
        setattr(args, key, size[key])
    args.warmup = min(args.warmup, max(1, size["steps"] // 8))
    args.seed = seed
    return args


def load_data(args) -> tuple[list, list]:
    """(training batches, validation batches): drawn once, so every run sees the same ones."""
    train_text, val_text = demo.load_stdlib_text(int(args.data_mb * 2**20))
    as_tensor = lambda text: torch.frombuffer(bytearray(text), dtype=torch.uint8).long()  # noqa: E731
    cpu = torch.device("cpu")
    train = demo.Batches(as_tensor(train_text), args.batch_size, args.block_size, args.seed + 1, cpu)
    val = demo.Batches(as_tensor(val_text), args.batch_size, args.block_size, args.seed + 2, cpu)
    return [train.next() for _ in range(args.steps)], [val.next() for _ in range(args.eval_batches)]


class Run:
    """One training run: the demo's model, its Muon + AdamW pair and their lr schedules."""

    def __init__(self, args, init_state: dict, total_steps: int, ns_eps: float | None = None):
        self.model = demo.CharGPT(args.d_model, args.layers, args.heads, args.block_size)
        self.model.load_state_dict(init_state)
        with contextlib.redirect_stdout(io.StringIO()):  # the demo prints its routing table
            self.optimizers = demo.build_run_optimizers(self.model, args, use_muon=True)
        if ns_eps is not None:  # the same Muon (one group, the demo's arguments) with another eps
            muon = next(o for o in self.optimizers if isinstance(o, me.optim.Muon))
            kwargs = dict(demo.muon_kwargs(args), ns_eps=ns_eps)
            self.optimizers[self.optimizers.index(muon)] = me.optim.Muon(muon.param_groups[0]["params"], **kwargs)
        self.schedulers = me.build_schedulers(
            self.optimizers, args.warmup, total_steps, decay="linear", min_lr_ratio=0.1
        )
        self.muon_opt = next(o for o in self.optimizers if isinstance(o, me.optim.Muon))
        params = lambda opt: [p for group in opt.param_groups for p in group["params"]]  # noqa: E731
        self.muon = params(self.muon_opt)
        self.adamw = [p for opt in self.optimizers if opt is not self.muon_opt for p in params(opt)]

    def branch(self, args, total_steps: int) -> Run:
        """A second run in this run's exact state (weights, momenta, schedules)."""
        other = Run(args, self.model.state_dict(), total_steps)
        for mine, theirs in zip(self.optimizers + self.schedulers, other.optimizers + other.schedulers):
            theirs.load_state_dict(copy.deepcopy(mine.state_dict()))
        return other

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        self.model.eval()
        loss = statistics.fmean(float(self.model(x, y)) for x, y in batches)
        self.model.train()
        return loss


def norm(tensors: list[torch.Tensor]) -> float:
    return (
        float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))) if tensors else 0.0
    )


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def train_step(
    run: Run,
    batch,
    policy: str,
    loss_scale: float = 1.0,
    grad_multiplier: float = 1.0,
    keep_updates: bool = False,
    imbalance: tuple[torch.Tensor, float] | None = None,
) -> dict:
    """One step: loss × loss_scale backward, gradients × grad_multiplier (the spike), one matrix's
    gradient × imbalance[1] (the layer whose gradients dwarf the others'), the policy's clip, both
    optimizer steps. Records the unscaled loss, the gradient norms before the clip, the
    smallest Muon matrix gradient norm after it, the update RMS of each part, and Muon's count of
    Newton–Schulz inputs below its eps."""
    loss = run.model(*batch)
    (loss * loss_scale).backward()
    if grad_multiplier != 1.0:
        for p in run.muon + run.adamw:
            p.grad.mul_(grad_multiplier)
    if imbalance is not None:
        imbalance[0].grad.mul_(imbalance[1])
    muon_grads, adamw_grads = [p.grad for p in run.muon], [p.grad for p in run.adamw]
    rec = {
        "loss": loss.item(),
        "grad_norm": norm(muon_grads + adamw_grads),
        "muon_grad_norm": norm(muon_grads),
        "adamw_grad_norm": norm(adamw_grads),
    }
    if policy != "none":
        total = me.clip_grad_norm_(run.optimizers, MAX_NORM, policy=policy)
        assert math.isclose(float(total), rec["grad_norm"], rel_tol=1e-3), (float(total), rec["grad_norm"])
    rec["min_muon_matrix_grad_after_clip"] = min(float(torch.linalg.vector_norm(g)) for g in muon_grads)
    before = [p.detach().clone() for p in run.muon + run.adamw]
    for opt in run.optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    for scheduler in run.schedulers:
        scheduler.step()
    deltas = [p.detach() - b for p, b in zip(run.muon + run.adamw, before)]
    muon_delta, adamw_delta = flat(deltas[: len(run.muon)]), flat(deltas[len(run.muon) :])
    rec["muon_update_rms"] = float(muon_delta.square().mean().sqrt())
    rec["adamw_update_rms"] = float(adamw_delta.square().mean().sqrt())
    below = run.muon_opt.ns_inputs_below_eps
    rec["ns_inputs_below_eps"] = 0 if below is None else int(below)
    # The Newton–Schulz input is the (Nesterov-mixed) momentum: its smallest per-matrix norm is how
    # far the run stays from the eps where orthogonalization degenerates.
    rec["min_muon_momentum_norm"] = min(
        float(torch.linalg.vector_norm(run.muon_opt.state[p]["momentum_buffer"])) for p in run.muon
    )
    if keep_updates:
        rec["muon_delta"], rec["adamw_delta"] = muon_delta, adamw_delta
    return rec


def scalar_records(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not isinstance(v, torch.Tensor)} for r in records]


def tail_mean(values: list[float], n: int) -> float:
    return statistics.fmean(values[-n:])


# ------------------------------------------------------------------ (a) huge gradient norm
def part_a(args, init_state, train_batches, val_batches, loss_scale: float, eval_every: int) -> dict:
    """Each policy trains the whole schedule on the scaled loss; val losses are of the plain loss."""
    out = {"loss_scale": loss_scale, "steps": args.steps, "policies": {}}
    for policy in POLICIES:
        start = time.perf_counter()
        run = Run(args, init_state, args.steps)
        records, val = [], {"step": [], "loss": []}
        for step, batch in enumerate(train_batches):
            records.append(train_step(run, batch, policy, loss_scale=loss_scale))
            if (step + 1) % eval_every == 0 or step + 1 == args.steps:
                val["step"].append(step + 1)
                val["loss"].append(run.evaluate(val_batches))
        out["policies"][policy] = summarize_a(records, val, time.perf_counter() - start)
        s = out["policies"][policy]
        print(
            f"(a) x{loss_scale:.0e} {policy:9s} train {s['final_train_loss']:.3f}  val {s['final_val_loss']:.3f}  "
            f"grad norm {s['median_grad_norm']:.3g}  Muon update RMS {s['median_muon_update_rms']:.3g}  "
            f"below eps {s['ns_inputs_below_eps_total']}  ({s['seconds']:.0f} s)",
            flush=True,
        )
    return out


# ------------------------------------------------------------------ (a2) one layer's gradients dwarf the rest
def part_a2(args, init_state, train_batches, val_batches, matrix: str, factor: float, steps: int) -> dict:
    """Megatron-LM #5394's actual condition: not a large norm everywhere (which (a) shows every
    policy survives) but one layer's gradients ``factor`` times the others'. A clip by a norm that
    includes that layer multiplies every other gradient by ~1/factor: the other Muon matrices'
    Newton–Schulz inputs fall below ns_eps when 1/factor is small enough, AdamW's gradients below
    its eps (1e-8). Muon with Megatron-LM's / Emerging-Optimizers 0.3.0's ns_eps=1e-7 and with
    this package's default; the eps only matters to the policies that clip Muon's gradients."""
    out = {"matrix": matrix, "factor": factor, "steps": steps, "policies": {}}
    for policy in POLICIES:
        out["policies"][policy] = {}
        for ns_eps in (1e-7, NS_EPS) if policy in ("global", "separate") else (1e-7,):
            start = time.perf_counter()
            run = Run(args, init_state, steps, ns_eps=ns_eps)
            big = dict(run.model.named_parameters())[matrix]
            records = [train_step(run, b, policy, imbalance=(big, factor)) for b in train_batches[:steps]]
            val = {"step": [steps], "loss": [run.evaluate(val_batches)]}
            s = out["policies"][policy][f"{ns_eps:g}"] = summarize_a(records, val, time.perf_counter() - start)
            print(
                f"(a2) {matrix} x{factor:.0e} {policy:9s} ns_eps {ns_eps:g}  train {s['final_train_loss']:.3f}  "
                f"val {s['final_val_loss']:.3f}  Muon update RMS {s['median_muon_update_rms']:.3g}  AdamW "
                f"update RMS {s['median_adamw_update_rms']:.3g}  below eps {s['ns_inputs_below_eps_total']}  "
                f"({s['seconds']:.0f} s)",
                flush=True,
            )
    return out


def summarize_a(records: list[dict], val: dict, seconds: float) -> dict:
    col = lambda key: [r[key] for r in records]  # noqa: E731
    n = max(1, len(records) // 8)
    return {
        "final_train_loss": tail_mean(col("loss"), n),
        "final_val_loss": val["loss"][-1],
        "median_grad_norm": statistics.median(col("grad_norm")),
        "median_muon_grad_norm": statistics.median(col("muon_grad_norm")),
        "median_adamw_grad_norm": statistics.median(col("adamw_grad_norm")),
        "median_muon_update_rms": statistics.median(col("muon_update_rms")),
        "median_adamw_update_rms": statistics.median(col("adamw_update_rms")),
        "ns_inputs_below_eps_total": sum(col("ns_inputs_below_eps")),
        "min_muon_matrix_grad_after_clip": min(col("min_muon_matrix_grad_after_clip")),
        "min_muon_momentum_norm": min(col("min_muon_momentum_norm")),
        "train_loss": col("loss"),
        "grad_norm": col("grad_norm"),
        "muon_update_rms": col("muon_update_rms"),
        "adamw_update_rms": col("adamw_update_rms"),
        "val": val,
        "seconds": seconds,
    }


# ------------------------------------------------------------------ (b) one gradient spike
def part_b(args, init_state, train_batches, val_batches, spike_step: int, spike: float) -> dict:
    """Per policy: a run to the spike step, then two runs in lockstep from the same state, one whose
    gradients are multiplied by ``spike`` at that step; same batches, compared step by step."""
    out = {"spike_step": spike_step, "spike": spike, "steps": args.steps, "policies": {}}
    for policy in POLICIES:
        start = time.perf_counter()
        ref = Run(args, init_state, args.steps)
        before = [train_step(ref, b, policy) for b in train_batches[:spike_step]]
        spiked = ref.branch(args, args.steps)
        after_ref, after_spk = [], []
        for step in range(spike_step, args.steps):
            batch = train_batches[step]
            after_ref.append(train_step(ref, batch, policy, keep_updates=True))
            after_spk.append(
                train_step(
                    spiked, batch, policy, keep_updates=True, grad_multiplier=spike if step == spike_step else 1.0
                )
            )
        out["policies"][policy] = summarize_b(
            before,
            after_ref,
            after_spk,
            ref.evaluate(val_batches),
            spiked.evaluate(val_batches),
            time.perf_counter() - start,
        )
        s = {k: float("nan") if v is None else v for k, v in out["policies"][policy].items()}
        print(
            f"(b) {policy:9s} spike grad norm {s['spike_grad_norm']:.3g}  loss excess next 10 "
            f"{s['loss_excess_next_10']:+.3f}  rest {s['loss_excess_rest']:+.3f}  val excess "
            f"{s['val_excess']:+.3f}  Muon cos next 10 {s['muon_cos_next_10']:.2f}  AdamW cos next 10 "
            f"{s['adamw_cos_next_10']:.2f}  ({s['seconds']:.0f} s)",
            flush=True,
        )
    return out


def summarize_b(
    before: list[dict], ref: list[dict], spk: list[dict], ref_val: float, spk_val: float, seconds: float
) -> dict:
    """Paired differences after the spike. Index 0 is the spike step itself: its loss was computed
    before any update, so the excess starts at index 1; its update is the spiked gradient's."""
    excess = [s["loss"] - r["loss"] for r, s in zip(ref, spk)]
    muon_cos = [cosine(r["muon_delta"], s["muon_delta"]) for r, s in zip(ref, spk)]
    adamw_cos = [cosine(r["adamw_delta"], s["adamw_delta"]) for r, s in zip(ref, spk)]
    adamw_ratio = [s["adamw_update_rms"] / r["adamw_update_rms"] for r, s in zip(ref, spk)]
    recovered = next((i for i, c in enumerate(muon_cos) if i > 0 and c > 0.9), None)
    return {
        "spike_grad_norm": spk[0]["grad_norm"],
        "grad_norm_before_spike": statistics.median(r["grad_norm"] for r in before[-10:]) if before else None,
        "loss_excess_next_10": statistics.fmean(excess[1:11]),
        "loss_excess_rest": statistics.fmean(excess[11:]) if len(excess) > 11 else None,
        "val_loss_ref": ref_val,
        "val_loss_spiked": spk_val,
        "val_excess": spk_val - ref_val,
        "muon_cos_spike_step": muon_cos[0],
        "muon_cos_next_10": statistics.fmean(muon_cos[1:11]),
        "muon_cos_rest": statistics.fmean(muon_cos[11:]) if len(muon_cos) > 11 else None,
        "muon_steps_until_cos_above_0.9": recovered,
        "adamw_cos_next_10": statistics.fmean(adamw_cos[1:11]),
        "adamw_update_rms_ratio_next_10": statistics.fmean(adamw_ratio[1:11]),
        "ref_train_loss": [r["loss"] for r in before + ref],
        "spiked_train_loss": [r["loss"] for r in before + spk],
        "loss_excess": excess,
        "muon_cos": muon_cos,
        "adamw_cos": adamw_cos,
        "seconds": seconds,
    }


# ------------------------------------------------------------------ (c) DeepSpeed issue #8439's table
def part_c(widths, seed: int, lr: float = 0.02) -> dict:
    """Four n×n matrices, one Muon step (build_optimizers' Muon: lr 0.02, no weight decay), the same
    seeded Gaussian gradient in every column of a row. |Δw| is the Frobenius norm of the four
    matrices' change together. The DeepSpeed order clips Muon's update, not the gradient: its
    "grad norm" is the norm of the orthogonalized update, emulated here from the unclipped step's
    change (update = Δw / lr, clipped to norm 1, times lr), as DeepSpeed's clip does after Muon."""
    rows = []
    for n in widths:
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        weights = [torch.randn(n, n, generator=gen) / math.sqrt(n) for _ in range(4)]
        grads = [torch.randn(n, n, generator=gen) for _ in range(4)]
        unclipped = muon_step_change(weights, grads, lr, clip=False)
        clipped_grad = muon_step_change(weights, grads, lr, clip=True)
        update_norm = norm(unclipped["delta"]) / lr  # what DeepSpeed's clip measures
        ds_coef = min(1.0, MAX_NORM / (update_norm + 1e-6))
        row = {
            "width": n,
            "grad_norm": unclipped["grad_norm"],
            "dw_no_clip": norm(unclipped["delta"]),
            "dw_clip_gradient": norm(clipped_grad["delta"]),
            "clip_gradient_max_rel_diff": max(
                float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a))
                for a, b in zip(unclipped["delta"], clipped_grad["delta"])
            ),
            "deepspeed_reported_grad_norm": update_norm,
            "dw_clip_update": norm(unclipped["delta"]) * ds_coef,
            "seconds": time.perf_counter() - start,
        }
        row["attenuation_clip_gradient"] = row["dw_no_clip"] / row["dw_clip_gradient"]
        row["attenuation_clip_update"] = row["dw_no_clip"] / row["dw_clip_update"]
        rows.append(row)
        print(
            f"(c) {n:5d}  grad norm {row['grad_norm']:.4g}  |dw| no clip {row['dw_no_clip']:.5f}  "
            f"clip grad {row['dw_clip_gradient']:.5f} ({row['attenuation_clip_gradient']:.2f}x)  clip update "
            f"{row['dw_clip_update']:.5f} ({row['attenuation_clip_update']:.2f}x, DeepSpeed reports "
            f"{update_norm:.4g})  ({row['seconds']:.1f} s)",
            flush=True,
        )
    return {"lr": lr, "rows": rows}


def muon_step_change(weights, grads, lr: float, clip: bool) -> dict:
    layers = torch.nn.Sequential(*[torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights])
    with torch.no_grad():
        for layer, w, g in zip(layers, weights, grads):
            layer.weight.copy_(w)
            layer.weight.grad = g.clone()
    optimizers, _ = me.build_optimizers(layers, muon_lr=lr)  # every square matrix is Muon's
    grad_norm = me.clip_grad_norm_(optimizers, MAX_NORM if clip else math.inf, policy="global")
    for opt in optimizers:
        opt.step()
    return {"grad_norm": float(grad_norm), "delta": [layer.weight.detach() - w for layer, w in zip(layers, weights)]}


# ------------------------------------------------------------------ plot and main
def smooth(values: list[float], k: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(POLICIES, ("tab:gray", "tab:red", "tab:blue", "tab:green")))
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    plot_a(axes[0, 0], doc, colors)
    plot_a2(axes[0, 1], axes[0, 2], doc["a2_imbalanced"], colors)
    plot_b(axes[1, 0], axes[1, 1], doc["b_spike"], colors)
    plot_c(axes[1, 2], doc["c_deepspeed_table"]["rows"])
    fig.suptitle(f"Gradient clipping with Muon + AdamW ({doc['environment']['cpu']}, {doc['mode']})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _titled(ax, legend: dict, **labels) -> None:
    """Sets an axes' title and labels (``ax.set``) and draws its legend."""
    ax.set(**labels)
    ax.legend(**legend)


def plot_a(ax, doc: dict, colors: dict) -> None:
    a = doc["a_huge_grad_norm"]
    for policy, s in a["policies"].items():
        ax.plot(
            range(1, len(s["train_loss"]) + 1),
            smooth(s["train_loss"], 10),
            color=colors[policy],
            label=f"{policy} (train, mean of 10)",
        )
        ax.plot(s["val"]["step"], s["val"]["loss"], "o", color=colors[policy])
    ref = doc["b_spike"]["policies"]["none"]["ref_train_loss"]
    ax.plot(range(1, len(ref) + 1), smooth(ref, 10), ":", color="black", label="unscaled loss, no clip")
    _titled(ax, dict(fontsize=8),
        title=f"(a) loss × {a['loss_scale']:.0e}: unscaled loss (dots: validation)",
        xlabel="step",
        ylabel="cross-entropy",
    )


def plot_a2(ax_loss, ax_rms, a2: dict, colors: dict) -> None:
    for policy, runs in a2["policies"].items():
        for eps, s in runs.items():
            style = "-" if eps == "1e-07" else "--"
            label = f"{policy}, ns_eps {eps}"
            steps = range(1, len(s["train_loss"]) + 1)
            ax_loss.plot(steps, smooth(s["train_loss"], 5), style, color=colors[policy], label=label)
            ax_rms.plot(steps, s["muon_update_rms"], style, color=colors[policy], label=f"{label}: Muon")
            ax_rms.plot(steps, s["adamw_update_rms"], ":", color=colors[policy], lw=0.8)
    _titled(ax_loss, dict(fontsize=7),
        title=f"(a2) {a2['matrix']}'s gradient × {a2['factor']:.0e}: train loss (mean of 5)",
        xlabel="step",
        ylabel="cross-entropy",
    )
    _titled(ax_rms, dict(fontsize=7),
        yscale="log",
        title="(a2) update RMS per step (solid/dashed: Muon, dotted: AdamW)",
        xlabel="step",
        ylabel="RMS of the parameter change",
    )


def plot_b(ax_loss, ax_cos, b: dict, colors: dict) -> None:
    k = b["spike_step"]
    for policy, s in b["policies"].items():
        steps = range(k + 1, k + 1 + len(s["loss_excess"]))
        ax_loss.plot(steps, smooth(s["loss_excess"], 5), color=colors[policy], label=policy)
        ax_cos.plot(steps, s["muon_cos"], color=colors[policy], label=f"{policy}: Muon")
        ax_cos.plot(steps, s["adamw_cos"], ":", color=colors[policy], label=f"{policy}: AdamW")
    ax_loss.axhline(0, color="black", lw=0.5)
    _titled(ax_loss, dict(fontsize=8),
        title=f"(b) gradients × {b['spike']:.0e} at step {k + 1}: loss excess over the unspiked run",
        xlabel="step",
        ylabel="train loss, spiked − unspiked (mean of 5)",
    )
    _titled(ax_cos, dict(fontsize=7, ncol=2),
        title="(b) cosine of each step's update, spiked vs unspiked run",
        xlabel="step",
        ylabel="cosine",
        ylim=(-0.1, 1.05),
    )


def plot_c(ax, rows: list[dict]) -> None:
    widths = [r["width"] for r in rows]
    for key, style, color, label in (
        ("dw_no_clip", "o-", "tab:gray", "no clip"),
        ("dw_clip_gradient", "x--", "tab:blue", "clip 1.0 on the gradient (torch / Megatron / ours)"),
        ("dw_clip_update", "s-", "tab:red", "clip 1.0 on the orthogonalized update (DeepSpeed)"),
    ):
        ax.plot(widths, [r[key] for r in rows], style, color=color, label=label)
    ax.set(
        xscale="log",
        yscale="log",
        title="(c) one Muon step, four square matrices, lr 0.02",
        xlabel="width",
        ylabel="|Δw|",
    )
    ax.set_xticks(widths, [str(w) for w in widths], minor=False)
    ax.minorticks_off()
    ax.legend(fontsize=8)


def environment() -> dict:
    cpu = platform.processor() or platform.machine()
    flags = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    break
    except OSError:
        pass
    notable = [f for f in flags if f.startswith(("avx512_bf16", "amx", "avx2", "avx512f"))]
    return {
        "cpu": cpu,
        "cpu_flags": notable,
        "cpus": os.cpu_count(),
        "default_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "megatron_eopt": me.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-json", required=True)
    p.add_argument("--plot", default=None, help="path of the PNG (none if omitted)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds)")
    p.add_argument("--loss-scale", type=float, default=1e5, help="(a): the loss multiplier")
    p.add_argument("--imbalance", type=float, default=1e9, help="(a2): the one matrix's gradient multiplier")
    p.add_argument("--imbalanced-matrix", default="blocks.0.fc.weight", help="(a2): the matrix")
    p.add_argument("--spike", type=float, default=1e3, help="(b): the gradient multiplier at the spike step")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="(c): the matrix widths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train-threads",
        type=int,
        default=1,
        help="torch threads for (a) and (b): their ops are small, and on a shared 2-core machine a "
        "second thread mostly waits for a descheduled peer (5 ms per op); (c) uses the default",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    mode = "quick" if opts.quick else "full"
    size = SIZES[mode]
    torch.manual_seed(opts.seed)
    args = demo_args(size, opts.seed)
    train_batches, val_batches = load_data(args)
    torch.manual_seed(opts.seed)
    init_state = copy.deepcopy(demo.CharGPT(args.d_model, args.layers, args.heads, args.block_size).state_dict())
    start = time.perf_counter()
    env = dict(environment(), train_threads=opts.train_threads)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(opts.train_threads)
    doc = {
        "schema": SCHEMA,
        "mode": mode,
        "max_norm": MAX_NORM,
        "policies": list(POLICIES),
        "environment": env,
        "model": {k: size[k] for k in ("d_model", "layers", "heads", "block_size", "batch_size")},
        "hyper": {
            "muon_lr": args.muon_lr,
            "adamw_lr": args.adam_lr,
            "weight_decay": args.weight_decay,
            "warmup": args.warmup,
            "ns_eps": NS_EPS,
        },
    }
    doc["a_huge_grad_norm"] = part_a(args, init_state, train_batches, val_batches, opts.loss_scale, size["eval_every"])
    doc["a2_imbalanced"] = part_a2(
        args, init_state, train_batches, val_batches, opts.imbalanced_matrix, opts.imbalance, size["imbalanced_steps"]
    )
    doc["b_spike"] = part_b(args, init_state, train_batches, val_batches, size["spike_step"], opts.spike)
    torch.set_num_threads(default_threads)
    doc["c_deepspeed_table"] = part_c(opts.widths or size["widths"], opts.seed)
    doc["seconds"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(opts.out_json)), exist_ok=True)
    with open(opts.out_json, "w") as f:
        json.dump(doc, f, indent=1)
    if opts.plot:
        plot(doc, opts.plot)
    print(f"{doc['seconds']:.0f} s; wrote {opts.out_json}" + (f" and {opts.plot}" if opts.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
