"""Sharded steps on randomly drawn layouts equal the unsharded optimizer (docs/design.md §9).

Each run draws (seeded; the seed is printed, ``MEGATRON_EOPT_TEST_SEED`` replays it) meshes of 2
and 4 gloo ranks, placements per mesh dim with uneven and empty shards, nd modes, workspace budgets,
sharded modes and optimizers with their options (randomized_layout_worker); every case is compared
with the unsharded optimizer, params and state. Cases that the ranks would once have cut into
different chunks (a hang), or whose NorMuon / NAMO state sat in the wrong rows, are among them.
"""

import os

import pytest
import torch.multiprocessing as mp

import randomized_layout_worker

CASES = 24  # about 40 s on two cores


@pytest.mark.distributed
def test_random_layouts_step_as_the_unsharded_optimizer(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(randomized_layout_worker.worker, args=(4, os.path.join(tmp_path, "rendezvous"), seed, CASES),
             nprocs=4, join=True)
