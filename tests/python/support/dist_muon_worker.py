"""One rank of the DistMuon test: python dist_muon_worker.py RANK WORLD PORT SEED OUT CASE.

Every rank starts from the same parameters, computes its own grads each step (seeded by rank
and step), runs DistMuon and, on copies of the same parameters, nanochat's DistMuon algorithm
written out in plain PyTorch (round-robin reduce-scatter of each run of world-size same-shape
params, owner step, all-gather). It saves both final parameters, which parameters it owns and
the Newton–Schulz FLOPs of what it stepped and the momentum of what it owns to OUT.

Then checkpoints cross in both directions between DistMuon and nanochat's DistMuon of 4ddc803
(re-expressed here as a class with its state layout: groups by sorted shape, each with a
``zero_buffer``; keys lr, momentum, nesterov, ns_steps; momentum on the owner only): each side
steps twice, its per-rank state_dict is loaded by the other side on the same rank, and both take
one more step on the same grads. A case ending in ``_balanced`` runs DistMuon with
``owners="balanced"`` and skips the crossing (its owners are not nanochat's).
"""

import copy
import warnings

import torch
import torch.distributed as dist
from dist_harness import init_from_argv
from optim_helpers import clone_params, run_steps
from worker_exit import exit_without_teardown

CASES = {
    # nanochat-sized: runs of same-shape params shorter and longer than the world, a conv filter
    "basic": [(8, 4)] * 3 + [(4, 8)] * 2 + [(5, 5)] + [(16, 2, 3, 1)],
    # many shapes, uneven counts per shape (1 to 5), 1 x n and n x 1, a large matrix whose cost
    # dwarfs the others: a round-robin owner per shape run would leave the ranks unbalanced
    "many": [(64, 48)] * 3 + [(48, 64)] + [(8, 8)] * 5 + [(33, 17)] * 2 + [(17, 33)] + [(1, 24)] + [(24, 1)]
    + [(6, 2, 3, 3)] + [(96, 96)] * 3,
    # fp32 and bf16 params: one exchange per dtype
    "mixed": [(16, 8)] * 3 + [(8, 16)] * 2 + [(12, 12)],
}
CASES["many_balanced"] = CASES["many"]
BF16 = {"mixed": {3, 4, 5}}  # indices of bf16 params per case
STEPS = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 0.1


def _dtype(case, i):
    return torch.bfloat16 if i in BF16.get(case, ()) else torch.float32


def initial_params(seed, case):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(_dtype(case, i))) for i, s in enumerate(CASES[case])]


def grads(seed, rank, step, case):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 100 + step)
    return [torch.randn(s, generator=g).to(_dtype(case, i)) for i, s in enumerate(CASES[case])]


def nanochat_dist_muon_step(params, states, lr, momentum, weight_decay, zeropower, nesterov=True, ns_steps=5):
    """nanochat's DistMuon.step: params grouped by shape (sorted), each run of world-size params
    reduce-scattered with AVG (rank r gets the r-th), the owner steps it, all-gather shares it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for shape in sorted({tuple(p.shape) for p in params}):
        group = [p for p in params if tuple(p.shape) == shape]
        zero = torch.zeros_like(group[0])
        for base in range(0, len(group), world):
            run = group[base : base + world]
            inputs = [p.grad for p in run] + [zero] * (world - len(run))
            mine = base + rank
            output = run[rank].grad.clone() if mine < len(group) else torch.empty_like(zero)
            dist.reduce_scatter(output, inputs, op=dist.ReduceOp.AVG)
            if mine < len(group):
                p, g = run[rank], output
                buf = states.setdefault(p, torch.zeros_like(p))
                buf.lerp_(g, 1 - momentum)
                g = g.lerp(buf, momentum) if nesterov else buf
                update = zeropower(g.view(len(g), -1), ns_steps).float().view(p.shape)
                p.data.mul_(1 - lr * weight_decay)
                p.data.add_(update, alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)
            outputs = [p.data for p in run] + [torch.empty_like(zero) for _ in range(world - len(run))]
            source = run[rank].data if mine < len(group) else zero
            dist.all_gather(outputs, source.clone())


class NanochatDistMuon(torch.optim.Optimizer):
    """nanochat's DistMuon (4ddc803) re-expressed: the same groups, keys, owners and state."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, zeropower=None):
        params = list(params)
        groups = []
        for shape in sorted({tuple(p.shape) for p in params}):
            members = [p for p in params if tuple(p.shape) == shape]
            groups.append(dict(params=members, zero_buffer=torch.zeros_like(members[0].detach())))
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        self.zeropower = zeropower

    @torch.no_grad()
    def step(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            params, zero = group["params"], group["zero_buffer"]
            for base in range(0, len(params), world):
                run = params[base : base + world]
                inputs = [p.grad for p in run] + [zero] * (world - len(run))
                mine = base + rank
                grad = torch.empty_like(zero)
                dist.reduce_scatter(grad, inputs, op=dist.ReduceOp.AVG)
                if mine < len(params):
                    p = params[mine]
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(grad, 1 - group["momentum"])
                    g = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                    update = self.zeropower(g.view(len(g), -1), group["ns_steps"]).float().view(p.shape)
                    p.add_(update.to(p.dtype), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                outputs = [p.data for p in run] + [torch.empty_like(zero) for _ in range(world - len(run))]
                dist.all_gather(outputs, (params[mine].data if mine < len(params) else zero).clone())


def cross_checkpoints(seed, case, rank, world, DistMuon, zeropower):
    """Both directions: 2 steps on one side, its state_dict into the other, 1 more step on both."""
    out = {}
    for direction in ("ours_to_nanochat", "nanochat_to_ours"):
        params = initial_params(seed, case)
        first = DistMuon(params, lr=LR, momentum=MOMENTUM) if direction == "ours_to_nanochat" else \
            NanochatDistMuon(params, lr=LR, momentum=MOMENTUM, zeropower=zeropower)
        for step in range(2):
            run_steps(first, params, [grads(seed, rank, step, case)])
        saved = copy.deepcopy(first.state_dict())  # as if written to disk by this rank
        other = clone_params(params)
        second = NanochatDistMuon(other, lr=0.5, momentum=0.5, zeropower=zeropower) \
            if direction == "ours_to_nanochat" else DistMuon(other, lr=0.5, momentum=0.5)
        second.load_state_dict(saved)  # hyper-parameters and momentum come from the checkpoint
        indices = [i for g in saved["param_groups"] for i in g["params"]]
        held = [p for g in second.param_groups for p in g["params"]]
        assert any(saved["state"].get(i) for i in indices), "nothing owned on this rank to carry over"
        for i, p in zip(indices, held):  # every momentum arrives on the same parameter, unchanged
            if "momentum_buffer" in saved["state"].get(i, {}):
                assert torch.equal(second.state[p]["momentum_buffer"], saved["state"][i]["momentum_buffer"].to(p.dtype))
            else:
                assert "momentum_buffer" not in second.state[p]
        last = grads(seed, rank, 2, case)
        start = [p.detach().clone() for p in params]
        run_steps(first, params, [last])
        run_steps(second, other, [last])
        out[direction] = dict(start=start, first=[p.detach() for p in params], second=[p.detach() for p in other])
        if direction == "ours_to_nanochat" and world > 1:
            # another rank's checkpoint holds momentum this rank does not own: refused, not dropped
            theirs = [saved if rank == 0 else None]
            dist.broadcast_object_list(theirs, src=0)
            if rank != 0:
                try:
                    DistMuon(clone_params(params), lr=LR).load_state_dict(theirs[0])
                except ValueError as e:
                    assert "cannot follow its parameter" in str(e), e
                else:
                    raise AssertionError("rank 0's checkpoint loaded on another rank")
    return out


def main():
    rank, world, seed, out, case = init_from_argv()
    from megatron_eopt.muon import DistMuon, zeropower_via_newtonschulz5
    from megatron_eopt.optim.multirank.owner_exchange import ns_flops

    params = initial_params(seed, case)
    nanochat = initial_params(seed, case)
    if world > 1:  # a process group without this rank is named in the error
        others = dist.new_group([0])
        if rank != 0:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    DistMuon(params, process_group=others)
            except ValueError as e:
                assert "process_group" in str(e), e
            else:
                raise AssertionError("DistMuon accepted a process_group without this rank")
    nanochat_states = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        balanced = case.endswith("_balanced")
        opt = DistMuon(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                       owners="balanced" if balanced else "nanochat")
        lr = LR
        for step in range(STEPS):
            step_grads = grads(seed, rank, step, case)
            for p, q, g in zip(params, nanochat, step_grads):
                p.grad, q.grad = g, g.clone()
            before = [g.clone() for g in step_grads]
            opt.step()
            # the step reads the grads and leaves them as they were
            assert all(torch.equal(p.grad, g) for p, g in zip(params, before))
            nanochat_dist_muon_step(nanochat, nanochat_states, lr, MOMENTUM, WEIGHT_DECAY, zeropower_via_newtonschulz5)
            for group in opt.param_groups:
                group["lr"] *= 0.5  # a schedule: read at every step
            lr *= 0.5
    owned = [i for i, p in enumerate(params) if "momentum_buffer" in opt.state[p]]
    assert owned == [i for i, p in enumerate(params) if opt.owner_of(p) == rank], "momentum off its owner"
    flops = sum(ns_flops((p.shape[0], p.numel() // p.shape[0])) for p in (params[i] for i in owned))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        crossed = {} if balanced else cross_checkpoints(seed, case, rank, world, DistMuon, zeropower_via_newtonschulz5)
    torch.save({"params": [p.detach() for p in params], "nanochat": [p.detach() for p in nanochat],
                "owned": owned, "flops": flops, "crossed": crossed,
                "momentum": {i: opt.state[params[i]]["momentum_buffer"] for i in owned}}, out)
    dist.destroy_process_group()
    exit_without_teardown()  # everything is checked and saved


if __name__ == "__main__":
    main()
