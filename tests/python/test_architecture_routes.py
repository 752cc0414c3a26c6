"""Every architecture of transformers 5.24 that builds tiny on CPU
(tests/python/support/architecture_configs.py), routed by build_optimizers' rules with its forward
traced: each parameter's optimizer, param-group keys, (out, in) matrices and scale against
tests/python/support/architecture_routes.py, a table written from the modeling code; and Muon
updates equal to per-block Muon on a sample of each layout."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from architecture_configs import ARCH_CONFIGS, build  # noqa: E402
from architecture_routes import ARCH_ROUTES, WARNINGS, expected  # noqa: E402

from megatron_eopt import build_optimizers, route_parameters  # noqa: E402
from megatron_eopt.optim import Muon  # noqa: E402
from optim_helpers import matrix_blocks  # noqa: E402


def _route(arch, **kw):
    model, inputs = build(arch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table, _ = route_parameters(model, example_inputs=inputs, **kw)
    said = [str(w.message) for w in caught if "rout" in str(w.message) or "trace" in str(w.message)]
    return model, inputs, table, said


def matrices(shape, keys):
    """(count, [(out, in)]) of a stored shape under param-group keys, from the keys' definitions
    (megatron_eopt.optim.matrix_view), not from the routing's own MatrixView."""
    shape = tuple(shape)
    if keys.get("nd_mode") == "flatten":
        shape = (shape[0], math.prod(shape[1:]))
    count = math.prod(shape[:-2]) if keys.get("nd_mode") == "batch" else 1
    out, inp = (shape[-1], shape[-2]) if keys.get("matrix_layout") == "in_out" else (shape[-2], shape[-1])
    split = keys.get("split_shapes")
    if split is None:
        return count, [(out, inp)]
    assert out % sum(split) == 0, (shape, keys)
    groups = out // sum(split)
    return count, [(groups * s, inp) for s in split]


def test_the_table_covers_every_configured_architecture():
    assert set(ARCH_ROUTES) == set(ARCH_CONFIGS)
    assert len(ARCH_CONFIGS) >= 75


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_route_view_and_scale_of_every_parameter(arch):
    model, _, table, said = _route(arch)
    wrong = []
    for r in table:
        want = expected(arch, r.name)
        if want is None:
            wrong.append(f"{r.name}: no row ({r.optimizer}, {r.reason})")
            continue
        if r.optimizer != want[0]:
            wrong.append(f"{r.name} {r.shape}: {r.optimizer} ({r.reason}), the code says {want[0]}")
            continue
        if want[0] == "adamw":
            if want[1] not in r.reason:
                wrong.append(f"{r.name}: reason {r.reason!r} lacks {want[1]!r}")
            continue
        if want[0] != "muon":
            continue
        if dict(r.group_keys) != want[1]:
            wrong.append(f"{r.name} {r.shape}: keys {dict(r.group_keys)} ({r.reason}), the code says {want[1]}")
            continue
        count, parts = matrices(r.shape, want[1])
        scales = " / ".join(f"{math.sqrt(max(1.0, o / i)):.3g}" for o, i in parts)
        if r.scale != scales:
            wrong.append(f"{r.name}: scale {r.scale}, want {scales}")
        if r.source not in ("use", "override") and not r.name.endswith(("bias",)):
            wrong.append(f"{r.name}: Muon route read from {r.source}, not from the use")
    assert not wrong, "\n".join(wrong)
    want = WARNINGS.get(arch, ())
    assert all(any(w in s for s in said) for w in want) and all(any(w in s for w in want) for s in said), said


# One weight of each layout: fused [Q; K; V] blocks (GQA sizes), per head, multi-query, Conv1D columns,
# gate/up blocks and interleaved, experts (E, out, in) and (E, in, out), a projection grouped per key
# head, a 2-D stack of experts, an einsum weight of three dims, a split part split again (Mamba2's xBC).
SAMPLES = {
    "phi3": "model.layers.0.self_attn.qkv_proj.weight",
    "gpt_neox": "gpt_neox.layers.0.attention.query_key_value.weight",
    "gpt_bigcode": "transformer.h.0.attn.c_attn.weight",
    "falcon_new": "transformer.h.0.self_attention.query_key_value.weight",
    "gpt2": "transformer.h.0.attn.c_attn.weight",
    "glm4": "model.layers.0.mlp.gate_up_proj.weight",
    "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj",
    "qwen3_moe": "model.layers.0.mlp.experts.gate_up_proj",
    "llama4_text": "model.layers.0.feed_forward.experts.down_proj",
    "qwen3_next": "model.layers.0.linear_attn.in_proj_qkvz.weight",
    "dbrx": "transformer.blocks.0.ffn.experts.mlp.w1",
    "xlnet": "transformer.layer.0.rel_attn.q",
    "jetmoe": "model.layers.0.mlp.input_linear.weight",
    "mamba2": "backbone.layers.0.mixer.in_proj.weight",
}


@pytest.mark.parametrize("arch", sorted(SAMPLES))
def test_updates_equal_per_block_muon(arch):
    """Two Muon steps of the routed optimizer on the sampled weight equal Muon run on each of its
    (out, in) blocks as a parameter of its own (fp32, "highest" matmul precision, within 1e-6)."""
    name = SAMPLES[arch]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        model, inputs = build(arch)
        kw = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (muon, *_), table = build_optimizers(model, example_inputs=inputs, muon_lr=kw["lr"],
                                                 momentum=kw["momentum"], weight_decay=kw["weight_decay"],
                                                 muon_kwargs=dict(fp32_matmul_prec="highest"))
        route = table[name]
        keys = expected(arch, name)[1]
        assert route.optimizer == "muon" and dict(route.group_keys) == keys
        param = dict(model.named_parameters())[name]
        ref_params = [torch.nn.Parameter(b.detach().clone().contiguous()) for b in matrix_blocks(param, keys)]
        assert len(ref_params) > 1 or keys.get("nd_mode") == "flatten"
        ref = Muon(ref_params, scale_mode="shape_scaling", fp32_matmul_prec="highest", **kw)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            for r, b in zip(ref_params, matrix_blocks(param.grad, keys)):
                r.grad = b.contiguous().clone()
            muon.step()
            ref.step()
        for got, want in zip(matrix_blocks(param.detach(), keys), ref_params):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("arch, pattern", [("mamba", r"A_log"), ("jamba", r"A_log"), ("zamba", r"A_log|\.D$|dt_proj_bias"),
                                           ("swin", r"relative_position_bias_table"), ("xlnet", r"r_\w_bias|seg_embed"),
                                           ("recurrent_gemma", r"gate_bias")])
def test_tables_alone_keep_non_matrices_of_two_dims_off_muon(arch, pattern):
    """Without a trace (example_inputs=False, or a forward that cannot run), the module
    tables still send these weights of two or more dims, used elementwise or as a lookup, to AdamW."""
    import re

    model, _ = build(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table, _ = route_parameters(model, example_inputs=False)
    hits = [r for r in table if re.search(pattern, r.name) and len(r.shape) >= 2]
    assert hits and all(r.optimizer == "adamw" and r.source == "table" for r in hits), [
        (r.name, r.optimizer, r.reason) for r in hits]
