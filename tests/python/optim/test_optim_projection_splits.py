"""Fused projections split as Megatron-LM splits them (docs/design.md §4.8, docs/megatron.md): a gated
FC1's gate and up (``split_glu``, PR #6688), QKV per head and MLA up-projections (``split_qkv_per_head``,
``qkv_layout``, PR #6326 / #7085), query groups cut by tensor parallelism; at TP 2 and 4 (gloo, CPU)
in every tp_mode, under GTP with padding, and on DTensor shards, against the single-process optimizer
on the logical matrices split by hand; bad input refused naming the parameter or the megatron-core
version."""

import dataclasses
import os
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp

import projection_split_worker
from megatron_eopt import registry
from megatron_eopt.optim import TensorParallelAdaptiveMuon, TensorParallelMuon
from megatron_eopt.optim import projection_splits
from reference import rel_err

HP = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_splits_at_tp2_and_tp4_equal_the_parts_stepped_by_hand(tmp_path, gen, world_size):
    seed = gen.initial_seed() % (2**31)
    mp.spawn(projection_split_worker.worker, args=(world_size, os.path.join(tmp_path, "rendezvous"), seed),
             nprocs=world_size, join=True)


def _stepped(cls, params, grads, **kwargs):
    opt = cls(params, **dict(HP, **kwargs))
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("cls,extra", [(TensorParallelMuon, {}),
                                       (TensorParallelAdaptiveMuon, dict(moment2_method="adamuon"))])
@pytest.mark.parametrize("interleave", [None, 3])
def test_glu_split_on_one_rank_is_gate_and_up_apart(gen, cls, extra, interleave):
    gate, up = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen)
    grads = [(torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen)) for _ in range(2)]
    fuse = lambda g, u: projection_split_worker.glu_rows(g, u, 0, 1, interleave)  # noqa: E731
    p = torch.nn.Parameter(fuse(gate, up))
    p.is_glu = True
    if interleave is not None:
        p.glu_interleave_size = interleave
    _stepped(cls, [p], [[fuse(g, u)] for g, u in grads], split_glu=True, **extra)
    ref = [torch.nn.Parameter(gate.clone()), torch.nn.Parameter(up.clone())]
    _stepped(cls, ref, [list(pair) for pair in grads], **extra)
    assert rel_err(p.detach(), fuse(ref[0].detach(), ref[1].detach())) <= 1e-6
    # untagged, or split_glu off: one matrix, as before
    q = torch.nn.Parameter(fuse(gate, up))
    q.is_glu = True
    _stepped(cls, [q], [[fuse(g, u)] for g, u in grads], split_glu=False, **extra)
    assert rel_err(q.detach(), p.detach()) > 1e-4


def test_bad_splits_are_refused_naming_the_parameter():
    def build(shape, **tags):
        p = torch.nn.Parameter(torch.randn(*shape))
        for k, v in tags.items():
            setattr(p, k, v)
        return p

    where = r"param_groups\[0\]\['params'\]\[1\]"
    ok = build((4, 4))
    with pytest.raises(ValueError, match=where + r".*7 tensor-parallel local rows .* do not halve into gate and up"):
        TensorParallelMuon([ok, build((7, 4), is_glu=True)], split_glu=True)
    with pytest.raises(ValueError, match=where + r".*12 .* glu_interleave_size=4"):
        TensorParallelMuon([ok, build((12, 4), is_glu=True, glu_interleave_size=4)], split_glu=True)
    with pytest.raises(ValueError, match=where + r".*glu_interleave_size must be a positive int"):
        TensorParallelMuon([ok, build((12, 4), is_glu=True, glu_interleave_size=0)], split_glu=True)
    with pytest.raises(ValueError, match=where + r".*gtp_remat_size=2 .* has 1 rank"):  # no GTP group to gather
        TensorParallelMuon([ok, build((12, 4), is_glu=True, is_gtp_weight_remat=True, gtp_remat_size=2)],
                           split_glu=True)
    qkv = dict(split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False))
    with pytest.raises(ValueError, match=where + r".*head sizes sum to 6 rows, the fused matrix has 8"):
        TensorParallelMuon([ok, build((8, 4), is_qkv=True)], qkv_split_shapes=[2, 2, 2], split_qkv_per_head=True,
                           **qkv)
    with pytest.raises(ValueError, match=where + r".*qkv_split_shapes_global must|per-head qkv_split_shapes must"):
        TensorParallelMuon([ok, build((8, 4), is_qkv=True, qkv_split_shapes_global=[4, 0, 4])],
                           split_qkv_per_head=True, **qkv)
    with pytest.raises(ValueError, match="split_qkv_per_head requires split_qkv=True"):
        TensorParallelMuon([ok], split_qkv_per_head=True)
    with pytest.raises(ValueError, match="split_glu must be a bool"):
        TensorParallelAdaptiveMuon([ok], split_glu="yes")
    # nothing was stepped or given state
    assert ok.grad is None


def test_defaults_follow_the_installed_megatron_core(monkeypatch):
    """None (the default) takes the installed megatron-core's TensorParallelMuon default: False for one
    without the argument (0.19), its own default for one that has it."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = TensorParallelMuon([p])
    assert (opt.split_glu, opt.split_qkv_per_head) == (projection_splits.megatron_default("split_glu"),
                                                       projection_splits.megatron_default("split_qkv_per_head"))
    source = ("class TensorParallelMuon(OrthogonalizedOptimizer):\n"
              "    def __init__(self, params, split_qkv=False, split_qkv_per_head: bool = False,\n"
              "                 split_glu: bool = True, tp_mode='duplicated'):\n"
              "        pass\n")
    monkeypatch.delitem(sys.modules, "megatron.core.optimizer.emerging_optimizers", raising=False)
    monkeypatch.setattr(projection_splits, "megatron_emerging_source", lambda: source)
    assert projection_splits.megatron_default("split_glu") is True
    assert projection_splits.megatron_default("split_qkv_per_head") is False
    opt = TensorParallelAdaptiveMuon([torch.nn.Parameter(torch.randn(4, 4))])
    assert opt.split_glu is True and opt.split_qkv_per_head is False
    assert TensorParallelMuon([torch.nn.Parameter(torch.randn(4, 4))], split_glu=False).split_glu is False
    monkeypatch.setattr(projection_splits, "megatron_emerging_source", lambda: "x = 1\n")
    assert projection_splits.megatron_default("split_glu") is False


def test_per_head_split_shapes_from_the_model_config():
    cfg = types.SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=16)
    assert registry.qkv_split_shapes_from_model_config(cfg) == [64, 16, 16]
    assert registry.qkv_split_shapes_from_model_config(cfg, per_head=True) == ([16] * 4 + [16, 16]) * 2
    cfg.attention_output_gate = True
    assert registry.qkv_split_shapes_from_model_config(cfg, per_head=True) == ([16] * 8 + [16, 16]) * 2
    config = types.SimpleNamespace(lr=0.02, weight_decay=0.1, muon_split_qkv=True, muon_split_qkv_per_head=True,
                                   muon_split_glu=True)
    kwargs = registry.get("muon").config_to_kwargs(config, [types.SimpleNamespace(config=cfg)], None)
    assert kwargs["split_glu"] is True and kwargs["split_qkv_per_head"] is True
    assert kwargs["qkv_split_shapes"] == ([16] * 8 + [16, 16]) * 2


def test_an_option_the_megatron_core_lacks_is_refused_naming_its_version():
    """On a Megatron-LM OptimizerConfig (a dataclass) whose class does not declare muon_split_glu /
    muon_split_qkv_per_head, asking for one (set as an attribute) stops the build naming the version;
    False (what that megatron-core runs) passes, and a class that declares the field passes its value."""

    @dataclasses.dataclass
    class OldConfig:
        lr: float = 0.02
        weight_decay: float = 0.1
        muon_split_qkv: bool = True

    @dataclasses.dataclass
    class NewConfig(OldConfig):
        muon_split_glu: bool = True
        muon_split_qkv_per_head: bool = False

    for name in ("muon", "adaptive_muon", "muon_ht"):
        entry = registry.get(name)
        for field in ("muon_split_glu", "muon_split_qkv_per_head"):
            config = OldConfig()
            setattr(config, field, True)
            with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field}=True .*megatron-core"):
                entry.config_to_kwargs(config, [], None)
            setattr(config, field, False)
            assert entry.config_to_kwargs(config, [], None)[field[len("muon_"):]] is False
        kwargs = entry.config_to_kwargs(NewConfig(), [], None)
        assert kwargs["split_glu"] is True and kwargs["split_qkv_per_head"] is False
