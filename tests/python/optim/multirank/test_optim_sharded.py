"""DTensor parameters (FSDP2 Shard(0) with uneven shards, Shard(1), Replicate, 2-D meshes, MoE experts)
step exactly like the unsharded optimizer, in owner and gather mode (docs/design.md §5); gloo on CPU."""

import os

import pytest
import torch.multiprocessing as mp

import sharded_qkv_worker
import sharded_worker


@pytest.mark.distributed
def test_dtensor_params_match_unsharded_on_1_2_and_4_ranks(tmp_path, gen):
    # One spawn of 4 ranks covers meshes of 4, 2 x 2, 2 and 1 ranks.
    seed = gen.initial_seed() % (2**31)
    mp.spawn(sharded_worker.worker, args=(4, os.path.join(tmp_path, "rendezvous"), seed), nprocs=4, join=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp2_and_dtensor_params_on_a_world_of_1_and_2_processes(tmp_path, gen, world_size):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(sharded_worker.small_worker, args=(world_size, os.path.join(tmp_path, "rendezvous"), seed),
             nprocs=world_size, join=True)


@pytest.mark.distributed
def test_hsdp_x_tp_and_pipeline_stage_meshes_of_8_processes_run_owner_mode(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(sharded_worker.hsdp_tp_worker, args=(8, os.path.join(tmp_path, "rendezvous"), seed), nprocs=8,
             join=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_qkv_split_on_dtensor_shards_matches_the_whole_projection(tmp_path, gen, world_size):
    """A fused QKV projection sharded over 2 or 4 ranks (rows cutting through query groups, or
    columns) steps as the whole projection does: per-part orthogonalization and scales, for Muon and
    the adaptive variants, in owner and gather mode."""
    seed = gen.initial_seed() % (2**31)
    mp.spawn(sharded_qkv_worker.worker, args=(world_size, os.path.join(tmp_path, "rendezvous"), seed),
             nprocs=world_size, join=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_options_refusals_and_below_eps_count(tmp_path, gen, world_size):
    """Two and four ranks: the step's options (recipe, weight decay, scale modes, coefficients, chunking,
    per-head splits) equal the whole tensors' step; weight-update hooks, an orthogonalize() override
    and a tensor-parallel layout on a matrix sharded across ranks are a ValueError before anything
    changes (and step on replicated DTensors); ns_inputs_below_eps counts a sharded matrix on its
    owner (once over the ranks)."""
    import sharded_limits_worker

    seed = gen.initial_seed() % (2**31)
    mp.spawn(sharded_limits_worker.worker, args=(world_size, os.path.join(tmp_path, "rendezvous"), seed),
             nprocs=world_size, join=True)
