"""tp_mode "distributed" with the Gram iteration at TP 2 (gloo, CPU) equals the fused op on the
unsharded matrices (docs/design.md §4.9, §4.4)."""

import os

import pytest
import torch.multiprocessing as mp

import dist_gram_worker


@pytest.mark.distributed
def test_distributed_gram_matches_the_fused_op(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(dist_gram_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous"), seed), nprocs=2, join=True)
