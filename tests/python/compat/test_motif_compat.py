"""Motif's parallel Muon by one import (``megatron_eopt.muon``): its numbers, routing, group keys,
AdamW state, checkpoints and QK-clip semantics, against the float64 re-expression of Motif's
behaviour in motif_reference.py (single process; the DTensor / FSDP2 runs are in
test_motif_sharded.py)."""

import copy
import warnings

import pytest
import torch

from megatron_eopt import muon as legacy
from megatron_eopt.compat.motif import MotifMuon
from megatron_eopt.optim import HybridMuon
from motif_reference import MUON_KEYS, MotifReference, clip_row_factors
from reference import TOLERANCE, rel_err

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, EXPERTS = 4, 2, 3, 10, 3
NOPE, ROPE, V_DIM, RANK = 3, 2, 4, 6


class Attention(torch.nn.Module):
    def __init__(self, mla: bool):
        super().__init__()
        if mla:
            self.wq_b = torch.nn.Linear(RANK, HEADS * (NOPE + ROPE), bias=False)
            self.wkv_b = torch.nn.Linear(RANK, HEADS * (NOPE + V_DIM), bias=False)
        else:
            self.wq = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
            self.wk = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)


class Block(torch.nn.Module):
    def __init__(self, mla: bool):
        super().__init__()
        self.attn = Attention(mla)
        self.attention_norm = torch.nn.LayerNorm(HIDDEN)
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS, 7, HIDDEN) * 0.1)


class Inner(torch.nn.Module):
    def __init__(self, mla: bool):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(9, HIDDEN)
        self.layers = torch.nn.ModuleList(Block(mla) for _ in range(2))
        self.norm = torch.nn.LayerNorm(HIDDEN)


class Model(torch.nn.Module):
    """Motif-style names: model.embed_tokens, model.layers.<i>.attn.wq / wk (or MLA's wq_b / wkv_b),
    a 3-D expert tensor per layer, norms, and an output head."""

    def __init__(self, mla: bool = False):
        super().__init__()
        self.model = Inner(mla)
        self.output = torch.nn.Linear(HIDDEN, 9, bias=False)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args, **kwargs)


def _groups(model, **adamw_options):
    groups = _quiet(legacy.get_default_muon_param_groups, model)
    groups[1].update(adamw_options)
    return groups


def _build(model, groups=None, **kwargs):
    kwargs.setdefault("expert_keys", ["experts"])
    return _quiet(legacy.Muon, groups if groups is not None else _groups(model), **kwargs)


def _reference(model, opt, clip_config=None):
    """A MotifReference over the model's params with the optimizer's group settings (Motif keys)."""
    params, groups, index = [], [], 0
    for g in opt.param_groups:
        ids = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        params += g["params"]
        groups.append({**{k: g[k] for k in MUON_KEYS}, "use_muon": g["use_muon"], "params": ids,
                       **({"names": list(g["names"])} if "names" in g else {})})
    return params, MotifReference(params, groups, clip_config)


def _fresh_grads(params, gen):
    grads = {}
    for i, p in enumerate(params):
        grads[i] = torch.randn(p.shape, generator=gen)
        p.grad = grads[i].clone()
    return grads


def _compare(opt, params, start, ref, steps, motif_bf16):
    """Each param's change over the steps against the reference's, and the state. Tolerances: fp32
    AdamW's; for Muon, design §9's bf16 figure, or 1.5x the distance bf16 rounding alone puts
    between Motif's own arithmetic (``motif_bf16``, the reference run with bf16 Newton–Schulz) and
    float64 on these inputs where that is larger (the small near-square matrices here, whose
    smallest singular values the iteration magnifies); plus one fp32 rounding of the stored
    parameter per step."""
    for group in opt.param_groups:
        for p in group["params"]:
            i = next(j for j, q in enumerate(params) if q is p)
            delta, ref_delta = p.detach().double() - start[i], ref.p[i] - start[i]
            storage = steps * 2.0**-24 * float(start[i].norm() / ref_delta.norm().clamp_min(1e-30))
            if group["use_muon"]:
                tol = max(TOLERANCE["medium"], 1.5 * rel_err(motif_bf16.p[i] - start[i], ref_delta)) + storage
            else:
                tol = 1e-5 + storage
            assert rel_err(delta, ref_delta) <= tol, (group["use_muon"], tuple(p.shape), rel_err(delta, ref_delta))
            for key, value in ref.state[i].items():
                got = opt.state[p][key]
                if key == "step":
                    assert float(got) == value
                else:
                    assert rel_err(got, value) <= 1e-5, (key, rel_err(got, value))


def _step_and_compare(opt, params, ref, gen, steps):
    """``steps`` steps of ``opt`` and of the reference on the same fresh grads, then :func:`_compare`."""
    start = [p.detach().double().clone() for p in params]
    motif_bf16 = copy.deepcopy(ref)
    motif_bf16.ns_dtype = torch.bfloat16
    for _ in range(steps):
        grads = _fresh_grads(params, gen)
        opt.step()
        ref.step(grads)
        motif_bf16.step(grads)
    _compare(opt, params, start, ref, steps, motif_bf16)


# ------------------------------------------------------------------ numbers, routing, group keys
@pytest.mark.parametrize("nesterov", [True, False])
def test_one_import_muon_matches_motif(nesterov, gen):
    model = Model()
    groups = _groups(model, adamw_betas=(0.8, 0.9), adamw_eps=1e-6, lr=3e-3, weight_decay=0.05)
    # Motif's positional order: params, lr, weight_decay, momentum, nesterov.
    opt = _build(model, groups, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    assert isinstance(opt, MotifMuon) and isinstance(opt, HybridMuon)
    params, ref = _reference(model, opt)
    _step_and_compare(opt, params, ref, gen, 3)
    assert all(set(opt.state[p]) == {"momentum_buffer"} for p in opt.param_groups[0]["params"])
    assert all(set(opt.state[p]) == {"step", "moment1", "moment2"} for p in opt.param_groups[1]["params"])


def test_positional_arguments_follow_motif(gen):
    model = Model()
    opt = _quiet(legacy.Muon, _groups(model), 0.03, 0.2, 0.85, False, 7, (0.7, 0.8), 1e-5, False,
                 expert_keys=["experts"])
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"], group["nesterov"], group["ns_steps"],
            group["adamw_betas"], group["adamw_eps"], group["none_grad"]) == (0.03, 0.2, 0.85, False, 7, (0.7, 0.8),
                                                                              1e-5, False)


def test_default_routing_is_motifs():
    model = Model()
    groups = _groups(model)
    muon_names = groups[0]["names"]
    expected = [n for n, p in model.named_parameters()
                if p.ndim >= 2 and not any(k in n for k in ("embeddings", "lm_head", "model.norm"))]
    assert muon_names == expected
    assert "model.embed_tokens.weight" in muon_names and "output.weight" in muon_names
    assert "names" not in groups[1] and groups[1]["use_muon"] is False
    assert len(groups[1]["params"]) == sum(1 for p in model.parameters()) - len(muon_names)
    assert legacy.default_is_muon("model.norm.weight", torch.empty(3, 3)) is False
    assert legacy.default_is_muon("tok_embeddings.weight", torch.empty(3, 3)) is False
    assert legacy.default_is_muon("h.0.w", torch.empty(3)) is False
    # A frozen parameter is left out; is_muon_func decides instead of the default.
    model.output.weight.requires_grad_(False)
    only_wq = _quiet(legacy.get_default_muon_param_groups, model, lambda n, p: n.endswith("wq.weight"))
    assert only_wq[0]["names"] == ["model.layers.0.attn.wq.weight", "model.layers.1.attn.wq.weight"]
    assert all(p is not model.output.weight for g in only_wq for p in g["params"])


def test_parse_qk_layer():
    parse = legacy.parse_qk_layer
    assert parse("model.3.attn.wq.weight") == ("wq", 3)
    assert parse("model.layers.12.self_attn.k_proj.weight") == ("k_proj", 12)
    assert parse("model.2.blocks.5.attn.wkv_b.weight") == ("wkv_b", 5)  # the last number is the layer
    assert parse("model.4.attn.v_proj.weight") == (None, -1)
    assert parse("wq.weight") == (None, -1)
    assert parse("model.attn.wq_b.weight") == ("wq_b", -1)


def test_groups_and_tensors_motif_refuses():
    model = Model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="expert_keys"):
        _quiet(legacy.Muon, _groups(model), lr=0.01)  # a 3-D tensor without expert_keys
    with pytest.raises(ValueError, match=r"model\.layers\.0\.experts.*expert_keys=\['moe'\]"):
        _build(model, expert_keys=["moe"])
    with pytest.raises(ValueError, match="no 'use_muon' key"):
        _build(model, [{"params": list(model.parameters()), "use_muon": True}, {"params": []}], lr=0.01)
    with pytest.raises(ValueError, match="generator"):
        MotifMuon(({"params": [p], "use_muon": True} for p in model.parameters()))
    with pytest.raises(ValueError, match="clip_config has unknown keys \\['q_index'\\]"):
        _build(model, clip_config={"q_index": [0], "head_dim": HEAD_DIM, "threshold": 1.0})
    with pytest.raises(ValueError, match="q_indices'\\] names heads \\[4\\]"):
        _build(model, clip_config={"q_indices": [0, 4], "head_dim": HEAD_DIM, "threshold": 1.0})
    with pytest.raises(ValueError, match="'threshold'"):
        _build(model, clip_config={"q_indices": [0], "head_dim": HEAD_DIM})
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ------------------------------------------------------------------ none_grad, cpu_offload, checkpoints
def test_none_grad_keeps_grads_of_unsharded_params(gen):
    model = Model()
    opt = _build(model, lr=0.01)  # none_grad=True: Motif drops only the sharded Muon params' grads
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = _fresh_grads(params, gen)
    opt.step()
    assert all(torch.equal(p.grad, grads[i]) for i, p in enumerate(params))


def test_cpu_offload_keyword_is_invisible(gen):
    model = Model()
    twin = Model()
    twin.load_state_dict(model.state_dict())
    opt, off = _build(model, lr=0.01), _build(twin, lr=0.01, cpu_offload=True)
    assert off.cpu_offload and not opt.cpu_offload
    for _ in range(2):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        off.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_checkpoints_interchange_with_motifs_layout(gen):
    # Motif -> ours: a Motif-layout state_dict after one step loads and continues like Motif.
    model = Model()
    opt = _build(model, lr=0.02, momentum=0.9)
    params, ref = _reference(model, opt)
    ref.step({i: torch.randn(p.shape, generator=gen) for i, p in enumerate(params)})
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(ref.p[i])
    opt.load_state_dict(ref.state_dict())
    assert [set(g) - {"params"} for g in opt.param_groups] == [set(g) - {"params"} for g in ref.groups]
    _step_and_compare(opt, params, ref, gen, 2)

    # ours -> Motif: our state_dict has every key Motif reads, in Motif's layout.
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        assert set(MUON_KEYS) | {"use_muon", "params"} <= set(group)
    back = MotifReference(params, ref.groups)
    back.load_state_dict(sd)
    _step_and_compare(opt, params, back, gen, 1)


def test_checkpoint_state_that_cannot_follow_its_param_is_refused(gen):
    model = Model()
    opt = _build(model, lr=0.02)
    params, ref = _reference(model, opt)
    ref.step({i: torch.randn(p.shape, generator=gen) for i, p in enumerate(params)})
    sd = ref.state_dict()
    sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"].t().contiguous()
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\]\['momentum_buffer'\] has shape"):
        opt.load_state_dict(sd)
    assert len(opt.state) == 0 and opt.param_groups[1]["adamw_betas"] == (0.9, 0.95)


# ------------------------------------------------------------------ QK-clip, Motif's semantics
def _clip_twins(clip_config, logits, gen, mla=False, logits_for_plain=None):
    """(model stepped with clip_config and qk_logits, its twin stepped without, same grads)."""
    model, plain = Model(mla), Model(mla)
    plain.load_state_dict(model.state_dict())
    opt = _build(model, lr=0.01, clip_config=clip_config)
    ref = _build(plain, lr=0.01)
    for p, q in zip(model.parameters(), plain.parameters()):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    opt.step(qk_logits=logits)
    ref.step(qk_logits=logits_for_plain)
    return model, plain


def _assert_rows_clipped(model, plain, projections, mla, logits, config) -> int:
    """Each layer's (kind, weight name) projection is its unclipped twin's times Motif's row factors;
    returns how many rows clipped."""
    clipped = 0
    for layer in range(2):
        for kind, name in projections:
            w = getattr(model.model.layers[layer].attn, name).weight
            base = getattr(plain.model.layers[layer].attn, name).weight
            factors = clip_row_factors(w.shape[0], kind, mla, logits[layer], config)
            torch.testing.assert_close(w.double(), base.double() * factors[:, None], rtol=1e-6, atol=0)
            clipped += int((factors < 1).sum())
    return clipped


def _logits(gen, layers=2):
    # Maxima around the threshold so some heads clip and some do not.
    return {layer: torch.rand(HEADS, generator=gen) * 10 for layer in range(layers)}


@pytest.mark.parametrize("q_indices,k_indices", [([1, 3], [0, 1]), ([0, 1, 2, 3], [0, 0, 1, 1]), ([2], [])],
                         ids=["positional", "gqa", "queries-only"])
def test_qk_clip_is_motifs_positional_rule(q_indices, k_indices, gen):
    config = {"q_indices": q_indices, "k_indices": k_indices, "head_dim": HEAD_DIM, "threshold": 5.0}
    logits = _logits(gen)
    model, plain = _clip_twins(config, logits, gen)
    clipped = _assert_rows_clipped(model, plain, (("q", "wq"), ("k", "wk")), False, logits, config)
    for layer in range(2):
        assert torch.equal(model.model.layers[layer].attn.wo.weight, plain.model.layers[layer].attn.wo.weight)
    assert clipped > 0 or all((logits[l][: len(q_indices)] <= 5.0).all() for l in logits)


def test_motif_names_without_a_layers_prefix_are_clipped(gen):
    # Motif's own naming, model.<i>.attn.wq.weight, and AdamW params given as a generator.
    names = [f"model.{i}.attn.{kind}.weight" for i in range(2) for kind in ("wq", "wk")]
    weights = [torch.nn.Parameter(torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen)) for _ in names]
    twins = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    bias = torch.nn.Parameter(torch.randn(HIDDEN, generator=gen))
    config = {"q_indices": [3, 1], "k_indices": [2], "head_dim": HEAD_DIM, "threshold": 2.0}
    opt = _quiet(legacy.Muon, [{"params": weights, "names": names, "use_muon": True},
                               {"params": (p for p in [bias]), "use_muon": False}], lr=0.01, clip_config=config)
    plain = _quiet(legacy.Muon, [{"params": twins, "names": names, "use_muon": True}], lr=0.01)
    assert opt.param_groups[1]["params"] == [bias]
    for w, t in zip(weights, twins):
        w.grad = torch.randn(w.shape, generator=gen)
        t.grad = w.grad.clone()
    logits = [torch.rand(HEADS, generator=gen) * 6 for _ in range(2)]
    opt.step(qk_logits=logits)
    plain.step()
    for name, w, t in zip(names, weights, twins):
        kind, layer = legacy.parse_qk_layer(name)
        factors = clip_row_factors(w.shape[0], kind[1], False, logits[layer], config)
        torch.testing.assert_close(w.double(), t.double() * factors[:, None], rtol=1e-6, atol=0)


def test_qk_clip_mla_scales_nope_and_rope_rows(gen):
    config = {"q_indices": [0, 1, 2, 3], "k_indices": [0, 1, 2, 3], "threshold": 4.0, "qk_nope_head_dim": NOPE,
              "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM}
    logits = {0: torch.tensor([8.0, 1.0, 4.5, 2.0]), 1: torch.rand(HEADS, generator=gen) * 8}
    model, plain = _clip_twins(config, logits, gen, mla=True)
    _assert_rows_clipped(model, plain, (("q", "wq_b"), ("k", "wkv_b")), True, logits, config)
    # Head 0 of layer 0 clips (8 > 4): its q.k logit shrinks by exactly tau / logit.
    q = model.model.layers[0].attn.wq_b.weight.double() / plain.model.layers[0].attn.wq_b.weight.double()
    k = model.model.layers[0].attn.wkv_b.weight.double() / plain.model.layers[0].attn.wkv_b.weight.double()
    assert abs(q[0, 0] * k[0, 0] - 0.5) < 1e-6 and abs(q[NOPE, 0] - 0.5) < 1e-6
    assert torch.equal(k[NOPE:NOPE + V_DIM], torch.ones_like(k[NOPE:NOPE + V_DIM]))  # value rows stay


@pytest.mark.parametrize("config", [None, {"head_dim": HEAD_DIM, "threshold": 1.0},
                                    {"q_indices": [], "k_indices": [], "head_dim": 128, "threshold": 100}],
                         ids=["no-config", "no-indices", "motif-default"])
def test_qk_clip_inert_without_indices(config, gen):
    model, plain = _clip_twins(config, {l: torch.full((HEADS,), 1e4) for l in range(2)}, gen)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_qk_logits_as_list_equal_dict(gen):
    config = {"q_indices": [0, 1, 2, 3], "k_indices": [0, 0, 1, 1], "head_dim": HEAD_DIM, "threshold": 3.0}
    logits = _logits(gen)
    a, b = Model(), Model()
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = _build(a, lr=0.01, clip_config=config), _build(b, lr=0.01, clip_config=config)
    for p, q in zip(a.parameters(), b.parameters()):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    opt_a.step(qk_logits=logits)
    opt_b.step(qk_logits=[logits[0], logits[1]])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("logits,match", [
    ({0: torch.ones(HEADS)}, "no entry for layer 1"),
    ([torch.ones(HEADS)], "list of 1 layers"),
    ({0: torch.ones(HEADS), 1: torch.ones(2)}, "has 2 values, but clip_config lists 4 heads"),
    ({0: torch.ones(HEADS), 1: torch.ones(2, 2)}, "1-D float tensor"),
    ("logits", "dict"),
])
def test_bad_qk_logits_change_nothing(logits, match, gen):
    model = Model()
    opt = _build(model, lr=0.01, clip_config={"q_indices": [0, 1, 2, 3], "head_dim": HEAD_DIM, "threshold": 1.0})
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step(qk_logits=logits)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 0


def test_bad_adamw_grad_changes_nothing(gen):
    model = Model()
    opt = _build(model, lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    model.model.norm.weight.grad = torch.randn(HIDDEN, generator=gen).to_sparse()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="AdamW does not support sparse gradients"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 0
