"""QK-clip (HybridMuon's rule and the Motif lineage's) and the Motif lineage on DTensor / FSDP2
parameters: Shard(0) rows split inside heads, uneven shards, 2 and 4 gloo ranks, each equal to the
same optimizer on the full tensors; bad qk_logits change nothing on any rank."""

import os

import pytest
import torch.multiprocessing as mp

import motif_worker


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_qk_clip_and_motif_on_sharded_params_equal_single_process(tmp_path, gen, world_size):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(motif_worker.worker, args=(world_size, os.path.join(tmp_path, "rendezvous"), seed), nprocs=world_size,
             join=True)
