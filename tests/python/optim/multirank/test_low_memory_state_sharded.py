"""Low-memory optimizer state on DTensor (FSDP2 Shard(0)) parameters: the step equals the unsharded
fp32 step on the dequantized state, block scales shard with their rows, DCP reshards them 2 -> 4
ranks bit for bit; gloo on CPU."""

import os

import pytest
import torch.multiprocessing as mp

import low_memory_sharded_worker


@pytest.mark.distributed
def test_sharded_low_memory_state_on_4_ranks(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(low_memory_sharded_worker.worker, args=(4, os.path.join(tmp_path, "rendezvous"), seed), nprocs=4,
             join=True)
