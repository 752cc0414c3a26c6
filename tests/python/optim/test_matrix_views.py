"""The ``matrix_layout`` and ``split_shapes`` param-group keys: a weight stored (in, out), a fused
projection split into parts, per expert of a 3-D weight, equal per-matrix Muon on the (out, in)
matrices those keys describe (fp32 "highest"), and bad values refused naming the key."""

from __future__ import annotations

import pytest
import torch

from megatron_eopt.optim import AdaptiveMuon, HybridMuon, Muon

from reference import newton_schulz_ref


def components(t: torch.Tensor, layout: str, split, batch: bool) -> list[torch.Tensor]:
    """The (out, in) matrices a weight holds under a view: views of ``t`` (strided)."""
    mats = list(t.unbind(0)) if batch else [t]
    out = []
    for m in mats:
        m = m.mT if layout == "in_out" else m
        if split is None:
            out.append(m)
            continue
        total = sum(split)
        g = m.unflatten(0, (m.shape[0] // total, total))
        offset = 0
        for size in split:
            out.append(g[:, offset : offset + size].flatten(0, 1))
            offset += size
    return out


CASES = [
    # (stored shape, matrix_layout, split_shapes, nd_mode): GPT-2 c_fc, c_attn, NeoX QKV, experts
    ((8, 24), "in_out", None, "error"),  # Conv1D (in, out): scale from (24, 8)
    ((24, 8), "in_out", None, "error"),
    ((8, 24), "in_out", (8, 8, 8), "error"),  # GPT-2 c_attn: [Q | K | V] columns
    ((24, 8), "out_in", (2, 2, 2), "error"),  # GPT-NeoX: per head [q_h; k_h; v_h], 4 heads
    ((10, 7), "out_in", (3, 1, 1), "error"),  # GQA groups, primes
    ((3, 12, 8), "out_in", (6, 6), "batch"),  # Qwen3-MoE / Mixtral experts gate_up (E, 2I, H)
    ((3, 8, 12), "in_out", (1, 1), "batch"),  # gpt-oss experts gate_up (E, H, 2I), interleaved
    ((3, 6, 8), "in_out", None, "batch"),  # gpt-oss down_proj (E, I, H)
    ((1, 9), "in_out", None, "error"),  # a 9 x 1 matrix stored (1, 9)
]


def _group(p, layout, split, nd_mode):
    g = {"params": [p], "matrix_layout": layout, "nd_mode": nd_mode}
    if split is not None:
        g["split_shapes"] = list(split)
    return g


@pytest.mark.parametrize("shape,layout,split,nd_mode", CASES)
@pytest.mark.parametrize("cls", ["muon", "normuon", "adamuon", "hybrid"])
def test_view_equals_per_matrix_muon(shape, layout, split, nd_mode, cls):
    torch.manual_seed(sum(shape) + len(cls))
    batch = nd_mode == "batch"
    w = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    p = torch.nn.Parameter(w.clone())
    # Muon: each part its own matrix. The adaptive classes normalize the whole fused projection
    # (docs/design.md §4.8), so theirs is the (out, in) matrix of each expert with the same split.
    per_part = cls in ("muon", "hybrid") or split is None
    ref_split = split if per_part else None

    def reference_view(t):
        return components(t, layout, ref_split, batch)

    refs = [torch.nn.Parameter(c.detach().clone().contiguous()) for c in reference_view(w)]
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.05, nesterov=True, fp32_matmul_prec="highest",
              scale_mode="shape_scaling")

    def make(groups):
        if cls == "muon":
            return Muon(groups, **kw)
        if cls == "hybrid":
            return HybridMuon([dict(g, use_muon=True) for g in groups], **kw)
        return AdaptiveMuon(groups, moment2_method=cls, **kw)

    opt = make([_group(p, layout, split, nd_mode)])
    ref = make([{"params": refs} if per_part else {"params": refs, "split_shapes": list(split)}])
    for g in grads:
        p.grad = g.clone()
        for r, c in zip(refs, reference_view(g)):
            r.grad = c.contiguous().clone()
        opt.step()
        ref.step()
    for got, want in zip(reference_view(p.detach()), refs):
        torch.testing.assert_close(got, want.detach(), rtol=2e-6, atol=2e-6)
    # The state round-trips with the keys (a checkpoint keeps the view).
    sd = opt.state_dict()
    assert sd["param_groups"][0]["matrix_layout"] == layout
    opt2 = make([_group(torch.nn.Parameter(p.detach().clone()), layout, split, nd_mode)])
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0].get("split_shapes") == (None if split is None else list(split))


def test_conv1d_c_attn_float64_reference():
    """One Muon step of a GPT-2 c_attn stored (d, 3d), against a float64 reference written from the
    rule: each of Q, K, V (columns) orthogonalized as a (d, d) matrix, scale sqrt(max(1, d / d)) = 1."""
    torch.manual_seed(0)
    d = 12
    w = torch.randn(d, 3 * d)
    g = torch.randn(d, 3 * d)
    p = torch.nn.Parameter(w.clone())
    opt = Muon([{"params": [p], "matrix_layout": "in_out", "split_shapes": [d, d, d]}], lr=0.1, momentum=0.0,
               weight_decay=0.0, fp32_matmul_prec="highest", scale_mode="shape_scaling")
    p.grad = g.clone()
    opt.step()
    want = w.double().clone()
    for part in range(3):
        cols = slice(part * d, (part + 1) * d)
        o = newton_schulz_ref(g[:, cols].mT.double()).mT  # the (out, in) part, orthogonalized
        want[:, cols] -= 0.1 * o
    torch.testing.assert_close(p.detach().double(), want, rtol=0, atol=5e-6)


def test_conv1d_scale_is_the_out_in_one():
    """GPT-2's c_fc stored (d, 4d) is a (4d, d) matrix: shape_scaling gives sqrt(4) = 2, not 1."""
    torch.manual_seed(1)
    g = torch.randn(8, 32)
    updates = {}
    for layout in ("out_in", "in_out"):
        p = torch.nn.Parameter(torch.zeros(8, 32))
        opt = Muon([{"params": [p], "matrix_layout": layout}], lr=1.0, momentum=0.0, weight_decay=0.0,
                   fp32_matmul_prec="highest", scale_mode="shape_scaling")
        p.grad = g.clone()
        opt.step()
        updates[layout] = -p.detach()
    torch.testing.assert_close(updates["in_out"], 2.0 * updates["out_in"])


@pytest.mark.parametrize("key,value,match", [
    ("matrix_layout", "io", r"param_groups\[0\]\['matrix_layout'\] must be one of"),
    ("split_shapes", [4, 0], r"param_groups\[0\]\['split_shapes'\] must be a non-empty list"),
    ("split_shapes", [5, 5], r"QKV split shape mismatch: rows 8"),
])
def test_bad_view_keys_are_refused(key, value, match):
    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [p], key: value}], lr=0.1)


def test_in_out_split_mismatch_names_columns():
    p = torch.nn.Parameter(torch.randn(8, 9))
    with pytest.raises(ValueError, match=r"columns \(matrix_layout='in_out'\) 9"):
        Muon([{"params": [p], "matrix_layout": "in_out", "split_shapes": [2, 2]}], lr=0.1)


def test_split_shapes_and_torch_front_split_heads_disagree():
    from megatron_eopt.torch_optim import Muon as TorchFrontMuon

    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"'split_shapes'\] = \[4, 4\] and the optimizer's own split"):
        TorchFrontMuon([{"params": [p], "split_heads": 4, "split_shapes": [4, 4]}], lr=0.1)
