"""nd_mode on plain tensors (docs/design.md §5): "batch" steps every leading-dim slice as its own Muon matrix,
"flatten" steps the (size(0), -1) view, "error" (default) rejects params that are not 2-D."""

import copy

import pytest
import torch

from megatron_eopt.optim import AdaptiveMuon, Muon
from reference import rel_err

OPTIMIZERS = [
    (Muon, {}),
    (AdaptiveMuon, dict(moment2_method="adamuon")),
    (AdaptiveMuon, dict(moment2_method="normuon")),
    (AdaptiveMuon, dict(moment2_method="namo")),
]
KW = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest")
STEPS = 3


def _steps(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("cls,extra", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_batch_equals_each_slice_as_its_own_matrix(cls, extra, gen):
    # MoE experts (E, m, n), a 4-D stack and a 2-D matrix of a shape one expert also has: the
    # slices of one shape run in one batched Newton–Schulz with the 2-D matrices of that shape.
    shapes = [(5, 12, 7), (2, 3, 7, 12), (12, 7)]
    full = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    params = [torch.nn.Parameter(t.clone()) for t in full]
    _steps(cls(params, nd_mode="batch", **KW, **extra), params, grads)

    def slices(t):
        return list(t.reshape(-1, *t.shape[-2:]).unbind(0))

    ref = [torch.nn.Parameter(s.clone()) for t in full for s in slices(t)]
    ref_opt = cls(ref, **KW, **extra)
    _steps(ref_opt, ref, [[s for g in gs for s in slices(g)] for gs in grads])
    got = [s for p in params for s in slices(p.detach())]
    start = [s for t in full for s in slices(t)]
    for i, (a, b, s) in enumerate(zip(got, ref, start)):
        assert rel_err(a - s, b.detach() - s) <= 1e-6, f"slice {i}"


@pytest.mark.parametrize("cls,extra", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_flatten_equals_the_matrix_view(cls, extra, gen):
    conv = torch.randn(8, 3, 3, 3, generator=gen)
    grads = [[torch.randn(conv.shape, generator=gen)] for _ in range(STEPS)]
    p = torch.nn.Parameter(conv.clone())
    opt = cls([p], nd_mode="flatten", **KW, **extra)
    _steps(opt, [p], grads)
    r = torch.nn.Parameter(conv.view(8, -1).clone())
    _steps(cls([r], **KW, **extra), [r], [[g[0].view(8, -1)] for g in grads])
    assert rel_err(p.detach().view(8, -1) - conv.view(8, -1), r.detach() - conv.view(8, -1)) <= 1e-6
    assert opt.state[p]["momentum_buffer"].shape == conv.shape


def test_nd_mode_per_param_group_and_state_dict_round_trip(gen):
    experts = torch.nn.Parameter(torch.randn(4, 6, 10, generator=gen))
    dense = torch.nn.Parameter(torch.randn(10, 6, generator=gen))
    groups = [{"params": [experts], "nd_mode": "batch"}, {"params": [dense]}]
    opt = AdaptiveMuon(groups, moment2_method="normuon", **KW)
    for p in (experts, dense):
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert opt.state[experts]["moment2_buffer"].shape == (4, 1, 10)  # per expert, over the longer side
    # The saved state continues exactly in a fresh optimizer.
    clone = [torch.nn.Parameter(p.detach().clone()) for p in (experts, dense)]
    other = AdaptiveMuon([{"params": [clone[0]], "nd_mode": "batch"}, {"params": [clone[1]]}],
                         moment2_method="normuon", **KW)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict shares same-device tensors
    for p, c in zip((experts, dense), clone):
        c.grad = torch.randn(p.shape, generator=gen)
        p.grad = c.grad.clone()
    opt.step()
    other.step()
    for p, c in zip((experts, dense), clone):
        assert torch.equal(p.detach(), c.detach())


def test_bad_nd_input_is_rejected_before_anything_changes(gen):
    cube = torch.nn.Parameter(torch.randn(2, 4, 4, generator=gen))
    opt = Muon([cube])  # nd_mode="error": refused at step(), where Emerging-Optimizers refuses it
    cube.grad = torch.randn_like(cube)
    before = cube.detach().clone()
    with pytest.raises(ValueError, match=r"params'\]\[0\] has shape \(2, 4, 4\).*nd_mode='batch'"):
        opt.step()
    assert torch.equal(cube.detach(), before) and not opt.state
    with pytest.raises(ValueError, match="nd_mode must be one of"):
        Muon([cube], nd_mode="stack")
    vector = torch.nn.Parameter(torch.randn(4))
    vector.grad = torch.randn(4)
    with pytest.raises(ValueError, match="0-D/1-D"):
        Muon([vector], nd_mode="batch").step()
    w = torch.nn.Parameter(torch.randn(4, 4, generator=gen))
    opt = Muon([w])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['nd_mode'\]"):
        opt.add_param_group({"params": [cube], "nd_mode": "stacked"})
    with pytest.raises(ValueError, match="cannot be viewed"):
        Muon([torch.nn.Parameter(torch.randn(4, 3, 5).transpose(0, 1))], nd_mode="flatten")
    assert len(opt.param_groups) == 1 and not opt.state


def test_orthogonalize_extension_point_with_batched_experts(gen):
    """An orthogonalize() override that defers to the base class gives the batched step's result, and a
    direct call on an (E, m, n) input returns every expert's scaled update."""

    class Deferring(Muon):
        def orthogonalize(self, p, grad, **kwargs):
            return super().orthogonalize(p, grad, **kwargs)

    experts = torch.randn(3, 5, 8, generator=gen)
    grads = [[torch.randn(experts.shape, generator=gen)] for _ in range(2)]
    a, b = torch.nn.Parameter(experts.clone()), torch.nn.Parameter(experts.clone())
    opt = Muon([a], nd_mode="batch", **KW)
    _steps(opt, [a], grads)
    _steps(Deferring([b], nd_mode="batch", **KW), [b], grads)
    assert rel_err(b.detach() - experts, a.detach() - experts) <= 1e-6
    g = torch.randn(experts.shape, generator=gen)
    out = opt.orthogonalize(a, g)
    single = Muon([torch.nn.Parameter(torch.randn(5, 8))], **KW)
    for e in range(3):
        assert rel_err(out[e], single.orthogonalize(single.param_groups[0]["params"][0], g[e])) <= 1e-6
