"""Muon-aware gradient clipping in Megatron-LM's ChainedOptimizer under install().

A megatron-core GPTModel (megatron_cpu.py, one gloo rank, CPU) with gradients scaled up so that
``clip_grad=1.0`` clips, through ``get_megatron_optimizer``. Each policy is checked against a
reference run of the same model on the same gradients with ``clip_grad=0``, whose gradients are
clipped by hand, in float64, before the step; the reported norm against float64 norms of the
gradients. The layer-wise optimizer on two ranks is in megatron_clipping_worker.py.
"""

import os

import pytest
import torch

from megatron_eopt.integrations import megatron as integration
from megatron_eopt.integrations import megatron_clipping
from megatron_eopt.optim import OrthogonalizedOptimizer

import megatron_cpu  # noqa: E402

mcore_optimizer = megatron_cpu.megatron_optimizer_module()

pytestmark = pytest.mark.skipif(mcore_optimizer is None, reason="megatron-core is not installed")

GRAD_SCALE = 1e4  # gradient norms of ~1e4-1e5: every clip coefficient is far below 1
MAX_NORM = 1.0


@pytest.fixture(scope="module")
def megatron_env():
    with megatron_cpu.single_rank_megatron():
        yield megatron_cpu


@pytest.fixture
def clean(megatron_env):
    integration.uninstall()
    yield
    integration.uninstall()


def _config(name, bf16, **fields):
    base = dict(optimizer=name, lr=0.02, min_lr=0.0, weight_decay=0.1, clip_grad=MAX_NORM, bf16=bf16, fp16=False,
                muon_fp32_matmul_prec="highest")
    if bf16:
        base["params_dtype"] = torch.bfloat16
    base.update(fields)
    return mcore_optimizer.OptimizerConfig(**base)


def _large_grads(model, seed):
    """Backward on random tokens, gradients scaled by GRAD_SCALE into fp32 ``main_grad`` (the
    reference's hand clip then rounds exactly as the optimizer wrapper's own clip would)."""
    megatron_cpu.forward_backward(model, seed)
    grads = {}
    for name, p in model.named_parameters():
        p.main_grad = p.grad.float() * GRAD_SCALE
        grads[name] = p.main_grad.double()
    return grads


def _model_params(wrapper):
    """The model's parameters a Megatron optimizer wrapper updates (bf16 ones through fp32 copies)."""
    if hasattr(wrapper, "float16_groups"):
        return [p for groups in (wrapper.float16_groups, wrapper.fp32_from_fp32_groups) for g in groups for p in g]
    return [p for group in wrapper.optimizer.param_groups for p in group["params"]]


def _muon_names(model, chained):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for wrapper in chained.chained_optimizers
            if isinstance(wrapper.optimizer, OrthogonalizedOptimizer) for p in _model_params(wrapper)}


def _norm(grads, names):
    return float(torch.sqrt(sum((grads[n].square().sum() for n in names), torch.zeros((), dtype=torch.float64))))


def _hand_clipped_step(model, chained, grads, muon, policy, clip_by_norms):
    """The reference: the policy's clip by hand, then a step without clip. The coefficients come from
    ``clip_by_norms`` (the norms the step under test reported, fp32 sums), so that both runs scale
    the same gradients by the same numbers: AdaMuon's sign-like first steps would otherwise magnify
    the ~1e-7 between an fp32 and a float64 norm. Returns the float64 norms of the gradients."""
    adam = set(grads) - muon
    parts = {"muon": _norm(grads, muon), "adamw": _norm(grads, adam)}
    total = (parts["muon"] ** 2 + parts["adamw"] ** 2) ** 0.5
    by = clip_by_norms
    clip_by = {n: by["total"] for n in grads} if policy == "global" else {n: by["adamw"] for n in adam}
    if policy == "separate":
        clip_by.update({n: by["muon"] for n in muon})
    for name, p in model.named_parameters():
        if name in clip_by:
            p.main_grad = p.main_grad * min(1.0, MAX_NORM / (clip_by[name] + 1e-6))
    assert chained.step()[0]
    return total, parts


def _run(name, bf16, policy, seed, steps=2, **fields):
    """(model, reference model, [(grad_norm, reference total, parts, reference parts)] per step)."""
    model, reference = megatron_cpu.build_gpt(seed, bf16=bf16), megatron_cpu.build_gpt(seed, bf16=bf16)
    integration.install(clip_policy=policy)
    with megatron_cpu.megatron_optimizer_on_cpu(), megatron_cpu.mixed_precision_wrapper_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config(name, bf16, **fields), [model])
        ref_chained = mcore_optimizer.get_megatron_optimizer(_config(name, bf16, clip_grad=0.0, **fields), [reference])
        muon = _muon_names(model, chained)
        assert muon and muon == _muon_names(reference, ref_chained)
        norms = []
        ours = dict(model.named_parameters())
        for step in range(steps):
            # both models step on the reference's gradients, so that differences cannot compound
            grads = _large_grads(reference, seed * 10 + step)
            for n, p in reference.named_parameters():
                ours[n].main_grad = p.main_grad.clone()
            success, grad_norm, _ = chained.step()
            assert success
            parts = getattr(chained, "grad_norms_by_part", None)
            reported = {"total": grad_norm, **(parts or {})}
            ref_total, ref_parts = _hand_clipped_step(reference, ref_chained, grads, muon, policy, reported)
            norms.append((grad_norm, ref_total, parts, ref_parts))
    return model, reference, norms


@pytest.mark.parametrize("name, bf16, policy", [
    ("muon", False, "adamw"),
    ("muon", True, "separate"),
    ("adaptive_muon", False, "separate"),
    ("adaptive_muon", True, "adamw"),
    ("muon", False, "global"),
])
def test_policy_clips_each_part_as_the_hand_clipped_reference(clean, name, bf16, policy):
    """After two steps the parameters equal the reference's (the same coefficients, from the reported
    norms); the reported norm is the total norm of all gradients and the parts' norms, on the
    optimizer, are those of the Muon and the other gradients (against float64). "global" is
    Megatron-LM's own step (it needs the CPU stand-ins of megatron_cpu for its CUDA-typed clip)."""
    start = {n: p.detach().clone() for n, p in megatron_cpu.build_gpt(3, bf16=bf16).named_parameters()}
    model, reference, norms = _run(name, bf16, policy, seed=3)
    for grad_norm, ref_total, parts, ref_parts in norms:
        assert ref_total > 100 * MAX_NORM
        assert grad_norm == pytest.approx(ref_total, rel=1e-5)
        if policy != "global":
            assert parts["muon"] == pytest.approx(ref_parts["muon"], rel=1e-5)
            assert parts["adamw"] == pytest.approx(ref_parts["adamw"], rel=1e-5)
    ref = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        if bf16:  # bf16 parameters round fp32 main parameters that agree to ~1e-6: a bf16 ulp at most
            torch.testing.assert_close(p.detach().float(), ref[n].detach().float(), rtol=8e-3, atol=1e-5,
                                       msg=lambda m, n=n: f"{n}: {m}")
        else:  # the update, normwise: the same arithmetic but the clip's coefficient, which ours
            # applies to the fp32 gradients in one foreach multiply as the reference's tensor multiply
            delta, ref_delta = p.detach() - start[n], ref[n].detach() - start[n]
            assert float((delta - ref_delta).norm()) <= 1e-6 * float(ref_delta.norm()), n


def test_the_policies_differ_where_it_matters(clean):
    """The test above can fail: "global" and "adamw" move the Muon matrices differently when the
    clip coefficient is tiny (the momentum sees 1e-5 x the gradient under "global")."""
    a, _, _ = _run("muon", False, "adamw", seed=5, steps=2)
    g, _, _ = _run("muon", False, "global", seed=5, steps=2)
    diffs = [(pa - pg).abs().max() for (n, pa), (_, pg) in zip(a.named_parameters(), g.named_parameters())
             if "linear_fc1" in n]
    assert max(float(d) for d in diffs) > 1e-4


def test_config_attribute_chooses_the_policy_and_is_checked(clean):
    model = megatron_cpu.build_gpt(1)
    integration.install()
    assert megatron_clipping.policy() == "adamw"
    with megatron_cpu.megatron_optimizer_on_cpu():
        config = _config("muon", False)
        config.muon_clip_policy = "global?"
        chained = mcore_optimizer.get_megatron_optimizer(config, [model])
        _large_grads(model, 11)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="OptimizerConfig.muon_clip_policy"):
            chained.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        chained.config.muon_clip_policy = "separate"
        assert chained.step()[0]
        muon_main_grads = [p.grad for w in chained.chained_optimizers if isinstance(w.optimizer, OrthogonalizedOptimizer)
                           for p in w.get_parameters()]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in muon_main_grads]))
        assert float(norm) == pytest.approx(MAX_NORM, rel=1e-4)  # "separate" clipped Muon's part to max_norm


def test_skip_threshold_compares_the_total_norm(clean):
    """grad_norm_skip_threshold between the AdamW part's norm and the total: Megatron skips the
    update (it compares the total norm), and so does the Muon-aware step."""
    model = megatron_cpu.build_gpt(2)
    integration.install()
    with megatron_cpu.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config("muon", False), [model])
        grads = _large_grads(model, 21)
        muon = _muon_names(model, chained)
        adam_norm, total = _norm(grads, set(grads) - muon), _norm(grads, set(grads))
        assert adam_norm < total
        for wrapper in chained.chained_optimizers:
            wrapper.config.grad_norm_skip_threshold = (adam_norm + total) / 2
        before = [p.detach().clone() for p in model.parameters()]
        success, grad_norm, _ = chained.step()
        assert not success and grad_norm == pytest.approx(total, rel=1e-5)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        for wrapper in chained.chained_optimizers:
            wrapper.config.grad_norm_skip_threshold = 2 * total
        _large_grads(model, 21)
        assert chained.step()[0]


def test_install_checks_the_policy_and_uninstall_restores_megatrons_step(clean):
    chained_class = mcore_optimizer.ChainedOptimizer
    original = chained_class.step
    with pytest.raises(ValueError, match="clip_policy"):
        integration.install(clip_policy="muon")
    assert integration.installed() == [] and chained_class.step is original
    integration.install(clip_policy="separate")
    assert chained_class.step is megatron_clipping.muon_aware_step
    integration.install(["muon"])  # left out, the earlier choice stays
    assert megatron_clipping.policy() == "separate"
    integration.uninstall()
    assert chained_class.step is original and megatron_clipping.policy() == "adamw"


def test_a_chain_without_orthogonalized_optimizers_takes_megatrons_step(clean, monkeypatch):
    calls = []
    original = mcore_optimizer.ChainedOptimizer.step
    integration.install()
    monkeypatch.setitem(megatron_clipping._STATE, "original", lambda self: calls.append(self) or original(self))
    model = megatron_cpu.build_gpt(4)
    with megatron_cpu.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config("muon", False, clip_grad=0.0), [model])
        adam_only = mcore_optimizer.ChainedOptimizer(
            [w for w in chained.chained_optimizers if not isinstance(w.optimizer, OrthogonalizedOptimizer)])
        megatron_cpu.forward_backward(model, 41)
        assert adam_only.step()[0]
        assert calls == [adam_only]
        assert chained.step()[0]
    assert calls == [adam_only]


@pytest.mark.distributed
def test_layer_wise_optimizer_on_two_ranks_reduces_norms_over_the_world(tmp_path, gen):
    """Megatron's layer-wise optimizer (each rank owns whole parameters) under the "adamw" policy:
    the same norms, parts and parameters as the one-rank chained optimizer on the same gradients."""
    import torch.multiprocessing as mp

    import megatron_clipping_worker as worker

    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    rendezvous = os.path.join(str(tmp_path), "rendezvous")
    mp.spawn(worker.layer_wise_worker, args=(2, rendezvous, seed), nprocs=2, join=True)
