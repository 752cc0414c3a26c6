"""One rank of the QK-clip / Motif-lineage DTensor tests (spawned by test_motif_sharded.py, gloo on
CPU).

Every rank builds the same full tensors and gradients (one seed), shards the parameters the way
FSDP2 does (Shard(0) over the world; with 2 and 4 ranks the q / k rows split inside heads and the
shards are uneven), steps the optimizer on the DTensors with QK-clip, and compares with the same
optimizer stepping the full tensors in this process; a real FSDP2 model (``fully_shard``, forward,
backward) does the same with reduce-scattered gradients.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.compat.motif import MotifMuon  # noqa: E402
from megatron_eopt.optim import HybridMuon  # noqa: E402
from motif_reference import clip_row_factors  # noqa: E402
from reference import rel_err  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

HEAD_DIM, HIDDEN = 5, 7
# name -> shape: layer 0 MHA (3 heads: 15 rows), layer 1 GQA (4 query heads, 2 kv heads),
# an expert tensor, a dense matrix, a norm (AdamW).
SHAPES = {
    "model.layers.0.attn.wq.weight": (3 * HEAD_DIM, HIDDEN),
    "model.layers.0.attn.wk.weight": (3 * HEAD_DIM, HIDDEN),
    "model.layers.1.attn.wq.weight": (4 * HEAD_DIM, HIDDEN),
    "model.layers.1.attn.wk.weight": (2 * HEAD_DIM, HIDDEN),
    "model.layers.1.moe.experts": (3, 6, HIDDEN),
    "model.layers.1.attn.wo.weight": (HIDDEN, 4 * HEAD_DIM),
    "model.norm.weight": (HIDDEN,),
}
STEPS = 2
MOTIF_CLIP = {"q_indices": [2, 0, 1], "k_indices": [0, 0, 1, 1], "head_dim": HEAD_DIM, "threshold": 4.0}
HYBRID_CLIP = {"threshold": 4.0, "head_dim": HEAD_DIM}


def _tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=gen) * 0.3 for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(STEPS)]
    # Per-head maxima around the threshold: some heads clip, some do not.
    logits = [{0: torch.rand(4, generator=gen) * 8, 1: torch.rand(4, generator=gen) * 8} for _ in range(STEPS)]
    return full, grads, logits


def _for(motif: bool, logits):
    """Motif reads the first len(indices) values; HybridMuon takes one value per query head."""
    return logits if motif else {0: logits[0][:3], 1: logits[1]}


def _groups(params, motif: bool):
    names = [n for n in SHAPES if n != "model.norm.weight" and (motif or "experts" not in n)]
    muon = {"params": [params[n] for n in names], "names": names, "use_muon": True}
    adamw = {"params": [params["model.norm.weight"]], "use_muon": False}
    if motif:
        adamw.update(adamw_betas=(0.8, 0.9), adamw_eps=1e-6)
    return [muon, adamw]


def _build(cls, params, motif):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if motif:
            return cls(_groups(params, True), lr=0.02, momentum=0.9, weight_decay=0.1, clip_config=MOTIF_CLIP,
                       expert_keys=["experts"])
        return cls(_groups(params, False), lr=0.02, momentum=0.9, weight_decay=0.1, clip_config=HYBRID_CLIP,
                   fp32_matmul_prec="highest", nesterov=True)


def check(world, seed, motif: bool, tol: float):
    full, grads, logits = _tensors(seed)
    used = [n for n in SHAPES if motif or "experts" not in n]
    params = {n: torch.nn.Parameter(distribute_tensor(full[n], world, [Shard(0)], src_data_rank=None)) for n in used}
    ref = {n: torch.nn.Parameter(full[n].clone()) for n in used}
    cls = MotifMuon if motif else HybridMuon
    opt, ref_opt = _build(cls, params, motif), _build(cls, ref, motif)
    label = f"{cls.__name__} on {world.size()} ranks"
    clipped = 0
    for step in range(STEPS):
        for n in used:
            params[n].grad = distribute_tensor(grads[step][n], world, [Shard(0)], src_data_rank=None)
            ref[n].grad = grads[step][n].clone()
        step_logits = _for(motif, logits[step])
        opt.step(qk_logits=step_logits)
        ref_opt.step(qk_logits=step_logits)
        for n in used:
            got, want = params[n].full_tensor(), ref[n].detach()
            assert rel_err(got, want) <= tol, f"{label} step {step} {n}: rel err {rel_err(got, want):.2e}"
            if ".wq." in n or ".wk." in n:  # count the rows the clip scaled, so the test exercises it
                layer = int(n.split(".")[2])
                if motif:
                    kind = "q" if ".wq." in n else "k"
                    clipped += int((clip_row_factors(SHAPES[n][0], kind, False, step_logits[layer],
                                                     MOTIF_CLIP) < 1).sum())
                else:
                    clipped += int((step_logits[layer] > HYBRID_CLIP["threshold"]).sum())
        for n in used:
            for key, value in ref_opt.state[ref[n]].items():
                mine = opt.state[params[n]][key]
                mine = mine.full_tensor() if isinstance(mine, DTensor) else mine
                assert rel_err(mine, value) <= tol, f"{label} step {step} {n} state {key}"
        if motif:  # none_grad: the sharded Muon params' grads are dropped, AdamW's and plain ones kept
            assert all(params[n].grad is None for n in used if n != "model.norm.weight"), label
            assert params["model.norm.weight"].grad is not None, label
            assert all(ref[n].grad is not None for n in used), label
    assert clipped > 0, f"{label}: no head ran past the threshold, QK-clip was not exercised"


def check_bad_logits_change_nothing(world, seed, motif: bool):
    full, grads, logits = _tensors(seed)
    used = [n for n in SHAPES if motif or "experts" not in n]
    params = {n: torch.nn.Parameter(distribute_tensor(full[n], world, [Shard(0)], src_data_rank=None)) for n in used}
    opt = _build(MotifMuon if motif else HybridMuon, params, motif)
    for n in used:
        params[n].grad = distribute_tensor(grads[0][n], world, [Shard(0)], src_data_rank=None)
    bad = {0: _for(motif, logits[0])[0]}  # layer 1 missing (Motif) / of the wrong length (HybridMuon)
    if not motif:
        bad[1] = torch.ones(5)
    try:
        opt.step(qk_logits=bad)
    except ValueError:
        pass
    else:
        raise AssertionError("bad qk_logits were accepted")
    for n in used:
        assert torch.equal(params[n].to_local(), distribute_tensor(full[n], world, [Shard(0)]).to_local()), n
    assert len(opt.state) == 0


def check_replicated_logits(world, seed):
    """Logits handed over as a DTensor (tensor-parallel models) are read as the full vector."""
    full, grads, logits = _tensors(seed)
    a = {n: torch.nn.Parameter(distribute_tensor(full[n], world, [Shard(0)], src_data_rank=None)) for n in SHAPES}
    b = {n: torch.nn.Parameter(distribute_tensor(full[n], world, [Shard(0)], src_data_rank=None)) for n in SHAPES}
    opt_a, opt_b = _build(MotifMuon, a, True), _build(MotifMuon, b, True)
    for n in SHAPES:
        a[n].grad = distribute_tensor(grads[0][n], world, [Shard(0)], src_data_rank=None)
        b[n].grad = distribute_tensor(grads[0][n], world, [Shard(0)], src_data_rank=None)
    opt_a.step(qk_logits=logits[0])
    opt_b.step(qk_logits={k: distribute_tensor(v, world, [Replicate()]) for k, v in logits[0].items()})
    assert all(torch.equal(a[n].to_local(), b[n].to_local()) for n in SHAPES)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.wq = torch.nn.Linear(HIDDEN, 3 * HEAD_DIM, bias=False)  # 15 rows: heads cut by the shards
        self.attn.wk = torch.nn.Linear(HIDDEN, 3 * HEAD_DIM, bias=False)
        self.attn.wo = torch.nn.Linear(3 * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, h):
        return h + self.attn.wo(self.attn.wq(h) * self.attn.wk(h))


class _Net(torch.nn.Module):
    """Motif-style names: model.layers.0.attn.wq.weight, ..., model.norm.weight / bias."""

    def __init__(self, seed):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Block()])
        self.model.norm = torch.nn.LayerNorm(HIDDEN)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x):
        for block in self.model.layers:
            x = block(x)
        return self.model.norm(x)


def check_fsdp2(world, seed, motif: bool):
    """A real FSDP2 model (fully_shard, forward, backward, reduce-scattered grads) stepped with
    QK-clip, against the same optimizer on the full tensors with the same grads."""
    from torch.distributed.fsdp import fully_shard

    model = _Net(seed)
    for block in model.model.layers:
        fully_shard(block, mesh=world)
    fully_shard(model, mesh=world)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    ref = [torch.nn.Parameter(p.full_tensor()) for p in params]

    def groups(ps):
        muon = [i for i, n in enumerate(names) if ps[i].ndim == 2]
        rest = [i for i in range(len(names)) if i not in muon]
        return [{"params": [ps[i] for i in muon], "names": [names[i] for i in muon], "use_muon": True},
                {"params": [ps[i] for i in rest], "use_muon": False}]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if motif:
            opt, ref_opt = (MotifMuon(groups(ps), lr=0.02, momentum=0.9, clip_config=MOTIF_CLIP)
                            for ps in (params, ref))
        else:
            opt, ref_opt = (HybridMuon(groups(ps), lr=0.02, momentum=0.9, weight_decay=0.1, clip_config=HYBRID_CLIP,
                                       fp32_matmul_prec="highest") for ps in (params, ref))
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    label = f"FSDP2 {type(opt).__name__} on {world.size()} ranks"
    for step in range(STEPS):
        model(torch.randn(3, HIDDEN, generator=gen)).square().mean().backward()
        for p, r in zip(params, ref):
            r.grad = p.grad.full_tensor()
        # The same logits on every rank; some heads past the threshold.
        logits = {0: torch.tensor([6.0, 3.0, 9.0, 5.0]) if motif else torch.tensor([6.0, 3.0, 9.0])}
        opt.step(qk_logits=logits)
        ref_opt.step(qk_logits=logits)
        opt.zero_grad()
        for n, p, r in zip(names, params, ref):
            err = rel_err(p.full_tensor(), r.detach())
            assert err <= 1e-6, f"{label} step {step} {n}: rel err {err:.2e}"
            r.data.copy_(p.full_tensor())


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        world = init_device_mesh("cpu", (world_size,))
        check(world, seed, motif=False, tol=1e-6)  # fp32 "highest": the sharded step is the unsharded one
        check(world, seed, motif=True, tol=1e-6)
        check_bad_logits_change_nothing(world, seed, motif=False)
        check_bad_logits_change_nothing(world, seed, motif=True)
        check_replicated_logits(world, seed)
        check_fsdp2(world, seed, motif=False)
        check_fsdp2(world, seed, motif=True)
