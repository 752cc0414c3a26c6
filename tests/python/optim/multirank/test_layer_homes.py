"""tp_mode "layer_sharded" over GTP x TP (gloo, CPU): every matrix orthogonalized once in the domain."""

import os

import pytest
import torch.multiprocessing as mp

import layer_homes_worker


@pytest.mark.distributed
def test_layer_sharded_homes_over_gtp_x_tp(tmp_path, gen):
    # 4 ranks, GTP 2 x TP 2: TP-sharded rows / columns with GTP rows (padded or not), TP-replicated
    # matrices (GTP-sharded or not) and a TP-only one equal the single-process optimizer (Muon,
    # ns_batch_size 2, AdaMuon), and step_stats() counts each matrix's Newton–Schulz once over the ranks.
    seed = gen.initial_seed() % (2**31)
    mp.spawn(layer_homes_worker.worker, args=(4, os.path.join(tmp_path, "rendezvous"), seed), nprocs=4, join=True)
