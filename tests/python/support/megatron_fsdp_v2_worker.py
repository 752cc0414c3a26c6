"""One rank of the Megatron-FSDP v2 test (spawned by test_megatron_fsdp_v2.py, gloo on CPU, 2 ranks).

megatron-core's experimental Megatron-FSDP v2 (``fully_shard`` with all-Flat placements) builds its
sharded DTensor parameters on a CPU (its forward needs CUDA streams, so the gradients are set by
hand). Our Muon is built over them as the inner optimizer of Megatron-LM's ``FsdpMuon`` (PR #6425),
and this rank drives it through the calls FsdpMuon makes: ``num_ns_steps``, ``_init_group``, the
momentum state's local DTensor view, ``_apply_weight_decay_inplace``, ``nesterov``, the whole
matrix's ``orthogonalize`` on its owner alone (the parameter or None passed beside it) under
``fp32_matmul_prec``, ``pre_weight_update_fn_inplace`` / ``post_weight_update_fn_inplace``. The
gathers and the broadcast between ranks are the test's own. The result must equal our Muon stepping
the whole matrices in one process.
"""

from __future__ import annotations

import os
import sys
import typing

import torch
import torch.distributed as dist

if not hasattr(typing, "override"):  # megatron-core imports Emerging-Optimizers, which imports it (Python >= 3.12)
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt._precision import fp32_matmul_precision  # noqa: E402
from megatron_eopt.optim import Muon  # noqa: E402
from dist_harness import computing_as_the_ranks, gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

SHAPES = [(12, 8), (10, 12), (7, 10)]  # flat shards cut through the second matrix's rows
STEPS = 3
HYPER = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, num_ns_steps=5, coefficient_type="quintic",
             scale_mode="spectral", fp32_matmul_prec="highest", use_syrk=False)


def _whole(local: torch.Tensor, shape) -> torch.Tensor:
    """The whole matrix from every rank's rows (uneven: the test's own gather)."""
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, local.shape[0])
    most = max(counts)
    padded = torch.cat([local.reshape(-1, shape[1]), local.new_zeros(most - local.shape[0], shape[1])])
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def _my_rows(whole: torch.Tensor, local_rows: int) -> slice:
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, local_rows)
    start = sum(counts[: dist.get_rank()])
    return slice(start, start + local_rows)


def drive(inner: Muon, params, grads, pass_param: bool) -> None:
    """One step of the inner optimizer as FsdpMuon drives it."""
    group = inner.param_groups[0]
    settings = {k: v for k, v in group.items() if k != "params"}
    lr = group["lr"]
    for p, g in zip(params, grads):  # after the backward: every gradient set before the step
        p.grad = g
    inner._init_group(group)
    for i, p in enumerate(params):
        state = inner.state[p]
        momentum = state["momentum_buffer"].to_local()  # a DTensor, as FsdpMuon expects
        local_grad = p.grad.to_local().reshape(momentum.shape)
        p_local = p.to_local()
        inner._apply_weight_decay_inplace(p_local, local_grad, lr, group["weight_decay"])
        momentum.lerp_(local_grad, 1 - group["momentum"])
        pre = local_grad.lerp(momentum, group["momentum"]) if inner.nesterov else momentum
        whole = _whole(pre, p.shape)
        owner = i % dist.get_world_size()
        update = torch.empty(p.shape, dtype=torch.float32)
        if dist.get_rank() == owner:  # the owner alone: no collective may run inside
            with fp32_matmul_precision(inner.fp32_matmul_prec):
                update = inner.orthogonalize(p if pass_param else None, whole.to(torch.float32), **settings)
        dist.broadcast(update, src=owner)
        mine = update[_my_rows(update, p_local.shape[0] if p_local.dim() == 2 else p_local.numel() // p.shape[1])]
        mine = mine.reshape(p_local.shape).to(p_local.dtype)
        inner.pre_weight_update_fn_inplace(p_local, mine)
        p_local.add_(mine, alpha=-lr)
        inner.post_weight_update_fn_inplace(p_local)


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import Flat, Placements, fully_shard

        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(n, m, bias=False) for m, n in SHAPES])
        start = [layer.weight.detach().clone() for layer in model]
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model, mesh, Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()]))
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        rows = [p.to_local().shape[0] for p in params]
        spans = [0 < r < s[0] for r, s in zip(rows, SHAPES)]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, spans)
        assert any(any(s) for s in everyone), f"no matrix crosses the ranks' shards: {rows}"
        for p, w in zip(params, start):
            assert torch.equal(_whole(p.to_local().detach(), p.shape), w)

        gen = torch.Generator().manual_seed(seed + 1)
        grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
        for pass_param in (False, True):
            with torch.no_grad():
                for p, w in zip(params, start):
                    p.to_local().copy_(w[_my_rows(w, p.to_local().shape[0])])
            inner = Muon(params, **HYPER)
            # what FsdpMuon reads: the Newton–Schulz steps for its owner cost model, and the settings
            assert (inner.num_ns_steps, inner.coefficient_type, inner.nesterov, inner.fp32_matmul_prec,
                    inner.weight_decay_method) == (5, "quintic", True, "highest", "decoupled")
            with torch.no_grad():
                for step_grads in grads:
                    local = []
                    for p, g in zip(params, step_grads):
                        lg = g[_my_rows(g, p.to_local().shape[0])].clone()
                        local.append(DTensor.from_local(lg, p.device_mesh, p.placements, shape=p.shape,
                                                        stride=p.stride(), run_check=False))
                    drive(inner, params, local, pass_param)
            ref = [torch.nn.Parameter(w.clone()) for w in start]
            with computing_as_the_ranks():
                ref_opt = Muon(ref, **HYPER)
                for step_grads in grads:
                    for r, g in zip(ref, step_grads):
                        r.grad = g.clone()
                    ref_opt.step()
            for i, (p, r) in enumerate(zip(params, ref)):
                got = _whole(p.to_local().detach(), p.shape)
                err = (got - r.detach()).abs().max().item()
                assert err <= 1e-6, f"param {i} {SHAPES[i]} (orthogonalize given {'p' if pass_param else 'None'}): {err}"
