"""megatron_eopt.clip_grad_norm_: torch's clip under policy="global", the Muon-aware policies, the
inputs it reads the Muon part from, GradScaler overflows, DTensor gradients, no host sync."""

import pytest
import torch

import megatron_eopt as me
from megatron_eopt import nanochat
from megatron_eopt.optim import HybridMuon


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8, bias=False)
        self.head = torch.nn.Linear(8, 11, bias=False)


def _model(seed=0):
    torch.manual_seed(seed)
    model = Net()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 10.0
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _norm(tensors):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])).float()


MUON_NAMES = ("fc1.weight", "fc2.weight")  # what build_optimizers routes to Muon in Net


def _check_policy(model, before, policy, total, max_norm):
    muon = [before[n] for n in MUON_NAMES]
    other = [g for n, g in before.items() if n not in MUON_NAMES]
    torch.testing.assert_close(total, _norm(muon + other), rtol=1e-6, atol=0)
    if policy == "global":
        coefs = dict.fromkeys(before, min(1.0, max_norm / (_norm(muon + other).item() + 1e-6)))
    else:
        adamw_coef = min(1.0, max_norm / (_norm(other).item() + 1e-6))
        muon_coef = 1.0 if policy == "adamw" else min(1.0, max_norm / (_norm(muon).item() + 1e-6))
        coefs = {n: muon_coef if n in MUON_NAMES else adamw_coef for n in before}
    for n, p in model.named_parameters():
        if policy == "adamw" and n in MUON_NAMES:
            assert torch.equal(p.grad, before[n]), n  # untouched, bit for bit
        else:
            torch.testing.assert_close(p.grad, before[n] * coefs[n], rtol=1e-5, atol=1e-6)


def test_global_matches_torch_bit_for_bit():
    ours = _model()
    opts, _ = me.build_optimizers(ours)
    total = me.clip_grad_norm_(opts, 1.0, policy="global")
    # same tensors in the same order: torch's clip on the optimizers' parameter order
    ref2 = _model()
    ref_params = dict(ref2.named_parameters())
    order = [n for o in opts for g in o.param_groups for p in g["params"] for n, q in ours.named_parameters() if q is p]
    ref_total = torch.nn.utils.clip_grad_norm_([ref_params[n] for n in order], 1.0)
    assert torch.equal(total, ref_total)
    for (n, p), q in zip(ours.named_parameters(), ref2.parameters()):
        assert torch.equal(p.grad, q.grad), n
    # plain parameters, torch's positional signature, norm_type inf
    a, b = _model(), _model()
    assert torch.equal(me.clip_grad_norm_(a.parameters(), 0.5, float("inf"), policy="global"),
                       torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5, float("inf")))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("policy", ["global", "adamw", "separate"])
def test_build_optimizers_pair(policy):
    model = _model()
    pair = me.build_optimizers(model)
    assert {n for n in pair[1].names_for("muon")} == set(MUON_NAMES)
    before = _grads(model)
    total = me.clip_grad_norm_(pair, 1.0, policy=policy)
    assert isinstance(total, torch.Tensor) and total.ndim == 0
    _check_policy(model, before, policy, total, 1.0)


def test_default_policy_is_adamw_and_parts_are_returned():
    model = _model()
    opts, _ = me.build_optimizers(model)
    before = _grads(model)
    norms = me.clip_grad_norm_(opts, 1.0, return_parts=True)
    assert isinstance(norms, me.GradNorms)
    _check_policy(model, before, "adamw", norms.total, 1.0)
    muon = [before[n] for n in MUON_NAMES]
    other = [g for n, g in before.items() if n not in MUON_NAMES]
    torch.testing.assert_close(norms.muon, _norm(muon), rtol=1e-6, atol=0)
    torch.testing.assert_close(norms.adamw, _norm(other), rtol=1e-6, atol=0)
    assert all(isinstance(t, torch.Tensor) and t.ndim == 0 for t in norms)


def _hybrid_muon(named):
    return HybridMuon([dict(params=[named[n] for n in MUON_NAMES], use_muon=True),
                       dict(params=[p for n, p in named.items() if n not in MUON_NAMES], use_muon=False)])


def _nanochat_muon_adamw(named):
    groups = [dict(kind="adamw", params=[p for n, p in named.items() if n not in MUON_NAMES], lr=0.01,
                   betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)]
    groups += [dict(kind="muon", params=[named[n]], lr=0.02, momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=0.0)
               for n in MUON_NAMES]
    return nanochat.MuonAdamW(groups)


@pytest.mark.parametrize("policy", ["adamw", "separate"])
@pytest.mark.parametrize("build", [_hybrid_muon, _nanochat_muon_adamw], ids=["hybrid_muon", "nanochat_muon_adamw"])
def test_optimizers_with_muon_and_adamw_groups(policy, build):
    """HybridMuon's use_muon groups and nanochat MuonAdamW's kind groups tell the two parts."""
    model = _model()
    opt = build(dict(model.named_parameters()))
    before = _grads(model)
    _check_policy(model, before, policy, me.clip_grad_norm_(opt, 1.0, policy=policy), 1.0)


@pytest.mark.parametrize("how", ["tensors", "routing_table"])
def test_plain_parameters(how):
    model = _model()
    named = dict(model.named_parameters())
    before = _grads(model)
    if how == "tensors":
        total = me.clip_grad_norm_(model.parameters(), 1.0, muon_params=[named[n] for n in MUON_NAMES])
    else:
        _, table = me.build_optimizers(_model())  # same names, other tensors
        total = me.clip_grad_norm_(model.named_parameters(), 1.0, muon_params=table)
    _check_policy(model, before, "adamw", total, 1.0)
    with pytest.raises(ValueError, match="muon_params"):
        me.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="policy"):
        me.clip_grad_norm_(model.parameters(), 1.0, policy="muon")


def test_small_gradients_are_not_clipped_and_empty_parts():
    model = _model()
    for p in model.parameters():
        p.grad.mul_(1e-4)
    before = _grads(model)
    opts, _ = me.build_optimizers(model)
    me.clip_grad_norm_(opts, 1.0, policy="separate")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[n], rtol=1e-6, atol=0)
    # only AdamW parameters: the Muon part's norm is 0
    norms = me.clip_grad_norm_(opts[1], 1.0, return_parts=True)
    assert norms.muon.item() == 0.0 and norms.adamw.item() == norms.total.item()


@pytest.mark.parametrize("policy", ["global", "adamw", "separate"])
def test_grad_scaler_overflow_clips_nothing(policy):
    model = _model()
    opts, _ = me.build_optimizers(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the iteration's scale(loss): the gradients below are scaled by 1024
    for p in model.parameters():
        p.grad.mul_(1024.0)
    model.fc2.weight.grad[0, 0] = float("inf")
    model.embed.weight.grad[1, 1] = float("nan")
    before = {n: g / 1024.0 for n, g in _grads(model).items()}
    total = me.clip_grad_norm_(opts, 1.0, policy=policy, grad_scaler=scaler, error_if_nonfinite=True)
    assert not torch.isfinite(total)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[n], equal_nan=True)  # unscaled, not clipped
    # the scaler saw the overflow: step() skips every optimizer
    for opt in opts:
        assert sum(v.item() for v in scaler._found_inf_per_device(opt).values()) == 1.0


def test_grad_scaler_finite_and_already_unscaled():
    model = _model()
    opts, _ = me.build_optimizers(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))
    for p in model.parameters():
        p.grad.mul_(256.0)
    before = {n: g / 256.0 for n, g in _grads(model).items()}
    scaler.unscale_(opts[0])  # the caller unscaled one itself: not unscaled twice
    ref = _model()
    for n, p in ref.named_parameters():
        p.grad = before[n].clone()
    total = me.clip_grad_norm_(opts, 1.0, grad_scaler=scaler)
    ref_opts, _ = me.build_optimizers(ref)
    ref_total = me.clip_grad_norm_(ref_opts, 1.0)
    torch.testing.assert_close(total, ref_total)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    with pytest.raises(ValueError, match="optimizers"):
        me.clip_grad_norm_(model.parameters(), 1.0, policy="global", grad_scaler=scaler)


@pytest.mark.parametrize("policy", ["global", "adamw", "separate"])
def test_no_host_sync(policy, monkeypatch):
    model = _model()
    opts, _ = me.build_optimizers(model)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync")

    for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    norms = me.clip_grad_norm_(opts, 1.0, policy=policy, return_parts=True)
    monkeypatch.undo()
    assert all(isinstance(t, torch.Tensor) for t in norms)


def test_error_if_nonfinite_raises_like_torch():
    model = _model()
    model.fc1.weight.grad[0, 0] = float("inf")
    opts, _ = me.build_optimizers(model)
    with pytest.raises(RuntimeError, match="non-finite"):
        me.clip_grad_norm_(opts, 1.0, error_if_nonfinite=True)


def test_dtensor_gradients_two_ranks(tmp_path):
    # the norms of Shard(0) DTensor gradients are reduced over the mesh: the same as one process
    from clipping_worker import full_grads
    from dist_harness import run_workers

    results = run_workers("clipping_worker.py", tmp_path, 2, 3, "all", timeout=120)
    for policy in me.CLIP_POLICIES:
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full_grads(3)]
        for p, g in zip(params, full_grads(3)):
            p.grad = g
        ref = me.clip_grad_norm_(params, 1.0, policy=policy, muon_params=params[:2], return_parts=True)
        for res in (r[policy] for r in results):
            assert all(res["plain"]), policy  # plain tensors: the norms reduced over the mesh
            for a, b in zip(res["norms"], ref):
                torch.testing.assert_close(a, b)
            for a, p in zip(res["grads"], params):
                torch.testing.assert_close(a, p.grad)


def _spiky_step(policy, optimizer_cls):
    # one matrix's gradient is tiny, another's huge: a global clip pushes the tiny one's
    # Newton–Schulz input below the eps (1e-7, EO 0.3 / Megatron-LM's), "adamw" leaves it
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 8))
    bias = torch.nn.Parameter(torch.randn(8))
    if optimizer_cls is HybridMuon:
        opt = optimizer_cls([dict(params=[a, b], use_muon=True), dict(params=[bias], use_muon=False)], lr=0.02,
                            ns_eps=1e-7)
        target = opt
    else:
        opt = me.optim.Muon([a, b], lr=0.02, ns_eps=1e-7)
        target = [opt, torch.optim.AdamW([bias])]
    a.grad, b.grad, bias.grad = torch.randn(8, 6) * 1e-6, torch.randn(6, 8) * 1e6, torch.randn(8)
    me.clip_grad_norm_(target, 1.0, policy=policy)
    opt.step()
    return opt.ns_inputs_below_eps


@pytest.mark.parametrize("optimizer_cls", [me.optim.Muon, HybridMuon])
def test_ns_inputs_below_eps_count(optimizer_cls, monkeypatch):
    assert me.optim.Muon([torch.nn.Parameter(torch.ones(2, 2))]).ns_inputs_below_eps is None  # no step yet
    below = _spiky_step("global", optimizer_cls)
    assert isinstance(below, torch.Tensor) and below.ndim == 0 and below.dtype == torch.int64
    assert below.item() == 1
    assert _spiky_step("adamw", optimizer_cls).item() == 0
    # reset every step, counted without reading the device
    opt = me.optim.Muon([torch.nn.Parameter(torch.ones(4, 4))], lr=0.02, ns_eps=1e-7)
    opt.param_groups[0]["params"][0].grad = torch.zeros(4, 4)
    opt.step()
    assert opt.ns_inputs_below_eps.item() == 1
    opt.param_groups[0]["params"][0].grad = torch.ones(4, 4)
    monkeypatch.setattr(torch.Tensor, "item", lambda *a: (_ for _ in ()).throw(AssertionError("host sync")))
    opt.step()
    count = opt.ns_inputs_below_eps
    monkeypatch.undo()
    assert count.item() == 0


def test_optimizers_declare_themselves_orthogonalizing():
    from megatron_eopt.clipping import is_orthogonalizing
    from megatron_eopt.muon import Muon as SnippetMuon
    from megatron_eopt.nanochat import Muon as NanochatMuon
    from megatron_eopt.optim import AdaptiveMuon, HybridMuon, Muon

    w = [torch.nn.Parameter(torch.randn(4, 4))]
    for opt in (Muon(w, lr=0.1), AdaptiveMuon(w, 0.1, 0.9, 0.0), SnippetMuon(w, lr=0.1), NanochatMuon(w, lr=0.1),
                torch.optim.Muon(w, lr=0.1)):
        assert is_orthogonalizing(opt), type(opt)
    for opt in (torch.optim.AdamW(w), HybridMuon([{"params": w, "use_muon": True}], lr=0.1)):
        assert not is_orthogonalizing(opt), type(opt)  # HybridMuon: its groups say which part


def test_deprecated_names_warn_and_still_work():
    import megatron_eopt.clipping as clipping
    from megatron_eopt.optim import Muon

    w = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4))
    opts = [Muon([w], lr=0.1), torch.optim.AdamW([b])]
    with pytest.warns(DeprecationWarning, match="muon_and_other_params is deprecated"):
        muon, other, optimizers = clipping.muon_and_other_params(opts)
    assert muon == [w] and other == [b] and optimizers == opts
    with pytest.warns(DeprecationWarning, match="orthogonalizing_classes is deprecated"):
        classes = clipping.orthogonalizing_classes()
    assert Muon in classes or any(issubclass(Muon, c) for c in classes)
    assert "muon_and_other_params" not in clipping.__all__
