"""rank_checks="riding": the ranks' per-step agreement carried by a header in the step's first
exchange (multirank.riding, step.ride; docs/sharded.md "Riding on the first exchange").

On gloo ranks (riding_worker): a riding optimizer's steps equal bitwise those of one agreeing by an
all-reduce, with a learning rate scheduled every step, a gradient missing on every rank alike, the
workspace changed alike and a step one rank alone makes differ (both raise the same error there and
leave everything unchanged, low-memory state and its rounding seeds included); a riding step makes
one collective fewer. On the host: the header's round trip, what the ticket's key leaves out, the
state put back after a ride that fell back.
"""

import pytest
import torch

from dist_harness import run_workers
from megatron_eopt.optim import Muon
from megatron_eopt.optim.multirank import riding

STEADY = (1, 2, 6, 8)  # the worker's steps that ride (3 and 4 fall back alike; 5 and 7 raise)
RAISES = {5: "param_groups[0]['lr']", 7: "param_groups[0]['params'][2]"}  # (7: a grad missing on rank 1 alone)
SECONDS = ("seconds_in_step", "seconds_before_step")


@pytest.mark.distributed
@pytest.mark.parametrize("world, state_dtype", [(3, "fp32"), (3, "int8"), (2, "bf16")])
def test_riding_steps_equal_the_all_reduce_agreement(tmp_path, gen, world, state_dtype):
    _check_parity(run_workers("riding_worker.py", tmp_path, world, gen.initial_seed() % (2**31), state_dtype,
                              timeout=600), world, kept=["cpu"] * (2 if state_dtype in ("int8", "fp8") else 1))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL ranks)")
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_riding_steps_equal_the_all_reduce_agreement_over_nccl(tmp_path, gen, state_dtype):
    _check_parity(run_workers("riding_worker.py", tmp_path, 2, gen.initial_seed() % (2**31), f"{state_dtype},nccl",
                              timeout=600), 2, kept=[])


def _check_parity(records, world, kept):
    """``kept``: the devices of the host buffers riding keeps for its copy between steps (one per
    state dtype; none on a GPU)."""
    for rank, steps in enumerate(records):
        *steps, copied = steps
        assert copied == {"copied_ticket": False, "kept_copies": kept}, f"rank {rank}: {copied}"
        assert [r["step"] for r in steps] == list(range(9)), f"rank {rank}: steps missing"
        for r in steps:
            where = f"rank {rank}, step {r['step']}"
            assert r["equal"], f"{where}: parameters or state differ from the all-reduce agreement's"
            assert r["ticket"], f"{where}: no ticket after the step"
            if r["step"] in RAISES:  # rank 1 alone differs: both raise alike, naming the field
                every, ride = r["errors"]
                assert every is not None and every == ride and RAISES[r["step"]] in every, (where, every, ride)
                continue
            assert r["errors"] == [None, None], f"{where}: {r['errors']}"
            if r["step"] in STEADY:
                stats, every = r["stats"], r["every_stats"]
                assert stats["collectives"] == every["collectives"] - 1, f"{where}: {stats} / {every}"
                assert stats["agreements"] == 1 and stats["agreement_bytes"] == (world - 1) * riding.HEADER_WORDS * 8, \
                    f"{where}: {stats}"
            elif r["step"] == 0:  # (no ticket yet: an ordinary step, which makes one)
                assert r["stats"] == r["every_stats"] | {k: r["stats"][k] for k in SECONDS}, where
            else:  # (fell back alike: the ranks agreed over the ticket's group, then as an ordinary step)
                assert r["stats"]["collectives"] > r["every_stats"]["collectives"], where


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_header_round_trip(dtype):
    like = torch.empty(0, dtype=dtype)
    words = riding.header_elements(dtype)
    rows = [(0, 0, 2**55 + 3), (1, 1, 12345), (0, 1, 0)]
    segments = [torch.randn(n).to(dtype) for n in (5, 0, 2)]
    recv = torch.cat([t for seg, row in zip(segments, rows) for t in (seg, riding.header(*row, like))])
    started = riding._Started(None, recv, tuple(s.numel() for s in segments), words)
    assert started.headers() == rows
    for got, want in zip(started.payloads(), segments):
        assert torch.equal(got, want)


def test_ride_key_leaves_out_the_groups_values_only():
    fields = [("optimizer", "Muon"), ("nesterov", "True"), ("param_groups[0]['lr']", "0.02"),
              ("param_groups[0]['params'][0]", "(4, 4) torch.float32, grad torch.float32")]
    key = riding.ride_key(fields)
    lr = [f if f[0] != "param_groups[0]['lr']" else (f[0], "0.01") for f in fields]
    assert riding.ride_key(lr) == key
    for i in (1, 3):
        changed = list(fields)
        changed[i] = (fields[i][0], fields[i][1] + " ")
        assert riding.ride_key(changed) != key, fields[i][0]


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("stepped", [True, False], ids=["after a step", "no state yet"])
def test_first_chunk_state_is_put_back(gen, state_dtype, stepped):
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((8, 6), (5, 7))]
    opt = Muon(params, lr=0.02, state_dtype=state_dtype)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    if not stepped:  # (the step creates the state: putting it back removes it)
        saved = riding.FirstChunkState(opt, opt._current_plan(), [0, 1])
        opt.step()
        assert all(opt.state[p] for p in params)
        saved.restore()
        assert all(p not in opt.state for p in params)
        return
    opt.step()
    plan = opt._current_plan()
    members = list(range(len(plan.entries)))
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params}
    saved = riding.FirstChunkState(opt, plan, members)
    opt.step()
    assert any(not torch.equal(v, opt.state[p][k]) for p in params for k, v in before[id(p)].items())
    saved.restore()
    for p in params:
        for k, v in before[id(p)].items():
            assert torch.equal(v, opt.state[p][k]), k
