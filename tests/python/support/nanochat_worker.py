"""One rank of the distributed nanochat tests: python nanochat_worker.py RANK WORLD PORT SEED OUT KIND.

KIND is ``distmuon`` (megatron_eopt.nanochat.DistMuon, 22a71aa) or ``muonadamw`` (MuonAdamW with a
process group: ZeRO-2 sharding). Every rank starts from the same parameters and computes its own
grads per step (seeded by rank and step); the optimizer averages them. The rank saves its final
parameters and its state to OUT; then it saves its state_dict, loads it into a fresh optimizer on
copies of the parameters and checks that one more step of each gives bitwise the same values.
DistMuon's Newton–Schulz runs in fp32 here, so the test can hold it to the fp32 tolerance.
"""

import copy

import torch
import torch.distributed as dist
from dist_harness import init_from_argv
from worker_exit import exit_without_teardown

# Muon: runs of 1 to 5 same-shape matrices (chunks shorter than, equal to and longer than the
# world); AdamW: one large matrix sharded by rows (12 rows: 1, 2 and 3 ranks divide it), two small
MUON_SHAPES = [(8, 4)] * 5 + [(4, 8)] * 2 + [(6, 6)] + [(9, 5)] * 3
ADAMW_SHAPES = [(12, 96), (6,), (1,)]
STEPS = 3


def shapes(kind):
    return MUON_SHAPES if kind == "distmuon" else ADAMW_SHAPES + MUON_SHAPES


def initial_params(seed, kind):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in shapes(kind)]


def grads(seed, rank, step, kind):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 100 + step)
    return [torch.randn(s, generator=g) for s in shapes(kind)]


def muonadamw_groups(params):
    groups = [dict(kind="adamw", params=params[:3], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05)]
    muon = params[3:]
    for shape in sorted({p.shape for p in muon}):
        groups.append(dict(kind="muon", params=[p for p in muon if p.shape == shape], lr=0.02, momentum=0.95,
                           ns_steps=5, beta2=0.9, weight_decay=0.2))
    return groups


def build(kind, params):
    from megatron_eopt.nanochat import DistMuon, MuonAdamW

    if kind == "distmuon":
        opt = DistMuon(params, lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.2)
        opt._muon.precision = "highest"
        return opt
    return MuonAdamW(muonadamw_groups(params))


def run(opt, params, seed, rank, kind, steps):
    for step in steps:
        for p, g in zip(params, grads(seed, rank, step, kind)):
            p.grad = g
        opt.step()


def main():
    rank, world, seed, out, kind = init_from_argv()
    params = initial_params(seed, kind)
    opt = build(kind, params)
    run(opt, params, seed, rank, kind, range(STEPS))
    result = {"params": [p.detach().clone() for p in params],
              "state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
                        for i, p in enumerate(params) if opt.state[p]},
              "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]}
    # a checkpoint of this rank, loaded on the same rank, continues bitwise
    saved = copy.deepcopy(opt.state_dict())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = build(kind, copies)
    resumed.load_state_dict(saved)
    run(opt, params, seed, rank, kind, [STEPS])
    run(resumed, copies, seed, rank, kind, [STEPS])
    assert all(torch.equal(p, q) for p, q in zip(params, copies)), "a resumed run differs"
    torch.save(result, out)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
