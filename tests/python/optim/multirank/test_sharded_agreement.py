"""Every rank takes the same path (docs/design.md §9): chunks cut alike with uneven shards, refusals
and plan mismatches raised on every rank before any collective, clipping over mixed meshes
(rank_agreement_worker); two gloo ranks."""

import os

import pytest
import torch.multiprocessing as mp

import rank_agreement_worker


@pytest.mark.distributed
def test_ranks_agree_on_chunks_refusals_and_plans(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(rank_agreement_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous"), seed), nprocs=2,
             join=True)
