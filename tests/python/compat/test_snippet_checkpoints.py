"""megatron_eopt.muon.Muon and nanochat's Muon of 4ddc803: checkpoints cross in both directions.

nanochat's class is re-expressed here (float64 math) from its behaviour: a flat parameter list
regrouped by numel in the iteration order of the set of sizes, group keys lr / momentum /
nesterov / ns_steps (no weight decay), momentum_buffer shaped like the parameter, Nesterov
momentum, the simple quintic after dividing by ||X|| + 1e-7 (tall matrices transposed), and
p -= lr * sqrt(max(1, m / n)) * update.
"""

import copy
import warnings

import pytest
import torch

from megatron_eopt import muon as legacy
from optim_helpers import clone_params, run_steps
from reference import TOLERANCE, newton_schulz_ref, rel_err

SIMPLE = (3.4445, -4.7750, 2.0315)
# numels {32, 35, 32, 96, 35, 7}: several per size, sizes whose set order is not their first use
SHAPES = [(8, 4), (5, 7), (4, 8), (12, 8), (7, 5), (1, 7)]


class Nanochat4ddc803Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, dtype=torch.float64):
        params = list(params)
        groups = [dict(params=[p for p in params if p.numel() == n]) for n in {p.numel() for p in params}]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        self.dtype = dtype

    @staticmethod
    def orthogonalize(g, steps, dtype=torch.float64):
        """float64; or, with dtype bf16, the snippet's bf16 iteration as megatron_eopt.muon runs it
        (zeropower_via_newtonschulz5, held to float64 in test_legacy_muon), so that a comparison
        of two bf16 runs isolates the state rather than where two bf16 iterations round."""
        if dtype != torch.float64:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return legacy.zeropower_via_newtonschulz5(g.float(), steps).double()
        X = g.double()
        X = X / (X.norm() + 1e-7)
        tall = X.shape[0] > X.shape[1]
        if tall:
            X = X.T
        a, b, c = SIMPLE
        for _ in range(steps):
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        return X.T if tall else X

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = self.orthogonalize(g, group["ns_steps"], self.dtype)
                p.sub_((group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5 * update).to(p.dtype))


def _ours(params, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return legacy.Muon(params, **kwargs)


def _params(gen):
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def test_same_groups_and_indices_as_nanochat(gen):
    params = _params(gen)
    ours, theirs = _ours(params), Nanochat4ddc803Muon(params)
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs.param_groups]
    for a, b in zip(ours.param_groups, theirs.param_groups):
        assert all(p is q for p, q in zip(a["params"], b["params"]))
    assert [g["params"] for g in ours.state_dict()["param_groups"]] == \
        [g["params"] for g in theirs.state_dict()["param_groups"]]


@pytest.mark.parametrize("direction", ["ours_to_nanochat", "nanochat_to_ours"])
def test_checkpoints_cross_and_continue(direction, gen):
    params = _params(gen)
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]
    bf16 = torch.bfloat16  # the snippets' precision, on both sides: the comparison isolates the state
    make_first = (lambda ps: _ours(ps, lr=0.02, momentum=0.9)) if direction == "ours_to_nanochat" else \
        (lambda ps: Nanochat4ddc803Muon(ps, lr=0.02, momentum=0.9, dtype=bf16))
    first = make_first(params)
    for g in grads[:2]:
        run_steps(first, params, [g])
    saved = copy.deepcopy(first.state_dict())
    other = clone_params(params)
    second = Nanochat4ddc803Muon(other, lr=1.0, momentum=0.5, dtype=bf16) if direction == "ours_to_nanochat" else \
        _ours(other, lr=1.0, momentum=0.5)
    second.load_state_dict(saved)  # lr, momentum and the momentum buffers come from the checkpoint
    start = [p.detach().clone() for p in params]
    run_steps(first, params, [grads[2]])
    run_steps(second, other, [grads[2]])
    for p, q, s in zip(params, other, start):
        # both run Newton–Schulz in bf16, rounding at different places: docs/design.md §9's bf16 tolerance
        assert rel_err(q.detach() - s, p.detach() - s) <= TOLERANCE["medium"], tuple(p.shape)
    if direction == "nanochat_to_ours":
        # nanochat saved no weight_decay: the group gets the default (none), and steps
        assert all(g["weight_decay"] == 0.0 for g in second.param_groups)


def test_snippet_normalization_is_norm_plus_eps(gen):
    # a gradient of norm 1e-7: ||X|| + eps halves the first iterate, max(||X||, eps) would not
    g = torch.randn(6, 9, generator=gen)
    g = g / g.norm() * 1e-7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out = legacy.zeropower_via_newtonschulz5(g, 5).double()
    want = Nanochat4ddc803Muon.orthogonalize(g, 5)
    # bf16 against float64: §9's tolerance, or 1.5x the bf16 recipe's own error on this input
    # (half-norm singular values sit where the simple quintic amplifies rounding most)
    halved = (g.double() / (g.double().norm() + 1e-7)).float()
    recipe = newton_schulz_ref(halved, 5, "simple", eps=1e-30, dtype=torch.bfloat16)
    assert rel_err(out, want) <= max(TOLERANCE["medium"], 1.5 * rel_err(recipe, want))
    clamped = Nanochat4ddc803Muon.orthogonalize(g / g.norm() * (1e-7 + 1e-7), 5)  # what max() would give
    assert rel_err(out, clamped) > 0.1
