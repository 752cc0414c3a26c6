"""TensorParallelMuonHT (Megatron-LM's ``muon_ht``): hyperball norms of the whole matrices under TP / GTP."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

import muon_ht_worker
from megatron_eopt import registry
from megatron_eopt.optim import MuonHyperball, TensorParallelMuonHT


@pytest.mark.distributed
def test_muon_ht_on_two_ranks_equals_single_process_hyperball(tmp_path, gen):
    # TP 2 (duplicated, distributed, layer_sharded, auto; rows, columns, replicated and expert weights,
    # a GTP-padded one) and GTP 2 x TP 1: the gathered weights equal MuonHyperball's on the full
    # matrices within 1e-6 after 3 steps, and stay on the sphere; bad arguments refused.
    seed = gen.initial_seed() % (2**31)
    mp.spawn(muon_ht_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous"), seed), nprocs=2, join=True)


def _pg():
    return SimpleNamespace(tp=None, expt_tp=None, gtp_remat=None, expt_gtp_remat=None)


def test_muon_ht_single_process_is_muon_hyperball(gen):
    ws = [torch.randn(12, 20, generator=gen), torch.randn(20, 12, generator=gen)]
    ws = [w * (1.5 / w.norm()) for w in ws]
    ours = [torch.nn.Parameter(w.clone()) for w in ws]
    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    a = TensorParallelMuonHT(ours, lr=0.1, pg_collection=_pg(), hyperball_radius=1.5, fp32_matmul_prec="highest")
    b = MuonHyperball(ref, lr=0.1, hyperball_radius=1.5, weight_decay=0.0, nesterov=True, ns_eps=1e-7,
                      fp32_matmul_prec="highest")
    for _ in range(3):
        grads = [torch.randn_like(w) for w in ws]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, ref):
        assert (p - q).abs().max().item() <= 1e-6
        assert abs(p.norm().item() - 1.5) <= 1e-5


@pytest.mark.parametrize("kwargs, words", [
    (dict(weight_decay=0.1), "weight_decay = 0.1"),
    (dict(params_as_group_with_decay=0.01), "param_group['weight_decay'] = 0.01"),
    (dict(hyperball_radius=None), "hyperball_radius"),
    (dict(hyperball_radius=float("inf")), "hyperball_radius"),
    (dict(hyperball_eps=0.0), "hyperball_eps"),
    (dict(pg_collection=None), "pg_collection"),
])
def test_muon_ht_refusals_name_the_argument(kwargs, words):
    p = torch.nn.Parameter(torch.randn(8, 8))
    before = p.detach().clone()
    kwargs = dict(kwargs)
    decay = kwargs.pop("params_as_group_with_decay", None)
    params = [p] if decay is None else [{"params": [p], "weight_decay": decay}]
    full = dict(lr=0.1, pg_collection=_pg(), hyperball_radius=1.0)
    full.update(kwargs)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        TensorParallelMuonHT(params, **full)
    assert torch.equal(p.detach(), before)


class _Config(SimpleNamespace):
    pass


def test_muon_ht_registry_entry_maps_megatron_fields():
    entry = registry.get("muon_ht")
    assert entry.optimizer_cls is TensorParallelMuonHT
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8,
                                                   muon_ht_radius=3.0))
    config = _Config(lr=1e-3, weight_decay=0.0, muon_momentum=0.9, muon_ht_eps=1e-9, muon_tp_mode="duplicated")
    kwargs = entry.config_to_kwargs(config, [model], _pg())
    assert kwargs["hyperball_radius"] == 3.0  # from the model's config (Megatron-LM keeps it there)
    assert kwargs["hyperball_eps"] == 1e-9 and kwargs["momentum"] == 0.9 and kwargs["weight_decay"] == 0.0
    config.muon_ht_radius = 2.0  # the optimizer's config wins
    assert entry.config_to_kwargs(config, [model], _pg())["hyperball_radius"] == 2.0
    config.muon_ht_unknown = 1
    with pytest.raises(registry.UnknownConfigFieldError, match="muon_ht_unknown"):
        entry.config_to_kwargs(config, [model], _pg())
    del config.muon_ht_unknown
    config.weight_decay = 0.01  # Megatron's default: refused by the class, naming it
    kwargs = entry.config_to_kwargs(config, [model], _pg())
    with pytest.raises(ValueError, match="weight_decay"):
        TensorParallelMuonHT([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_megatron_builds_muon_ht_after_install(gen):
    """Megatron-LM's own factory, optimizer="muon_ht": ours after install(); a step puts every Muon
    matrix on the sphere; Megatron's default weight decay (0.01) is refused naming weight_decay."""
    import megatron_cpu
    from megatron_eopt.integrations import megatron as integration

    mcore_optimizer = megatron_cpu.megatron_optimizer_module()
    if mcore_optimizer is None:
        pytest.skip("megatron-core is not installed")
    with megatron_cpu.single_rank_megatron():
        integration.uninstall()
        try:
            integration.install()
            assert "muon_ht" in integration.installed()
            model = megatron_cpu.build_gpt(seed=3)
            config = mcore_optimizer.OptimizerConfig(optimizer="muon_ht", lr=0.02, min_lr=0.0, weight_decay=0.0,
                                                     clip_grad=0.0, bf16=False, fp16=False)
            config.muon_ht_radius = 2.5  # an attribute: megatron-core 0.19.2 has no such field
            with megatron_cpu.megatron_optimizer_on_cpu():
                chained = mcore_optimizer.get_megatron_optimizer(config, [model])
                inner = [w.optimizer for w in chained.chained_optimizers]
                ht = [o for o in inner if isinstance(o, TensorParallelMuonHT)]
                assert len(ht) == 1 and ht[0].hyperball_radius == 2.5
                megatron_cpu.forward_backward(model, seed=5)
                for p in model.parameters():
                    p.main_grad = p.grad
                assert chained.step()[0]
                for group in ht[0].param_groups:
                    for p in group["params"]:
                        assert abs(p.detach().norm().item() - 2.5) <= 1e-5
                config.weight_decay = 0.01
                with pytest.raises(ValueError, match="weight_decay"):
                    mcore_optimizer.get_megatron_optimizer(config, [megatron_cpu.build_gpt(seed=3)])
        finally:
            integration.uninstall()
