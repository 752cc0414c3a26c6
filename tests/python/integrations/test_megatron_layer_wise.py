"""megatron-eopt inside Megatron-LM's layer-wise distributed optimizer (``dist_muon``): its
checkpoints round-trip as Megatron's own do, on 1, 2 and 4 gloo ranks (CPU): alone (torch_dist
and torch formats, resharding from TP = 2 x DP = 2 to TP = 1 x DP = 4) and chained with Megatron's
DistributedOptimizer for Adam (dp_reshardable and fully_reshardable sharding; the Muon member
alone in the torch format).

The checks are those of Megatron-LM's dist_checkpointing tests for this optimizer (save / load
and the common-state-dict comparisons), re-expressed in megatron_layer_wise_worker.py and
megatron_hybrid_worker.py.
"""

import os

import pytest
import torch

import megatron_cpu  # noqa: E402

mcore_optimizer = megatron_cpu.megatron_optimizer_module()

pytestmark = pytest.mark.skipif(mcore_optimizer is None, reason="megatron-core is not installed")


def _needs_emerging_optimizers(cases):
    """Cases with a stock side need Megatron's own TensorParallelMuon (emerging-optimizers)."""
    if not all(source and target for _, source, target in cases) and not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("the cross-loads need Megatron's own TensorParallelMuon (emerging-optimizers)")


def _seed(gen):
    """A fresh base seed for a test's models and data (from the gen fixture, which prints its seed)."""
    return int(torch.randint(0, 2**20, (1,), generator=gen))


def test_layer_wise_checkpoints_on_one_rank(tmp_path, gen):
    """Every case (ours into ours for muon and adaptive_muon, stock into ours, ours into stock),
    torch_dist and torch formats, in this process on a one-rank gloo group."""
    import megatron_layer_wise_worker as lw

    _needs_emerging_optimizers(lw.CASES)
    megatron_cpu.on_single_rank(lw.run_cases, lw.CASES, str(tmp_path), "rank 0/1", _seed(gen))


@pytest.mark.distributed
def test_layer_wise_checkpoints_on_four_ranks_and_resharding(tmp_path, gen):
    """Four ranks, TP = 2 x DP = 2: stock into ours and ours into stock (torch_dist). Then both
    checkpoints loaded at TP = 1 x DP = 4, and in this process at TP = DP = 1: ours loads
    exactly what stock loads."""
    import torch.multiprocessing as mp

    import megatron_layer_wise_worker as lw

    if not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("the cross-loads need Megatron's own TensorParallelMuon (emerging-optimizers)")
    world_size = 4
    ckpt_root = tmp_path / "checkpoints"
    ckpt_root.mkdir()
    rendezvous = os.path.join(str(tmp_path), "rendezvous")
    seed = _seed(gen)
    mp.spawn(lw.worker, args=(world_size, rendezvous, str(ckpt_root), seed), nprocs=world_size, join=True)

    megatron_cpu.on_single_rank(lw.check_resharded_load, str(ckpt_root), "rank 0/1 TP=1 DP=1", seed)


@pytest.mark.distributed
def test_layer_wise_checkpoints_of_other_optimizers_on_two_ranks(tmp_path, gen):
    """TP = 1 x DP = 2, each rank owning some of the weights: the cases of optimizers other than
    muon (adaptive_muon), torch_dist and torch formats, as on one rank."""
    import torch.multiprocessing as mp

    import megatron_layer_wise_worker as lw

    assert lw.TWO_RANK_CASES
    _needs_emerging_optimizers(lw.TWO_RANK_CASES)
    rendezvous = os.path.join(str(tmp_path), "rendezvous")
    mp.spawn(lw.cases_worker, args=(2, rendezvous, str(tmp_path), _seed(gen), lw.TWO_RANK_CASES), nprocs=2,
             join=True)


@pytest.mark.distributed
def test_hybrid_layer_wise_and_distributed_optimizer_checkpoints_on_two_ranks(tmp_path, gen):
    """DP = 2, Megatron DDP with the layer-wise layout: Muon in the LayerWiseDistributedOptimizer,
    Adam in a DistributedOptimizer; dp_reshardable (stock's checkpoint) and fully_reshardable (ours)
    each loaded by stock and by ours; and every parameter, one marked use_muon = False included,
    trains (megatron_hybrid_worker.py)."""
    import torch.multiprocessing as mp

    import megatron_hybrid_worker

    if not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("the cross-loads need Megatron's own TensorParallelMuon (emerging-optimizers)")
    ckpt_root = tmp_path / "checkpoints"
    ckpt_root.mkdir()
    rendezvous = os.path.join(str(tmp_path), "rendezvous")
    seed = _seed(gen)
    mp.spawn(megatron_hybrid_worker.worker, args=(2, rendezvous, str(ckpt_root), seed), nprocs=2, join=True)

    megatron_cpu.on_single_rank(megatron_hybrid_worker.check_resharded_load, str(ckpt_root), "rank 0/1 DP=1", seed)


def test_install_aligns_layer_wise_ownership_with_use_muon():
    """Where megatron-core's layer-wise ownership rule ignores use_muon = False (0.18, 0.19),
    install() makes it leave such weights to the scalar optimizer, as the routing does, and
    uninstall() puts Megatron's rule back."""
    import torch

    import megatron.core.optimizer.layer_wise_optimizer as layer_wise

    from megatron_eopt.integrations import megatron as integration

    integration.uninstall()
    stock_rule = layer_wise.is_managed_by_layer_wise_optimizer
    weight, excluded, vector = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 5), (5, 3), (5,)))
    excluded.use_muon = False
    honoured = not stock_rule(excluded)
    integration.install()
    try:
        rule = layer_wise.is_managed_by_layer_wise_optimizer
        assert (rule(weight), rule(excluded), rule(vector)) == (True, False, False)
        assert mcore_optimizer.is_managed_by_layer_wise_optimizer is rule
        assert (rule is stock_rule) == honoured  # replaced only where Megatron ignores the flag
        integration.install()
        assert layer_wise.is_managed_by_layer_wise_optimizer is rule  # idempotent
    finally:
        integration.uninstall()
    assert layer_wise.is_managed_by_layer_wise_optimizer is stock_rule
    assert mcore_optimizer.is_managed_by_layer_wise_optimizer is stock_rule


def test_entry_with_its_own_routing_leaves_layer_wise_ownership_alone(monkeypatch):
    """An entry registered with its own default_param_overrides decides its routing itself, so
    install() leaves Megatron's layer-wise ownership rule as it is."""
    import megatron.core.optimizer.layer_wise_optimizer as layer_wise

    import megatron_eopt
    from megatron_eopt.integrations import megatron as integration
    from megatron_eopt.optim import TensorParallelMuon

    registry = megatron_eopt.registry
    registry.names()
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    rule = registry.ParamRule("vectors", lambda p: p.dim() != 2)
    registry.register("own_muon", registry.EmergingOptimizerEntry(
        TensorParallelMuon, config_to_kwargs=registry.muon_config_to_kwargs,
        default_param_overrides={rule: {"optimizer": "adam"}},
    ))
    integration.uninstall()
    stock_rule = layer_wise.is_managed_by_layer_wise_optimizer
    try:
        integration.install(["own_muon"])
        assert layer_wise.is_managed_by_layer_wise_optimizer is stock_rule
    finally:
        integration.uninstall()
