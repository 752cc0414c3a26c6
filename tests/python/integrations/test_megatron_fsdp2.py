"""megatron-core's own FSDP2 wrapper (``TorchFullyShardedDataParallel``) with our optimizers through
``get_megatron_optimizer`` and ``install()``, on gloo ranks (CPU): the parameters after 3 steps equal
those of Megatron's DistributedDataParallel with the same optimizer (muon and adaptive_muon, fp32 and
bf16, muon_split_qkv on and off; NorMuon's and NAMO's second moments), and a torch.distributed.checkpoint
(DCP) of the module and the optimizer resumes exactly. The cases, the tolerances and why: megatron_fsdp2_worker.py.

Megatron's own torch_dist checkpointing (``sharded_state_dict``) does not work under FSDP2 on torch
2.14, for its own optimizers as for ours: it matches optimizer parameters to the model's sharded
tensors by ``id(param.to_local())``, and torch 2.14's ``to_local()`` of a ``Parameter(DTensor)`` is a
fresh view each call ("Param id 0 does not match any model sharded param"). Under install() it is a
ValueError that names torch_dcp instead (checked on two ranks). Muon-aware clipping (install()'s
"adamw" policy) under FSDP2 equals DDP's (clip_grad=1e-3, on two ranks).
"""

import os

import pytest
import torch

import megatron_cpu
from paths import BENCHMARKS

mcore_optimizer = megatron_cpu.megatron_optimizer_module()

pytestmark = [
    pytest.mark.skipif(mcore_optimizer is None, reason="megatron-core is not installed"),
    pytest.mark.distributed,
]


def _seed(gen):
    return int(torch.randint(0, 2**20, (1,), generator=gen))


def _spawn(worker, world_size, tmp_path, *args):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world_size, os.path.join(str(tmp_path), "rendezvous"), *args), nprocs=world_size, join=True)


def test_fsdp2_matches_megatron_ddp_and_resumes_from_dcp_on_two_ranks(tmp_path, gen):
    """Every case of megatron_fsdp2_worker.CASES against Megatron DDP, then the DCP resumes of
    CHECKPOINT_CASES (muon fp32, adaptive_muon bf16, NorMuon fp32); one spawn of 2 ranks for all."""
    import megatron_fsdp2_worker as worker

    ckpt_root = tmp_path / "checkpoints"
    ckpt_root.mkdir()
    _spawn(worker.two_rank_worker, 2, tmp_path, str(ckpt_root), _seed(gen))


def test_fsdp2_matches_megatron_ddp_on_four_ranks(tmp_path, gen):
    """Four ranks, every rank the same batch (megatron_fsdp2_worker's docstring says why): muon in fp32
    and adaptive_muon in bf16, QKV split on (the rows of a query group over two ranks)."""
    import megatron_fsdp2_worker as worker

    _spawn(worker.four_rank_worker, 4, tmp_path, _seed(gen))


def test_communication_benchmark_ours_moves_each_matrix_once_per_direction(tmp_path):
    """benchmarks/megatron_fsdp2_comm.py on 2 ranks: our Muon member's step communicates in
    all-to-alls, one there and one back per chunk of matrices (besides the ranks' agreement before
    the step, one all-reduce of 40 bytes), and all ranks together send at most
    twice the Muon matrices' bytes (on 2 ranks exactly once: each matrix's other half goes to its
    owner and comes back)."""
    import json
    import subprocess
    import sys

    script = os.path.join(BENCHMARKS, "megatron_fsdp2_comm.py")
    out = tmp_path / "comm.json"
    proc = subprocess.run(
        [sys.executable, script, "--ranks", "2", "--steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 2 | ours | muon |" in proc.stdout, proc.stdout
    (report,) = json.loads(out.read_text())["results"]
    ours = report["impls"]["ours"]
    assert ours["class"].startswith("megatron_eopt."), ours["class"]
    muon = ours["per_step"]["muon"]
    # the all-to-alls, and the ranks' agreement before the step: one all-reduce of five int64
    assert set(muon) == {"all_to_all", "all_reduce"}, muon
    assert muon["all_reduce"]["count"] == 1 and muon["all_reduce"]["input_bytes"] == 40, muon
    assert muon["all_to_all"]["count"] % 2 == 0, muon
    sent_by_all = muon["all_to_all"]["sent_bytes"] * report["ranks"]
    assert sent_by_all == ours["muon_matrix_bytes"], (sent_by_all, ours["muon_matrix_bytes"])
    assert ours["owner_bytes_sent_per_step"] == muon["all_to_all"]["sent_bytes"], ours
    assert "adam" not in ours["per_step"]  # Adam steps its shards without communication
