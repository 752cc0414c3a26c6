"""Routing read from how the forward uses each weight (megatron_eopt.param_use): hand-written modules
whose names no table knows, each layout routed right with the name patterns switched off, and one
Muon update equal to per-block Muon on the (out, in) blocks the module's code defines; tiny
transformers models audited against their modeling code; bad input refused by name."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_eopt import build_optimizers, muon_param_groups, route_parameters
from megatron_eopt.optim import Muon
from megatron_eopt.param_use import trace_parameter_uses

NO_NAMES = dict(embedding_patterns=(), head_patterns=())  # decisions from the use (and module types) only


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class FusedHeads(nn.Module):
    """A fused per-head QKV as a bare Parameter: rows [q_h; k_h; v_h] per head."""

    def __init__(self, c=16, heads=4):
        super().__init__()
        self.heads, self.d = heads, c // heads
        self.mix = nn.Parameter(torch.randn(3 * c, c) / 4)
        self.back = nn.Parameter(torch.randn(c, c) / 4)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = F.linear(x, self.mix).view(b, t, self.heads, 3, self.d).unbind(3)
        q, k = q * 2.0, rotate_half(k) + k  # rotary-like use of a part: the parts stay Q, K, V
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return x + F.linear(y.transpose(1, 2).reshape(b, t, c), self.back)


class Stacks(nn.Module):
    """(in, out) expert stacks used through bmm, a 2-D (E·f, H) stack viewed per expert, an elementwise
    2-D weight, an index-lookup table and a router."""

    def __init__(self, e=3, h=8, f=6, table=10):
        super().__init__()
        self.e, self.f = e, f
        self.ups = nn.Parameter(torch.randn(e, h, 2 * f) / 3)
        self.downs = nn.Parameter(torch.randn(e, f, h) / 3)
        self.flat = nn.Parameter(torch.randn(e * f, h) / 3)
        self.decay = nn.Parameter(torch.randn(4, h))
        self.table = nn.Parameter(torch.randn(table, h))
        self.pick = nn.Parameter(torch.randn(e, h))

    def forward(self, x, idx):
        b, t, h = x.shape
        weights, chosen = torch.softmax(F.linear(x, self.pick), -1).topk(2)
        tokens = x.reshape(1, b * t, h).expand(self.e, b * t, h)
        gate, up = torch.bmm(tokens, self.ups).chunk(2, -1)
        y = torch.bmm(F.silu(gate) * up, self.downs).sum(0).view(b, t, h)
        per_expert = self.flat.view(self.e, self.f, h)
        z = sum(F.relu(x @ per_expert[i].T).sum(-1, keepdim=True) for i in range(self.e))
        return y * weights[..., :1] + z * (-torch.exp(self.decay)).sum(0) + self.table[idx]


class GatedMLP(nn.Module):
    """A fused gate/up nn.Linear chunked in two halves, and one interleaved (gate, up, gate, up, ...)."""

    def __init__(self, h=8, i=12):
        super().__init__()
        self.wi = nn.Linear(h, 2 * i, bias=False)
        self.wi2 = nn.Linear(h, 2 * i, bias=False)
        self.wo = nn.Linear(i, h, bias=False)

    def forward(self, x):
        a, b = self.wi(x).chunk(2, -1)
        y = self.wi2(x)
        return x + self.wo(F.silu(a) * b + F.gelu(y[..., ::2]) * y[..., 1::2])


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TitanAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd)
        k = self.wk(x).view(b, t, self.kv_heads, self.hd)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class TitanBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = TitanAttention(dim, heads, kv_heads)
        self.feed_forward = nn.ModuleDict(dict(w1=nn.Linear(dim, hidden, bias=False),
                                               w2=nn.Linear(hidden, dim, bias=False),
                                               w3=nn.Linear(dim, hidden, bias=False)))

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        ff, h = self.feed_forward, self.ffn_norm(x)
        return x + ff.w2(F.silu(ff.w1(h)) * ff.w3(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama layout: separate wq / wk / wv / wo, w1 / w2 / w3, tok_embeddings, output."""

    def __init__(self, vocab=40, dim=16, heads=4, kv_heads=2, hidden=24, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.hd = dim // heads

    def forward(self, tokens):
        t = tokens.shape[1]
        angle = torch.arange(t, device=tokens.device)[:, None] * torch.ones(self.hd // 2, device=tokens.device)
        cos = torch.cat((angle, angle), -1).cos()[None, :, None, :]
        sin = torch.cat((angle, angle), -1).sin()[None, :, None, :]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


class NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT: c_attn fused QKV split by .split(n_embd, dim=2), lm_head tied to wte, loss returned."""

    def __init__(self, vocab=50, n_embd=16, n_head=4, layers=2, block=8):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd),
                                              h=nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(layers)),
                                              ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SplitWeights(nn.Module):
    """Weights split before their products: a bare [Q; K; V] (GQA sizes) split by rows, an (in, out)
    weight chunked by columns, and torch's nn.MultiheadAttention (in_proj_weight, a fused QKV)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(16 + 8 + 8, 16) / 4)
        self.io = nn.Parameter(torch.randn(16, 24) / 4)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        q, k, v = self.qkv.split([16, 8, 8], dim=0)
        a, b = self.io.chunk(2, dim=1)
        y = F.linear(x, q) + F.linear(x, k).repeat(1, 1, 2) + F.linear(x, v).repeat(1, 1, 2)
        y = y + (x @ a).sum(-1, keepdim=True) * (x @ b).sum(-1, keepdim=True)
        return x + self.mha(y, y, y, need_weights=False)[0]


class EinsumHeads(nn.Module):
    """XLNet's attention weights: (d_model, heads, head_dim) used through einsum, one matrix each."""

    def __init__(self, d=16, heads=4, hd=6):
        super().__init__()
        self.q = nn.Parameter(torch.randn(d, heads, hd) / 4)
        self.o = nn.Parameter(torch.randn(d, heads, hd) / 4)

    def forward(self, x):
        h = torch.einsum("bti,ihd->bthd", x, self.q).relu()
        return x + torch.einsum("bthd,ihd->bti", h, self.o)


def _inputs(model):
    g = torch.Generator().manual_seed(0)
    if isinstance(model, FusedHeads):
        return (torch.randn(2, 5, 16, generator=g),)
    if isinstance(model, Stacks):
        return (torch.randn(2, 5, 8, generator=g), torch.randint(0, 10, (2, 5), generator=g))
    if isinstance(model, GatedMLP):
        return (torch.randn(2, 5, 8, generator=g),)
    if isinstance(model, EinsumHeads):
        return (torch.randn(2, 5, 16, generator=g),)
    if isinstance(model, SplitWeights):
        return (torch.randn(2, 5, 16, generator=g),)
    if isinstance(model, TitanLlama):
        return (torch.randint(0, 40, (2, 6), generator=g),)
    return {"idx": torch.randint(0, 50, (2, 8), generator=g), "targets": torch.randint(0, 50, (2, 8), generator=g)}


def _route(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the use settles every weight of these models: no warning
        table, _ = route_parameters(model, example_inputs=_inputs(model), **NO_NAMES, **kw)
    return table


def _check(table, name, optimizer, keys=None, reason=None, wd=None, source="use"):
    r = table[name]
    assert r.optimizer == optimizer, (name, r.reason)
    assert r.source == source, (name, r.source, r.reason)
    if keys is not None:
        assert dict(r.group_keys) == keys, (name, r.reason)
    if reason is not None:
        assert reason in r.reason, (name, r.reason)
    if wd is not None:
        assert r.weight_decay == wd, name


def test_fused_per_head_qkv_bare_parameter():
    table = _route(FusedHeads())
    _check(table, "mix", "muon", {"split_shapes": (4, 4, 4)}, "output split [4 + 4 + 4]")
    _check(table, "back", "muon", {})
    assert table["mix"].view == "[16x16 + 16x16 + 16x16]"


def test_stacks_router_elementwise_and_lookup():
    table = _route(Stacks(), weight_decay=0.1)
    _check(table, "ups", "muon", {"nd_mode": "batch", "matrix_layout": "in_out", "split_shapes": (6, 6)},
           "fused gate/up split [6 + 6]")
    _check(table, "downs", "muon", {"nd_mode": "batch", "matrix_layout": "in_out"})
    assert table["downs"].scale == f"{math.sqrt(8 / 6):.3g}"  # each expert an (8, 6) (out, in) matrix
    _check(table, "flat", "muon", {"split_shapes": (6, 6, 6)}, "3 matrices stacked along dim 0")
    _check(table, "decay", "adamw", reason="not a matrix", wd=0.0)
    _check(table, "table", "adamw", reason="embedding (use: index lookup", wd=0.1)
    _check(table, "pick", "adamw", reason="MoE router")
    table = _route(Stacks(), routers="muon", fused_gate_up="whole")
    _check(table, "pick", "muon", {})
    _check(table, "ups", "muon", {"nd_mode": "batch", "matrix_layout": "in_out"}, "fused gate/up [6 + 6] whole")


def test_chunked_and_interleaved_gate_up():
    table = _route(GatedMLP())
    _check(table, "wi.weight", "muon", {"split_shapes": (12, 12)}, "fused gate/up split")
    _check(table, "wi2.weight", "muon", {"split_shapes": (1, 1)}, "fused gate/up split [1 + 1]")
    _check(table, "wo.weight", "muon", {})  # returned through a residual sum: not an output head


def test_weights_split_before_their_products_and_torch_multihead_attention():
    table = _route(SplitWeights())
    _check(table, "qkv", "muon", {"split_shapes": (16, 8, 8)}, "weight split [16 + 8 + 8]")
    _check(table, "io", "muon", {"matrix_layout": "in_out", "split_shapes": (12, 12)}, "weight split [12 + 12]")
    # F.multi_head_attention_forward: linear(x, in_proj_weight).unflatten(-1, (3, E)) then [0], [1], [2]
    _check(table, "mha.in_proj_weight", "muon", {"split_shapes": (16, 16, 16)}, "output split [16 + 16 + 16]")
    _check(table, "mha.out_proj.weight", "muon", {})


def test_einsum_weights_of_three_dims_are_one_matrix():
    table = _route(EinsumHeads())
    _check(table, "q", "muon", {"nd_mode": "flatten", "matrix_layout": "in_out"}, "one matrix 16 x 4x6, (in, out)")
    _check(table, "o", "muon", {"nd_mode": "flatten"}, "(out, in)")
    assert table["q"].scale == f"{math.sqrt(24 / 16):.3g}" and table["o"].scale == "1"


def test_torchtitan_llama_without_names():
    table = _route(TitanLlama())
    for i in range(2):
        for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                  "feed_forward.w2", "feed_forward.w3"):
            _check(table, f"layers.{i}.{m}.weight", "muon", {})  # rotary halves re-joined: q, k whole
        for norm in ("attention_norm", "ffn_norm"):
            _check(table, f"layers.{i}.{norm}.weight", "adamw", source="shape")
    _check(table, "tok_embeddings.weight", "adamw", reason="nn.Embedding", source="use + table")
    _check(table, "output.weight", "adamw", reason="output head (use: product giving the model's output")
    assert table["layers.0.attention.wk.weight"].view == "8x16"


def test_nanogpt_without_names():
    table = _route(NanoGPT())
    wte = table["lm_head.weight"]
    assert set(wte.names) == {"transformer.wte.weight", "lm_head.weight"} and wte.optimizer == "adamw"
    _check(table, "transformer.wpe.weight", "adamw", source="use + table")
    for i in range(2):
        _check(table, f"transformer.h.{i}.c_attn.weight", "muon", {"split_shapes": (16, 16, 16)})
        for m in ("c_proj", "c_fc", "mlp_proj"):
            _check(table, f"transformer.h.{i}.{m}.weight", "muon", {})
    # untied, the head is found by its product feeding the loss
    model = NanoGPT()
    model.lm_head.weight = nn.Parameter(torch.randn(50, 16))
    _check(_route(model), "lm_head.weight", "adamw", reason="output head (use")


def _blocks(model, tensors):
    """The (out, in) matrices of each Muon weight, written from the modules' code above (row blocks of
    an (out, in) weight, transposes of an (in, out) one)."""
    out = []
    for name, t in tensors.items():
        if name == "mix":  # rows (head, [q; k; v], d)
            g = t.view(4, 3, 4, 16)
            out += [g[:, j].reshape(16, 16) for j in range(3)]
        elif name == "ups":
            out += [t[e].T[rows] for e in range(3) for rows in (slice(0, 6), slice(6, 12))]
        elif name == "downs":
            out += [t[e].T for e in range(3)]
        elif name == "flat":
            out += [t[6 * e:6 * (e + 1)] for e in range(3)]
        elif name == "wi.weight":
            out += [t[:12], t[12:]]
        elif name == "wi2.weight":
            out += [t[0::2], t[1::2]]
        elif name == "q":
            out.append(t.reshape(16, 24).T)
        elif name == "o":
            out.append(t.reshape(16, 24))
        elif name == "qkv":
            out += [t[:16], t[16:24], t[24:]]
        elif name == "io":
            out += [t[:, :12].T, t[:, 12:].T]
        elif name == "mha.in_proj_weight":
            out += [t[:16], t[16:32], t[32:]]
        elif name.endswith("c_attn.weight"):
            out += [t[:16], t[16:32], t[32:]]
        else:
            out.append(t)
    return out


@pytest.mark.parametrize("cls", [FusedHeads, Stacks, GatedMLP, SplitWeights, EinsumHeads, NanoGPT, TitanLlama])
def test_updates_equal_per_block_muon(cls):
    torch.manual_seed(0)
    model = cls()
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest",
              scale_mode="shape_scaling")
    (muon, *_), table = build_optimizers(model, example_inputs=_inputs(model), muon_lr=kw["lr"],
                                         momentum=kw["momentum"], weight_decay=kw["weight_decay"], muon_kwargs=dict(
                                             fp32_matmul_prec="highest"), **NO_NAMES)
    params = dict(model.named_parameters())
    names = table.names_for("muon")
    ref_params = [nn.Parameter(b.detach().clone().contiguous()) for b in _blocks(model, {n: params[n] for n in names})]
    ref = Muon(ref_params, **kw)
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        grads = _blocks(model, {n: params[n].grad for n in names})
        for r, g in zip(ref_params, grads):
            r.grad = g.contiguous().clone()
        muon.step()
        ref.step()
    got = _blocks(model, {n: params[n].detach() for n in names})
    assert len(got) == len(ref_params)
    for g, r in zip(got, ref_params):
        torch.testing.assert_close(g, r.detach(), rtol=0, atol=1e-6)


def test_overrides_win_over_the_use():
    model = FusedHeads()
    table, _ = route_parameters(model, example_inputs=_inputs(model), views={"mix": None}, adamw_patterns=["^back$"])
    assert (table["mix"].optimizer, table["mix"].source, table["mix"].group_keys) == ("muon", "override", ())
    assert (table["back"].optimizer, table["back"].source) == ("adamw", "override")
    text = table.format()
    assert "from" in text.splitlines()[0] and "override" in text


def test_flat_lists_groups_and_factory():
    from megatron_eopt.integrations.transformers import MuonAdamWFactory

    model = Stacks()
    groups, other = muon_param_groups(model, example_inputs=_inputs(model), as_groups=True)
    assert {id(p) for g in groups for p in g["params"]} == {id(model.ups), id(model.downs), id(model.flat)}
    assert {id(p) for p in other} == {id(model.decay), id(model.table), id(model.pick)}
    opt = MuonAdamWFactory()(model, example_inputs=_inputs(model))
    muon_ids = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert muon_ids == {id(model.ups), id(model.downs), id(model.flat)}


def test_trace_runs_on_meta_and_costs_no_parameter_memory():
    model = TitanLlama()
    uses = trace_parameter_uses(model, _inputs(model))
    assert uses.ran_on == "meta" and uses.error is None
    assert uses["layers.0.attention.wq.weight"].kind == "matrix" and uses["output.weight"].kind == "head"
    with torch.device("meta"):
        meta_model = TitanLlama()
    uses = trace_parameter_uses(meta_model, _inputs(model))
    assert uses.ran_on == "meta" and uses["tok_embeddings.weight"].kind == "embedding"


def test_bad_example_inputs_and_overrides_are_clear_errors():
    model = FusedHeads()
    with pytest.raises(TypeError, match=r"example_inputs do not fit FusedHeads\.forward\(x\)"):
        route_parameters(model, example_inputs=(torch.randn(2, 3, 16), torch.randn(2)))
    with pytest.raises(TypeError, match=r"example_inputs do not fit FusedHeads\.forward\(x\): missing a required argument: 'x'"):
        build_optimizers(model, example_inputs={"inputs": torch.randn(2, 3, 16)})
    with pytest.raises(ValueError, match=r"example_inputs: FusedHeads\.forward\(x\) failed on them"):
        build_optimizers(model, example_inputs=(torch.randn(2, 3, 7),))
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple of positional args"):
        route_parameters(model, example_inputs="x")
    with pytest.raises(TypeError, match=r"example_inputs needs the model as an nn.Module"):
        route_parameters(list(model.named_parameters()), example_inputs=_inputs(model))
    with pytest.raises(ValueError, match=r"views names 'mixx', which is not a parameter"):
        route_parameters(model, example_inputs=_inputs(model), views={"mixx": None})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    build_optimizers(model, example_inputs=_inputs(model))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # routing steps nothing


def test_a_weight_the_trace_cannot_read_is_reported():
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel = nn.Parameter(torch.randn(4, 2, 3, 3))
            self.mat = nn.Parameter(torch.randn(6, 4))

        def forward(self, x):
            y = F.conv2d(x, self.kernel).mean((-1, -2))
            return (y @ self.mat.T[:4, :3]).sum()  # sliced before the product: not read

    model = Conv()
    with pytest.warns(UserWarning, match=r"did not say what matrices 2 parameter\(s\) hold.*kernel: used by "
                                         r"convolution.*mat: multiplied in slices"):
        table, _ = route_parameters(model, example_inputs=(torch.randn(1, 2, 5, 5),))
    assert table["kernel"].source == "shape" and table["mat"].source == "shape"


# --- transformers models: the route of every weight, written from their modeling code (5.24)

def _hf(name):
    T = pytest.importorskip("transformers")
    small = dict(num_hidden_layers=2, vocab_size=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    llama = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    configs = {
        "llama": lambda: T.LlamaConfig(**llama, **small),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**llama, **small, num_experts=4, moe_intermediate_size=24,
                                              num_experts_per_tok=2),
        "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0,
                                     eos_token_id=0),
        "llama4": lambda: T.Llama4TextConfig(**llama, **small, intermediate_size_mlp=64, num_local_experts=4,
                                             num_experts_per_tok=1, moe_layers=[0, 1]),
        "dbrx": lambda: T.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=64,
                                     attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                     ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2),
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.AutoModelForCausalLM.from_config(configs[name]()).float()


def _routes(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table, _ = route_parameters(model, **kw)
    return table, [str(w.message) for w in caught if "routing" in str(w.message) or "trace" in str(w.message)]


def test_hf_llama_and_gpt2_traced_on_dummy_inputs():
    model = _hf("llama")
    assert trace_parameter_uses(model).ran_on == "meta"
    table, said = _routes(model, **NO_NAMES)
    assert not said
    for r in table:
        if r.name.endswith("_proj.weight"):
            assert (r.optimizer, r.source, r.group_keys) == ("muon", "use", ()), r.name
    assert table["lm_head.weight"].optimizer == "adamw" and "output head (use" in table["lm_head.weight"].reason
    model = _hf("gpt2")
    table, said = _routes(model)
    assert not said
    # Conv1D stores (in, out): x @ W contracts W's dim 0; c_attn's output split(split_size, dim=2)
    assert dict(table["transformer.h.0.attn.c_attn.weight"].group_keys) == {"matrix_layout": "in_out",
                                                                            "split_shapes": (32, 32, 32)}
    assert dict(table["transformer.h.0.mlp.c_fc.weight"].group_keys) == {"matrix_layout": "in_out"}
    assert table["transformer.h.0.mlp.c_fc.weight"].scale == "2"
    assert table["transformer.wte.weight"].optimizer == "adamw"  # tied to lm_head


def test_hf_qwen3_moe_experts_and_router():
    table, said = _routes(_hf("qwen3_moe"))
    assert not said
    # Qwen3MoeExperts: F.linear(x, gate_up_proj[e]).chunk(2, -1); act(gate) * up; down_proj[e]
    gate_up = table["model.layers.0.mlp.experts.gate_up_proj"]
    assert dict(gate_up.group_keys) == {"nd_mode": "batch", "split_shapes": (24, 24)} and gate_up.source == "use"
    assert dict(table["model.layers.0.mlp.experts.down_proj"].group_keys) == {"nd_mode": "batch"}
    router = table["model.layers.0.mlp.gate.weight"]
    assert router.optimizer == "adamw" and "router" in router.reason


def test_hf_llama4_experts_stored_in_out():
    """Llama4TextExperts: torch.bmm(x, gate_up_proj (E, H, 2I)).chunk(2, -1), bmm with down_proj (E, I, H):
    (in, out) stacks; the class table reads the same from the stack's shape (no flags on the module)."""
    from megatron_eopt import model_matrix_views

    model = _hf("llama4")
    table, said = _routes(model)
    assert not said
    views = {name: v for name, v in model_matrix_views(model).values()}
    assert views["model.layers.0.feed_forward.experts.gate_up_proj"].matrix_layout == "in_out"
    assert views["model.layers.0.feed_forward.experts.down_proj"].matrix_layout == "in_out"
    gate_up = table["model.layers.0.feed_forward.experts.gate_up_proj"]
    assert dict(gate_up.group_keys) == {"nd_mode": "batch", "matrix_layout": "in_out", "split_shapes": (48, 48)}
    assert gate_up.view == "4 x [48x32 + 48x32]" and gate_up.scale == "1.22 / 1.22"
    down = table["model.layers.0.feed_forward.experts.down_proj"]
    assert dict(down.group_keys) == {"nd_mode": "batch", "matrix_layout": "in_out"} and down.scale == "1"
    assert table["model.layers.0.feed_forward.router.weight"].optimizer == "adamw"
    assert table["model.layers.0.feed_forward.shared_expert.gate_proj.weight"].optimizer == "muon"


def test_hf_dbrx_2d_expert_stacks():
    """DbrxExperts: w1 / v1 (E·ffn, H) viewed (E, ffn, H)[e] and multiplied as x @ w.T (per-expert
    (out, in) row blocks); w2 viewed the same but multiplied as x @ w: per-expert (in, out) blocks
    stacked along their input dim, which no param-group keys describe; Wqkv split([H, kv, kv], dim=2)."""
    table, said = _routes(_hf("dbrx"))
    assert len(said) == 1 and "mlp.w2: matrices stacked along their input dim" in said[0]
    for w in ("w1", "v1"):
        r = table[f"transformer.blocks.0.ffn.experts.mlp.{w}"]
        assert dict(r.group_keys) == {"split_shapes": (48,) * 4} and r.view == "[4 parts of 48x32]"
    assert table["transformer.blocks.0.ffn.experts.mlp.w2"].optimizer == "adamw"
    assert dict(table["transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight"].group_keys) == {
        "split_shapes": (32, 16, 16)}
    assert table["transformer.blocks.0.ffn.router.layer.weight"].optimizer == "adamw"


def test_hf_model_that_cannot_be_traced_falls_back_with_a_warning():
    transformers = pytest.importorskip("transformers")

    class Broken(transformers.LlamaForCausalLM):
        @property
        def dummy_inputs(self):
            return {"input_ids": torch.ones(1, 3)}  # floats: no embedding lookup runs on them

    model = Broken(_hf("llama").config)
    table, said = _routes(model)
    assert len(said) == 1 and "could not be traced" in said[0] and "q_proj.weight" in said[0]
    assert table["model.layers.0.self_attn.q_proj.weight"].source == "shape"
    assert table["model.embed_tokens.weight"].source == "table"
    class Unbound(transformers.LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids)

        @property
        def dummy_inputs(self):
            return {"pixel_values": torch.ones(1, 3)}  # not an argument of its forward

    table, said = _routes(Unbound(model.config))
    assert len(said) == 1 and "could not be traced (its dummy inputs: example_inputs do not fit" in said[0]
    table, said = _routes(model, example_inputs=False)  # tables only, as before, silently
    assert not said and table["model.layers.0.self_attn.q_proj.weight"].source == "shape"


def test_what_a_meta_forward_caches_on_modules_is_undone():
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)
            self.cache = None
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            if self.cache is None:  # a table computed on first use, on the input's device
                self.cache = torch.arange(x.shape[1], device=x.device).float()
                self.register_buffer("made", torch.zeros(1, device=x.device), persistent=False)
            return torch.relu(self.w(x) * self.scale + self.cache[:, None]).sum()

    model = Lazy()
    uses = trace_parameter_uses(model, (torch.randn(2, 3, 4),))
    assert uses.ran_on == "meta" and uses["w.weight"].kind == "matrix"
    assert model.cache is None and "made" not in model._buffers and model.scale.device.type == "cpu"
    assert model(torch.randn(2, 3, 4)).isfinite()


def test_hf_fused_qkv_no_table_names_bloom_and_mpt():
    """Bloom: query_key_value(x).view(b, t, heads, 3, head_dim)[..., j, :]: per head [q; k; v].
    MPT: Wqkv(x).chunk(3, dim=2): [Q; K; V]."""
    T = pytest.importorskip("transformers")
    small = dict(vocab_size=64, bos_token_id=0, eos_token_id=0)
    for model, name, sizes in (
            (T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=1, n_head=4, **small)),
             "transformer.h.0.self_attention.query_key_value.weight", (8, 8, 8)),
            (T.MptForCausalLM(T.MptConfig(d_model=32, n_layers=1, n_heads=4, **small)),
             "transformer.blocks.0.attn.Wqkv.weight", (32, 32, 32))):
        table, said = _routes(model)
        assert not said and dict(table[name].group_keys) == {"split_shapes": sizes}, type(model).__name__
        assert table[name].source == "use"


class SplitAgain(nn.Module):
    """A part of a split split again (Mamba2's in_proj [z; xBC; dt], xBC into x, B, C after an
    activation), and a multi-query [Q; k; v] whose one-head k is chunked and re-joined by a rotary."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 4 + 12 + 2, bias=False)
        self.mqa = nn.Linear(8, 8 + 2 + 2, bias=False)

    def forward(self, x):
        z, xbc, dt = self.inp(x).split([4, 12, 2], dim=-1)
        xs, b, c = F.silu(xbc).split([6, 3, 3], dim=-1)
        q, k, v = self.mqa(x).split([8, 2, 2], dim=-1)
        k = k * 0.5 + rotate_half(k) * 0.25  # rotate_half chunks k in two and concatenates them back
        return (z.sum(-1) + xs.sum(-1) * b.sum(-1) * c.sum(-1) + dt.sum(-1) + (q.sum(-1) * k.sum(-1) * v.sum(-1))).sum()


def test_a_split_part_split_again_and_a_rotated_one_head_part():
    model = SplitAgain()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table, _ = route_parameters(model, example_inputs=(torch.randn(2, 3, 8),), **NO_NAMES)
    _check(table, "inp.weight", "muon", {"split_shapes": (4, 6, 3, 3, 2)}, "output split [4 + 6 + 3 + 3 + 2]")
    _check(table, "mqa.weight", "muon", {"split_shapes": (8, 2, 2)}, "output split [8 + 2 + 2]")
