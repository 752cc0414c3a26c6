"""``overlap_backward=True``: momentum and Newton–Schulz start during ``loss.backward()`` as each
chunk's gradients become final, ``step()`` applies the updates; the results are bitwise those of
the same optimizer without overlap, and what cannot be reproduced is refused (step.overlap). The
multi-rank cases (FSDP2, tensor parallel) run on gloo ranks: overlap_worker.py."""

from __future__ import annotations

import copy
import os
import pickle
import warnings

import pytest
import torch
import torch.multiprocessing as mp


import overlap_worker  # noqa: E402
from megatron_eopt import clipping  # noqa: E402
from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelAdaptiveMuon, TensorParallelMuon  # noqa: E402
from megatron_eopt.optim.weight_update_hooks import HyperballHook  # noqa: E402

# Tall, wide, square, a prime side, 1×n and n×1, a repeated shape (stacked with its twin).
SHAPES = [(24, 16), (16, 40), (16, 16), (13, 29), (1, 12), (12, 1), (24, 16)]
ONE_MATRIX_MIB = 0.01  # every chunk one matrix: each starts as soon as its gradient is final


def _params(gen, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]


def _backward(params, grads, scale=1.0):
    """One backward pass whose gradients are exactly ``grads`` times ``scale`` (the hooks fire as in
    training, in reverse order of use)."""
    loss = sum((p * g).sum() for p, g in zip(params, grads)) * scale
    loss.backward()


def _run(build, steps=3, seed=0, shapes=SHAPES, skip=(), micro=1):
    """Params and optimizer after ``steps`` steps of backward + step; ``skip``: params unused (no
    grad); ``micro``: micro-batches per step (the non-final ones inside ``accumulating()``)."""
    gen = torch.Generator().manual_seed(seed)
    params = _params(gen, shapes)
    opt = build(params)
    for _ in range(steps):
        opt.zero_grad()
        used = [p for i, p in enumerate(params) if i not in skip]
        for k in range(micro):
            grads = [torch.randn(p.shape, generator=gen) for p in used]
            if k < micro - 1:
                with opt.accumulating():
                    _backward(used, grads)
            else:
                _backward(used, grads)
        opt.step()
    return params, opt


def _assert_same(a, b, opt_a, opt_b):
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"param {i} differs"
        for key, value in opt_a.state[p].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(opt_b.state[q][key], value), f"param {i} state {key} differs"


BUILDERS = {
    "Muon": lambda ov: lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB),
    "Muon nesterov l2 one chunk": lambda ov: lambda ps: Muon(ps, lr=0.02, nesterov=True, weight_decay_method="l2",
                                                               overlap_backward=ov),
    "Muon bf16 state": lambda ov: lambda ps: Muon(ps, lr=0.02, state_dtype="bf16", overlap_backward=ov,
                                                  workspace_mib=ONE_MATRIX_MIB),
    "Muon hyperball hook": lambda ov: lambda ps: Muon(ps, lr=0.02, weight_update_hook=HyperballHook(radius=1.0),
                                                      overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB),
    "AdaMuon": lambda ov: lambda ps: AdaptiveMuon(ps, lr=0.02, momentum=0.9, weight_decay=0.1, overlap_backward=ov,
                                                  workspace_mib=ONE_MATRIX_MIB),
    "NorMuon": lambda ov: lambda ps: AdaptiveMuon(ps, lr=0.02, momentum=0.9, weight_decay=0.1,
                                                  moment2_method="normuon", overlap_backward=ov,
                                                  workspace_mib=ONE_MATRIX_MIB),
    "NAMO": lambda ov: lambda ps: AdaptiveMuon(ps, lr=0.02, momentum=0.9, weight_decay=0.1, moment2_method="namo",
                                               overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB),
    "TensorParallelMuon": lambda ov: lambda ps: TensorParallelMuon(ps, lr=0.02, overlap_backward=ov,
                                                                   workspace_mib=ONE_MATRIX_MIB),
    "TensorParallelAdaptiveMuon": lambda ov: lambda ps: TensorParallelAdaptiveMuon(
        ps, lr=0.02, moment2_method="normuon", overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_overlapped_steps_equal_the_plain_steps_bitwise(name):
    a, opt_a = _run(BUILDERS[name](False))
    b, opt_b = _run(BUILDERS[name](True))
    _assert_same(a, b, opt_a, opt_b)
    stats = opt_b.step_stats()
    assert stats["seconds_before_step"] is not None and stats["seconds_before_step"] > 0
    assert opt_a.step_stats()["seconds_before_step"] is None
    for key in ("ns_matrices", "ns_flops", "collectives", "bytes_sent"):
        assert stats[key] == opt_a.step_stats()[key], key


def test_the_work_starts_during_backward_chunk_by_chunk():
    gen = torch.Generator().manual_seed(1)
    params = _params(gen)
    opt = Muon(params, lr=0.02, overlap_backward=True, workspace_mib=ONE_MATRIX_MIB)
    assert len(opt._plan.chunks) > 1
    before = [p.detach().clone() for p in params]
    _backward(params[:3], [torch.randn(p.shape, generator=gen) for p in params[:3]])
    work = opt._overlap.work
    assert work is not None and len(work.started) >= 1  # chunks of the first three matrices
    assert all(torch.equal(p, q) for p, q in zip(params, before))  # nothing applied before step()
    opt._overlap.wait()
    assert all("momentum_buffer" in opt.state[p] for p in params[:3])
    opt.step()
    assert opt._overlap.work is None
    assert not torch.equal(params[0], before[0]) and torch.equal(params[4], before[4])


@pytest.mark.parametrize("name", ["Muon", "NorMuon"])
def test_params_without_a_grad_and_chunks_left_for_step(name):
    a, opt_a = _run(BUILDERS[name](False), skip=(1, 5))
    b, opt_b = _run(BUILDERS[name](True), skip=(1, 5))
    _assert_same(a, b, opt_a, opt_b)


def test_accumulating_micro_batches_start_work_only_on_the_last():
    a, opt_a = _run(BUILDERS["Muon"](False), micro=3)
    b, opt_b = _run(BUILDERS["Muon"](True), micro=3)
    _assert_same(a, b, opt_a, opt_b)


def test_a_second_backward_into_a_consumed_gradient_is_refused_in_backward():
    gen = torch.Generator().manual_seed(2)
    params = _params(gen)
    opt = Muon(params, lr=0.02, overlap_backward=True)  # alive: the hooks hold it weakly
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    _backward(params, grads)
    with pytest.raises(RuntimeError, match="accumulating"):
        _backward(params, grads)
    assert opt._overlap.work is not None


def _after_backward(gen, **kwargs):
    params = _params(gen)
    opt = Muon(params, lr=0.02, overlap_backward=True, workspace_mib=ONE_MATRIX_MIB, **kwargs)
    _backward(params, [torch.randn(p.shape, generator=gen) for p in params])
    return params, opt


def test_a_gradient_changed_after_its_work_started_is_refused_before_any_update():
    gen = torch.Generator().manual_seed(3)
    params, opt = _after_backward(gen)
    before = [p.detach().clone() for p in params]
    torch.nn.utils.clip_grad_norm_(params, 1e-3)  # scales every gradient in place
    with pytest.raises(RuntimeError, match="changed after backward started"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.parametrize("policy", ["global", "separate"])
def test_clip_policies_that_scale_matrix_gradients_are_refused_before_clipping(policy):
    gen = torch.Generator().manual_seed(4)
    params, opt = _after_backward(gen)
    grads = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="overlap_backward"):
        clipping.clip_grad_norm_(opt, 1e-3, policy=policy)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def _same_with_and_without_overlap(seed, steps, between):
    """Muon with and without overlap, ``steps`` of backward, ``between(opt)``, step: the same params."""
    results = []
    for ov in (False, True):
        gen = torch.Generator().manual_seed(seed)
        params = _params(gen)
        opt = Muon(params, lr=0.02, overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB)
        for _ in range(steps):
            opt.zero_grad()
            _backward(params, [torch.randn(p.shape, generator=gen) for p in params])
            between(opt)
            opt.step()
        results.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_the_adamw_clip_policy_composes():
    _same_with_and_without_overlap(5, 2, lambda opt: clipping.clip_grad_norm_(opt, 1e-3, policy="adamw"))


def test_a_momentum_changed_between_backward_and_step_is_refused():
    gen = torch.Generator().manual_seed(6)
    params, opt = _after_backward(gen)
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['momentum'\] changed"):
        opt.step()


def test_a_learning_rate_changed_between_backward_and_step_applies():
    _same_with_and_without_overlap(7, 1, lambda opt: opt.param_groups[0].update(lr=0.005))


def test_grad_scaler_is_refused():
    gen = torch.Generator().manual_seed(8)
    params, opt = _after_backward(gen)
    opt.grad_scale = torch.ones(())
    opt.found_inf = torch.zeros(())
    try:
        with pytest.raises(RuntimeError, match="GradScaler"):
            opt.step()
    finally:
        del opt.grad_scale, opt.found_inf


def test_zero_grad_before_step_drops_the_work_with_a_warning():
    gen = torch.Generator().manual_seed(9)
    params, opt = _after_backward(gen)
    before = [p.detach().clone() for p in params]
    with pytest.warns(UserWarning, match="momentum of their matrices has advanced"):
        opt.zero_grad()
    opt.step()  # no grads: nothing to do
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    _backward(params, [torch.randn(p.shape, generator=gen) for p in params])
    opt.step()  # the next backward starts afresh
    assert not torch.equal(params[0], before[0])


def test_state_dict_round_trip_and_copies():
    a, opt_a = _run(BUILDERS["Muon"](True), steps=2)
    opt_a.zero_grad()
    sd = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = Muon(b, lr=0.02, weight_decay=0.1, overlap_backward=True, workspace_mib=ONE_MATRIX_MIB)
    opt_b.load_state_dict(copy.deepcopy(sd))
    # a plain optimizer loads an overlapped one's checkpoint and the other way round
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_c = Muon(c, lr=0.02, weight_decay=0.1, workspace_mib=ONE_MATRIX_MIB)
    opt_c.load_state_dict(copy.deepcopy(sd))
    model_copy = copy.deepcopy((a, opt_a))
    pickled = pickle.loads(pickle.dumps((a, opt_a)))
    gen = torch.Generator().manual_seed(10)
    grads = [torch.randn(p.shape, generator=gen) for p in a]
    for params, opt in ((a, opt_a), (b, opt_b), (c, opt_c), model_copy, pickled):
        _backward(params, grads)
        opt.step()
    for params, _ in ((b, opt_b), (c, opt_c), model_copy, pickled):
        assert all(torch.equal(p, q) for p, q in zip(params, a))
    assert pickled[1]._overlap is not opt_a._overlap and pickled[1]._overlap.work is None


def test_state_dict_between_backward_and_step_holds_the_advanced_momentum():
    gen = torch.Generator().manual_seed(11)
    params, opt = _after_backward(gen)
    sd = opt.state_dict()
    assert all("momentum_buffer" in s for s in sd["state"].values())
    opt.step()


def test_a_compiled_step_finishes_the_work():
    def build(ov):
        return lambda ps: Muon(ps, lr=0.02, overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB)

    results = []
    for ov, compiled in ((False, False), (True, True)):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(12)
        params = _params(gen)
        opt = build(ov)(params)
        step = torch.compile(opt.step) if compiled else opt.step
        for _ in range(2):
            opt.zero_grad()
            _backward(params, [torch.randn(p.shape, generator=gen) for p in params])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step()
        results.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_bad_values():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="overlap_backward"):
        Muon([p], overlap_backward="yes")
    plain = Muon([p])
    with plain.accumulating():  # a no-op without overlap
        pass
    assert plain.overlap_backward is False


def test_an_override_of_orthogonalize_runs_in_the_overlapped_work():
    class Doubled(Muon):
        def orthogonalize(self, p, grad, **kwargs):
            return super().orthogonalize(p, grad, **kwargs) * 2

    a, opt_a = _run(lambda ps: Doubled(ps, lr=0.02, workspace_mib=ONE_MATRIX_MIB))
    b, opt_b = _run(lambda ps: Doubled(ps, lr=0.02, overlap_backward=True, workspace_mib=ONE_MATRIX_MIB))
    _assert_same(a, b, opt_a, opt_b)


def test_fsdp2_and_tensor_parallel_ranks(tmp_path):
    mp.spawn(overlap_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous"), 0), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Muon", "NorMuon", "Muon bf16 state"])
def test_overlapped_steps_on_cuda_equal_the_plain_steps(name):
    """The side stream: the same bits as the plain step, with the work queued during backward."""
    results = []
    for ov in (False, True):
        gen = torch.Generator().manual_seed(13)
        params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(gen)]
        opt = BUILDERS[name](ov)(params)
        for _ in range(3):
            opt.zero_grad()
            _backward(params, [torch.randn(p.shape, generator=gen).cuda() for p in params])
            if ov:
                assert opt._overlap.work is not None and opt._overlap.work.started
            opt.step()
        torch.cuda.synchronize()
        results.append(params)
    for i, (p, q) in enumerate(zip(*results)):
        assert torch.equal(p, q), f"param {i} differs"


def test_gradients_that_share_one_buffer_are_not_mistaken_for_changed():
    """Views of one flat buffer share a version counter: a sibling's accumulation later in the same
    backward bumps it (FSDP2's grads of a group, flat gradient buffers)."""
    results = []
    for ov in (False, True):
        gen = torch.Generator().manual_seed(14)
        params = _params(gen)
        flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        opt = Muon(params, lr=0.02, overlap_backward=ov, workspace_mib=ONE_MATRIX_MIB)
        for _ in range(2):
            opt.zero_grad(set_to_none=False)
            _backward(params, [torch.randn(p.shape, generator=gen) for p in params])
            opt.step()
        results.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_a_workspace_changed_between_backward_and_step_keeps_the_started_chunks():
    _same_with_and_without_overlap(15, 2, lambda opt: setattr(opt, "workspace_mib", None))


def test_a_dropped_step_leaves_the_low_memory_seeds_as_a_skipped_step_does():
    results = []
    for ov in (False, True):
        gen = torch.Generator().manual_seed(16)
        params = _params(gen)
        opt = Muon(params, lr=0.02, state_dtype="bf16", overlap_backward=ov)  # one chunk
        for k in range(3):
            opt.zero_grad()
            used = params[:2] if k == 1 else params  # step 1: the chunk waits for grads that never come
            _backward(used, [torch.randn(p.shape, generator=gen) for p in used])
            if k == 1:
                opt.zero_grad()  # skipped: nothing had started, nothing to warn about
            else:
                opt.step()
        results.append((params, opt))
    (a, opt_a), (b, opt_b) = results
    _assert_same(a, b, opt_a, opt_b)


def test_hooks_follow_the_optimizer():
    import gc

    gen = torch.Generator().manual_seed(17)
    params = _params(gen)
    frozen = torch.nn.Parameter(torch.randn(8, 8, generator=gen), requires_grad=False)
    opt = Muon(params + [frozen], lr=0.02, overlap_backward=True)  # a frozen param gets no hook
    sd = copy.deepcopy(opt.state_dict())
    for _ in range(3):
        opt.load_state_dict(copy.deepcopy(sd))
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    del opt
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in params)


def test_a_momentum_given_as_a_tensor_of_the_same_value_is_no_change():
    gen = torch.Generator().manual_seed(18)
    params, opt = _after_backward(gen)
    opt.param_groups[0]["momentum"] = torch.tensor(0.95, dtype=torch.float64)  # (an fp32 0.95 is another value)
    opt.step()
