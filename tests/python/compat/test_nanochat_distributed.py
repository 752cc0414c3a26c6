"""megatron_eopt.nanochat's distributed classes over gloo (1, 2, 3 ranks) against the float64
re-expression of nanochat's optimizers run on the averaged grads: the results on every rank, and
each rank's state in nanochat's layout (rank r holds rows [r·chunk, (r+1)·chunk) of the Muon
stacks, chunk = ceil(len / world); large AdamW params' state is the rank's row slice)."""

import pytest
import torch

from dist_harness import run_workers
from nanochat_reference import RefMuon2201, RefMuonAdamW, assert_fp32_close


def _run_workers(tmp_path, world, seed, kind):
    return run_workers("nanochat_worker.py", tmp_path, world, seed, kind, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind", ["distmuon", "muonadamw"])
def test_distributed_nanochat_matches_reference_and_layout(tmp_path, gen, world, kind):
    import nanochat_worker as worker

    if kind == "distmuon" and world == 1:
        pytest.skip("DistMuon on one rank is Muon (test_nanochat.py); MuonAdamW covers the one-rank path")
    seed = gen.initial_seed() % (2**31)
    results = _run_workers(tmp_path, world, seed, kind)

    params = worker.initial_params(seed, kind)
    start = [p.detach().clone() for p in params]
    ref = RefMuon2201(params, lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.2) if kind == "distmuon" \
        else RefMuonAdamW(worker.muonadamw_groups(params))
    all_grads = []
    for step in range(worker.STEPS):
        per_rank = [worker.grads(seed, r, step, kind) for r in range(world)]
        step_grads = [sum(g[i].double() for g in per_rank).float() / world for i in range(len(params))]
        all_grads.append(step_grads)
        for p, g in zip(params, step_grads):
            p.grad = g
        ref.step()

    for r, result in enumerate(results):
        assert_fp32_close(result["params"], params, start, all_grads, ref.ties)
        for i, p in enumerate(params):  # replicas: the same values on every rank
            assert torch.equal(result["params"][i], results[0]["params"][i]), (r, i)
        index = {id(p): i for i, p in enumerate(params)}
        for group in ref.param_groups:
            first = group["params"][0]
            if group.get("kind", "muon") == "muon":
                n = len(group["params"])
                chunk = (n + world - 1) // world
                lo, hi = min(r * chunk, n), min((r + 1) * chunk, n)
                mine = result["state"][index[id(first)]]
                for key in ("momentum_buffer", "second_momentum_buffer"):
                    got, full = mine[key], ref.state[first][key]
                    assert got.shape == (chunk, *full.shape[1:]), (r, key)
                    tol = 1e-5 if key == "momentum_buffer" else 1e-3
                    assert torch.allclose(got[: hi - lo], full[lo:hi], rtol=tol, atol=tol * full.abs().max()), (r, key)
                    assert torch.all(got[hi - lo :] == 0), (r, key)  # padding rows are never stepped
                assert all(index[id(p)] not in result["state"] for p in group["params"][1:])
            else:
                for p in group["params"]:
                    mine = result["state"][index[id(p)]]
                    full = ref.state[p]["exp_avg"]
                    if world > 1 and p.numel() >= 1024:
                        rows = p.shape[0] // world
                        full = full[r * rows : (r + 1) * rows]
                    assert mine["exp_avg"].shape == full.shape and mine["step"] == worker.STEPS
                    assert torch.allclose(mine["exp_avg"], full, rtol=1e-5, atol=1e-6), r
        if kind == "distmuon":
            assert [g["chunk_size"] for g in result["groups"]] == \
                [(len(g["params"]) + world - 1) // world for g in ref.param_groups]
