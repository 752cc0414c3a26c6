"""HybridMuon (Muon + AdamW in one optimizer), QK-clip, CPU offload, and Keller Jordan's legacy
names, against plain-PyTorch references of their semantics (the Motif lineage: test_motif_compat.py)."""

import copy
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import megatron_eopt as me
from megatron_eopt import muon as legacy
from megatron_eopt.newton_schulz import get_coefficients
from megatron_eopt.optim import HybridMuon, Muon
from megatron_eopt.optim.qk_clip import max_attention_logits
from reference import TOLERANCE, op_raises, rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 3, 10


class Attention(torch.nn.Module):
    def __init__(self, fused: bool, gqa: bool):
        super().__init__()
        kv = KV_HEADS if gqa else HEADS
        if fused:
            groups = kv
            self.linear_qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * groups) * HEAD_DIM, bias=False)
        else:
            self.q_proj = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
            self.k_proj = torch.nn.Linear(HIDDEN, kv * HEAD_DIM, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)


class Model(torch.nn.Module):
    def __init__(self, fused=False, gqa=False, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(7, HIDDEN)
        self.layers = torch.nn.ModuleList(Attention(fused, gqa) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, 7, bias=False)


def _groups(model, **muon_group):
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim == 2 and "embed" not in name and "lm_head" not in name else adamw).append((name, p))
    return [
        {"params": [p for _, p in muon], "names": [n for n, _ in muon], "use_muon": True, **muon_group},
        {"params": [p for _, p in adamw], "names": [n for n, _ in adamw], "use_muon": False, "lr": 3e-3,
         "betas": (0.8, 0.9), "eps": 1e-7, "weight_decay": 0.05},
    ]


def _set_grads(model, gen):
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


def _set_twin_grads(model, ref, gen):
    """Fresh gradients on `model`, the same on its copy `ref`."""
    _set_grads(model, gen)
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = p.grad.clone()


def _clone(model):
    return copy.deepcopy(model)


# ------------------------------------------------------------------ the two halves
@pytest.mark.parametrize("device", DEVICES)
def test_muon_side_equals_muon_and_adamw_side_equals_torch_adamw(device, gen):
    model = Model().to(device)
    ref = _clone(model)
    kw = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest")
    opt = HybridMuon(_groups(model), **kw)
    ref_groups = _groups(ref)
    muon = Muon([{"params": ref_groups[0]["params"]}], **kw)
    g = ref_groups[1]
    # HybridMuon's AdamW side is torch's fused AdamW on CUDA and foreach AdamW elsewhere: the
    # reference is the same implementation (fused and foreach differ in rounding).
    impl = dict(fused=True) if device == "cuda" else dict(foreach=True)
    adamw = torch.optim.AdamW(g["params"], lr=3e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05, **impl)
    for _ in range(3):
        _set_twin_grads(model, ref, gen)
        opt.step()
        muon.step()
        adamw.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_groups_need_use_muon_and_change_nothing(gen):
    model = Model()
    groups = _groups(model)
    del groups[1]["use_muon"]
    with pytest.raises(ValueError, match="param_groups\\[1\\] has no 'use_muon' key"):
        HybridMuon(groups)
    groups[1]["use_muon"] = "yes"
    with pytest.raises(ValueError, match="'use_muon'\\] must be True or False"):
        HybridMuon(groups)


def test_state_dict_round_trip_continues_identically(gen):
    model = Model()
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest")
    for _ in range(2):
        _set_grads(model, gen)
        opt.step()
    clone = _clone(model)
    loaded = HybridMuon(_groups(clone), fp32_matmul_prec="highest")
    # torch's load_state_dict shares same-device tensors with the source: load a copy, as a checkpoint is.
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(opt.state_dict()["state"][len(_groups(model)[0]["params"])])
    for _ in range(2):
        _set_grads(model, gen)
        for p, q in zip(model.parameters(), clone.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        loaded.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clone.parameters()))
    # A scheduler writing lr into the hybrid's groups reaches both halves.
    loaded.param_groups[1]["lr"] = 0.0
    before = [p.detach().clone() for p in clone.parameters()]
    _set_grads(clone, gen)
    loaded.step()
    adam_params = set(map(id, loaded.param_groups[1]["params"]))
    for p, b in zip(clone.parameters(), before):
        if id(p) in adam_params:
            assert torch.equal(p, b * (1 - 0.0 * 0.05))


def test_add_param_group_joins_its_side(gen):
    model = Model(layers=2)
    groups = _groups(model)
    late = model.layers[1]
    first = [dict(g, params=[p for p in g["params"] if all(p is not q for q in late.parameters())],
                  names=[n for n, p in zip(g["names"], g["params"]) if all(p is not q for q in late.parameters())])
             for g in groups]
    opt = HybridMuon(first, lr=0.02, adamw_lr=1e-3, fp32_matmul_prec="highest")
    opt.add_param_group({"params": [late.q_proj.weight, late.k_proj.weight], "use_muon": True})
    opt.add_param_group({"params": [late.o_proj.bias], "use_muon": False})
    assert opt.param_groups[-2]["momentum"] == 0.95 and opt.param_groups[-1]["betas"] == (0.9, 0.95)
    _set_grads(model, gen)
    opt.step()
    assert set(opt.state[late.q_proj.weight]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq"} <= set(opt.state[late.o_proj.bias])
    count = len(opt.param_groups)
    for params, use_muon in (([late.q_proj.weight], True), ([late.o_proj.bias], True)):
        with pytest.raises(ValueError, match="appear in more than one"):
            opt.add_param_group({"params": params, "use_muon": use_muon})
        assert len(opt.param_groups) == count and len(opt._muon.param_groups) + len(opt._adamw.param_groups) == count


def test_compile_fullgraph_equals_eager(gen):
    torch._dynamo.reset()
    model = Model(layers=1)
    ref = _clone(model)
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest")
    eager = HybridMuon(_groups(ref), fp32_matmul_prec="highest")
    step = torch.compile(opt.step, fullgraph=True)
    for _ in range(2):
        _set_twin_grads(model, ref, gen)
        step()
        eager.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_compiled_step_with_a_float_lr_schedule_compiles_twice(gen):
    # Both sides' Python-float lrs rewritten every step: inputs of the second graph, which every
    # later step runs (the AdamW side hands torch's AdamW a tensor lr, a float one would be a
    # constant of the graph). The grads are written in place, as after zero_grad(set_to_none=False):
    # torch.compile guards a compiled torch AdamW on its grads' storage.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Model(layers=1)
    ref = _clone(model)
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest")
    eager = HybridMuon(_groups(ref), fp32_matmul_prec="highest")

    def train_step():
        opt.step()

    step = torch.compile(train_step, fullgraph=True)
    graphs = []
    with torch._inductor.config.patch(force_disable_caches=True):
        for t in range(5):
            for p, q in zip(model.parameters(), ref.parameters()):
                g = torch.randn(p.shape, generator=gen)
                if p.grad is None:
                    p.grad, q.grad = g.clone(), g.clone()
                else:
                    p.grad.copy_(g)
                    q.grad.copy_(g)
            for o in (opt, eager):
                for group in o.param_groups:
                    group["lr"] = group.setdefault("initial_lr", group["lr"]) * (1.0 - 0.15 * t)
            step()
            eager.step()
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 2, 2, 2], graphs
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ QK-clip
CLIP = {"threshold": 5.0, "head_dim": HEAD_DIM}


def _clip_run(fused, gqa, logits, gen):
    """Params after one step without and with QK-clip (same grads)."""
    model = Model(fused=fused, gqa=gqa)
    ref = _clone(model)
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest", clip_config=CLIP)
    plain = HybridMuon(_groups(ref), fp32_matmul_prec="highest")
    _set_twin_grads(model, ref, gen)
    opt.step(qk_logits=logits)
    plain.step()
    return model, ref


def _gamma(logits):
    return torch.where(logits > CLIP["threshold"], CLIP["threshold"] / logits, torch.ones_like(logits))


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_qk_clip_separate_projections(gqa, gen):
    logits = {0: torch.tensor([1.0, 20.0, 5.0, 10.0]), 1: torch.tensor([50.0, 2.0, 3.0, 4.0])}
    model, ref = _clip_run(False, gqa, logits, gen)
    kv = KV_HEADS if gqa else HEADS
    group = HEADS // kv
    for layer, s in logits.items():
        gamma = _gamma(s)
        k_scale = gamma.view(kv, group).amin(1).sqrt()
        q_scale = gamma / k_scale.repeat_interleave(group)
        if not gqa:
            torch.testing.assert_close(q_scale, gamma.sqrt())  # Motif's / Kimi's rule for MHA
        q, rq = model.layers[layer].q_proj.weight, ref.layers[layer].q_proj.weight
        k, rk = model.layers[layer].k_proj.weight, ref.layers[layer].k_proj.weight
        torch.testing.assert_close(q, rq * q_scale.repeat_interleave(HEAD_DIM)[:, None], rtol=1e-6, atol=0)
        torch.testing.assert_close(k, rk * k_scale.repeat_interleave(HEAD_DIM)[:, None], rtol=1e-6, atol=0)
        # Every head's q.k product shrinks by exactly gamma_h.
        for h in range(HEADS):
            qs = q_scale[h] * k_scale[h // group]
            assert math.isclose(qs.item(), gamma[h].item(), rel_tol=1e-6)
        assert torch.equal(model.layers[layer].o_proj.weight, ref.layers[layer].o_proj.weight)


def test_qk_clip_fused_qkv_gqa_layout(gen):
    logits = {1: torch.tensor([9.0, 1.0, 40.0, 6.0])}
    model, ref = _clip_run(True, True, logits, gen)
    gamma = _gamma(logits[1])
    k_scale = gamma.view(KV_HEADS, HEADS // KV_HEADS).amin(1).sqrt()
    q_scale = gamma / k_scale.repeat_interleave(HEADS // KV_HEADS)
    per_group = torch.cat([q_scale.view(KV_HEADS, -1), k_scale[:, None], torch.ones(KV_HEADS, 1)], 1).reshape(-1)
    w, rw = model.layers[1].linear_qkv.weight, ref.layers[1].linear_qkv.weight
    torch.testing.assert_close(w, rw * per_group.repeat_interleave(HEAD_DIM)[:, None], rtol=1e-6, atol=0)
    assert torch.equal(model.layers[0].linear_qkv.weight, ref.layers[0].linear_qkv.weight)  # no logits given


@pytest.mark.parametrize("logits,match", [
    ({7: torch.ones(HEADS)}, "qk_logits has layer 7"),
    ({0: torch.ones(HEADS + 1)}, "qk_logits\\[0\\] has 5 values but layer 0's query weight has 4 heads"),
    ({0: torch.ones(2, 2)}, "must be a 1-D tensor"),
])
def test_bad_qk_logits_change_nothing(logits, match, gen):
    model = Model()
    opt = HybridMuon(_groups(model), clip_config=CLIP)
    _set_grads(model, gen)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.step(qk_logits=logits)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 0


def test_max_attention_logits_helper(gen):
    q = torch.randn(2, 4, 5, 3, generator=gen)
    k = torch.randn(2, 2, 5, 3, generator=gen)
    got = max_attention_logits(q, k, causal=True)
    want = torch.full((4,), -math.inf)
    for h in range(4):
        s = q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(3)
        s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
        want[h] = s.max()
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ the qk_clip_ op
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_clip_op_scales_row_blocks(device, dtype, gen):
    shapes, blocks = [(12, 7), (6, 1), (1, 9), (35, 3)], [3, 2, 1, 7]
    weights = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    factors = [torch.rand(s[0] // b, generator=gen).to(device) for s, b in zip(shapes, blocks)]
    want = [(w.float() * f.repeat_interleave(b)[:, None]).to(dtype) for w, f, b in zip(weights, factors, blocks)]
    me.qk_clip_(weights, factors, blocks)
    for w, r in zip(weights, want):
        assert torch.equal(w, r)


@pytest.mark.parametrize("device", DEVICES)
def test_qk_clip_op_opcheck(device, gen):
    weights = [torch.randn(6, 4, generator=gen).to(device), torch.randn(4, 5, generator=gen).to(device)]
    factors = [torch.rand(2, generator=gen).to(device), torch.rand(4, generator=gen).to(device)]
    torch.library.opcheck(torch.ops.megatron_eopt.qk_clip_.default, (weights, factors, [3, 1]))


@pytest.mark.parametrize("args,exc,match", [
    (([torch.zeros(6, 4)], [torch.ones(3)], [3]), ValueError, "factors\\[0\\] must be 1-D with 2 values"),
    (([torch.zeros(6, 4)], [torch.ones(2)], [4]), ValueError, "block_rows\\[0\\] = 4 must be positive and divide"),
    (([torch.zeros(6, 4)], [torch.ones(2, dtype=torch.float64)], [3]), TypeError, "factors\\[0\\] must be float32"),
    (([torch.zeros(6, 4, dtype=torch.int32)], [torch.ones(2)], [3]), TypeError, "weights\\[0\\] is Int"),
    (([torch.zeros(6, 4), torch.zeros(2, 2)], [torch.ones(2)], [3]), ValueError, "factors has 1 tensors"),
    (([torch.zeros(4, 6).t()], [torch.ones(2)], [3]), ValueError, "must have contiguous rows"),
])
def test_qk_clip_op_bad_input(args, exc, match):
    before = [w.clone() for w in args[0]]
    with op_raises(exc, match):
        torch.ops.megatron_eopt.qk_clip_(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, args[0]))


# ------------------------------------------------------------------ CPU offload
def test_offload_is_bitwise_invisible_and_guards_state_dict(gen):
    model = Model()
    ref = _clone(model)
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest", cpu_offload=True)
    plain = HybridMuon(_groups(ref), fp32_matmul_prec="highest")
    assert opt.cpu_offload
    for t in range(3):
        _set_twin_grads(model, ref, gen)
        opt.step()
        plain.step()
        if t == 0:
            with pytest.raises(RuntimeError, match="turn_off_cpu_offload\\(\\) first"):
                opt.state_dict()
            with pytest.raises(RuntimeError, match="turn_off_cpu_offload\\(\\) first"):
                opt.load_state_dict(plain.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    # Between steps the state lives in one flat host buffer per dtype.
    bases = {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()}
    assert len(bases) == 1
    opt.turn_off_cpu_offload()
    sd, ref_sd = opt.state_dict(), plain.state_dict()
    for i, s in sd["state"].items():
        for k, v in s.items():
            assert torch.equal(v, ref_sd["state"][i][k]), (i, k)


@pytest.mark.gpu
def test_offload_on_cuda_uses_pinned_host_memory(gen):
    model = Model().cuda()
    ref = _clone(model)
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest", cpu_offload=True)
    plain = HybridMuon(_groups(ref), fp32_matmul_prec="highest")
    side = torch.cuda.Stream()
    for _ in range(3):
        _set_twin_grads(model, ref, gen)
        with torch.cuda.stream(side):  # transfers ordered on the current stream, whichever it is
            opt.step()
        side.synchronize()
        plain.step()
    torch.cuda.synchronize()
    states = [v for s in opt.state.values() for v in s.values() if v.numel() > 1]
    assert states and all(v.device.type == "cpu" and v.is_pinned() for v in states)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


class _NewStorages(TorchDispatchMode):
    """Records the bytes of every tensor storage an op creates (outputs sharing no input's storage)."""

    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.created.append((str(func), t.untyped_storage().nbytes()))
        return out


class Mixed(torch.nn.Module):
    """Odd shapes and several dtypes: fp32 Muon matrices (one stored transposed), AdamW params in
    fp32 (a channels-last conv weight, a 1-element bias), bf16 and fp64."""

    def __init__(self, gen):
        super().__init__()
        r = lambda *shape, dtype=torch.float32: torch.randn(shape, generator=gen).to(dtype)  # noqa: E731
        self.a = torch.nn.Parameter(r(7, 5))
        self.b = torch.nn.Parameter(r(13, 3))
        self.t = torch.nn.Parameter(r(9, 6).t())  # (6, 9) with strides (1, 6)
        self.conv = torch.nn.Parameter(r(4, 3, 3, 2).to(memory_format=torch.channels_last))
        self.one = torch.nn.Parameter(r(1))
        self.low = torch.nn.Parameter(r(11, dtype=torch.bfloat16))
        self.wide = torch.nn.Parameter(r(3, 5, dtype=torch.float64))

    def groups(self):
        return [{"params": [self.a, self.b, self.t], "use_muon": True},
                {"params": [self.conv, self.one, self.low, self.wide], "use_muon": False, "lr": 3e-3}]


def _tensor_state(opt):
    return [v for s in opt.state.values() for v in s.values() if type(v) is torch.Tensor]


def _by_kind(tensors):
    kinds = {}
    for v in tensors:
        kinds.setdefault((v.device, v.dtype), []).append(v)
    return kinds


def _storages(opt):
    """The storages the state tensors live in, by (device, dtype)."""
    return {k: {v.untyped_storage().data_ptr() for v in vs} for k, vs in _by_kind(_tensor_state(opt)).items()}


def _same_grads(model, ref, gen, skip=()):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = None if name in skip else torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        p.grad, q.grad = g, None if g is None else g.clone()


def _assert_same_state(opt, plain):
    for (p, s), (q, r) in zip(opt.state.items(), plain.state.items()):
        assert s.keys() == r.keys()
        for k, v in s.items():
            assert torch.equal(v.cpu(), r[k].cpu()), k
            assert v.stride() == r[k].stride(), k


@pytest.mark.parametrize("moment2_method", [None, "normuon"])
def test_offload_mixed_dtypes_and_shapes_is_bitwise_invisible(moment2_method, gen):
    model = Mixed(gen)
    ref = copy.deepcopy(model)
    kw = dict(fp32_matmul_prec="highest", moment2_method=moment2_method)
    opt = HybridMuon(model.groups(), cpu_offload=True, **kw)
    plain = HybridMuon(ref.groups(), **kw)
    for t in range(4):
        # `b` and `wide` get their first grad, hence their state, only at the second step.
        _same_grads(model, ref, gen, skip=("b", "wide") if t == 0 else ())
        opt.step()
        plain.step()
        _assert_same_state(opt, plain)  # a host read between steps, with strides kept
        storages = _storages(opt)  # one host buffer per dtype
        assert {d for _, d in storages} == {torch.float32, torch.bfloat16} | ({torch.float64} if t else set())
        assert all(len(b) == 1 for b in storages.values())
    for (name, p), q in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q[1]) and p.stride() == q[1].stride(), name
    opt.turn_off_cpu_offload()
    _assert_same_state(opt, plain)


def test_offload_views_start_256_byte_aligned(gen):
    model = Mixed(gen)
    opt = HybridMuon(model.groups(), fp32_matmul_prec="highest", moment2_method="normuon", cpu_offload=True)
    for _ in range(2):
        _set_grads(model, gen)
        opt.step()
    for phase in ("out", "in"):
        if phase == "in":
            opt._offload.bring_in()
        states = _tensor_state(opt)
        assert len(states) == 3 * 2 + 4 * 3  # Muon: momentum, moment2; AdamW: exp_avg, exp_avg_sq, step
        for v in states:
            offset = v.data_ptr() - v.untyped_storage().data_ptr()
            assert offset % 256 == 0, (phase, v.dtype, tuple(v.shape), offset)
        # one buffer per dtype, so the offsets are those inside it
        assert all(len(b) == 1 for b in _storages(opt).values())


def test_offload_sends_the_brought_in_buffer_without_a_second_copy(gen):
    model = Mixed(gen)
    opt = HybridMuon(model.groups(), fp32_matmul_prec="highest", cpu_offload=True)
    offload = opt._offload
    real_send_out = offload.send_out
    spy = {}

    def send_out():
        spy["before"] = _storages(opt)
        with _NewStorages() as mode:
            real_send_out()
        spy["created"] = mode.created

    offload.send_out = send_out
    hosts = None
    for t in range(3):
        _set_grads(model, gen)
        opt.step()
        host_now = _storages(opt)
        if t == 0:  # the first layout: one host buffer per dtype, written tensor by tensor
            assert all(len(b) == 1 for b in host_now.values())
            hosts = host_now
            continue
        # During the step the state was views of one device buffer per dtype (what bring_in made) ...
        assert all(len(b) == 1 for b in spy["before"].values()), spy["before"]
        # ... which went to the host buffers as it was: no op in send_out made a new buffer ...
        assert spy["created"] == [], spy["created"]
        # ... and the host buffers are those of the first layout.
        assert host_now == hosts


def test_offload_takes_state_replaced_between_steps(gen):
    model = Mixed(gen)
    ref, other = copy.deepcopy(model), copy.deepcopy(model)
    opt = HybridMuon(model.groups(), fp32_matmul_prec="highest", cpu_offload=True)
    plain = HybridMuon(ref.groups(), fp32_matmul_prec="highest")
    donor = HybridMuon(other.groups(), fp32_matmul_prec="highest")
    for _ in range(3):
        _set_grads(other, gen)
        donor.step()
    for t in range(5):
        _same_grads(model, ref, gen)
        opt.step()
        plain.step()
        if t == 1:  # a checkpoint's state, loaded into both (a copy each: torch shares same-device tensors)
            opt.turn_off_cpu_offload()
            opt.load_state_dict(copy.deepcopy(donor.state_dict()))
            opt.turn_on_cpu_offload()
            plain.load_state_dict(copy.deepcopy(donor.state_dict()))
            _assert_same_state(opt, plain)
        if t == 3:  # state tensors replaced by hand while the state is out
            for p, q in ((model.a, ref.a), (model.conv, ref.conv)):
                key = "momentum_buffer" if p is model.a else "exp_avg"
                new = torch.randn(p.shape, generator=gen)
                opt.state[p][key] = new.clone()
                plain.state[q][key] = new.clone()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    _assert_same_state(opt, plain)


def _delay_send_out(opt, cycles=int(2e8)):
    """Keeps the current stream busy (about 0.1 s) before each copy to the host, so that a host or
    stream that did not wait for that copy would read the previous step's values."""
    real = opt._offload.send_out

    def send_out():
        torch.cuda._sleep(cycles)
        real()

    opt._offload.send_out = send_out


def _offloaded_and_plain_on_cuda():
    """A CUDA model and its copy, an offloaded HybridMuon whose copies to the host lag behind a
    GPU delay, and a plain one."""
    model = Model().cuda()
    ref = _clone(model)
    opt = HybridMuon(_groups(model), fp32_matmul_prec="highest", cpu_offload=True)
    plain = HybridMuon(_groups(ref), fp32_matmul_prec="highest")
    _delay_send_out(opt)
    return model, ref, opt, plain


@pytest.mark.gpu
def test_offload_on_cuda_host_read_after_step_sees_the_step(gen):
    model, ref, opt, plain = _offloaded_and_plain_on_cuda()
    for _ in range(3):
        _set_twin_grads(model, ref, gen)
        opt.step()
        # Right away, while the copy to the host is still queued behind the delay: opt.state waits for it.
        seen = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        assert all(v.device.type == "cpu" and (v.numel() <= 1 or v.is_pinned()) for s in opt.state.values()
                   for v in s.values())
        plain.step()
        for s, r in zip(seen, plain.state.values()):
            assert s.keys() == r.keys()
            for k, v in s.items():
                assert torch.equal(v, r[k].cpu()), k
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.gpu
def test_offload_on_cuda_bring_in_on_a_side_stream(gen):
    model, ref, opt, plain = _offloaded_and_plain_on_cuda()
    side = torch.cuda.Stream()
    seen, expected = [], []
    for t in range(4):
        _set_twin_grads(model, ref, gen)
        opt.step()  # on the default stream; its copy to the host waits behind the delay
        snapshot = t % 2 == 0
        with torch.cuda.stream(side):  # nothing here blocks the host (bring_in leaves nothing pending)
            if not snapshot:
                # Delay the copy back instead: the next step, on the default stream, must wait for it.
                # (3x the delay above: the next _set_grads blocks the host until the default stream
                # is idle, and the side stream must still be busy then.)
                torch.cuda._sleep(int(6e8))
            opt._offload.bring_in()  # the side stream waits for the copy to the host, then copies back
            states = list(opt.state.values())
            assert all(v.is_cuda and v.data_ptr() % 256 == 0 for s in states for v in s.values())
            if snapshot:
                seen.append([{k: v.clone() for k, v in s.items()} for s in states])  # ordered on the side stream
        if snapshot:
            # The snapshot is the test's own work on the side stream: the next step must not overwrite
            # the state before it is read. (On the other steps nothing orders the streams but offload.)
            torch.cuda.current_stream().wait_stream(side)
        plain.step()
        if snapshot:
            expected.append([{k: v.clone() for k, v in s.items()} for s in plain.state.values()])
    torch.cuda.synchronize()
    for got, want in zip(seen, expected):
        for s, r in zip(got, want):
            assert s.keys() == r.keys()
            for k, v in s.items():
                assert torch.equal(v, r[k]), k
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.gpu
def test_offload_on_cuda_holds_one_device_copy_of_the_state(gen):
    # Mostly AdamW state (2 x 64 MiB for one 64 MiB param) and a small Muon matrix: the state S is
    # far larger than what a step allocates for itself (NS buffers of a 128 x 128 matrix and the
    # cuBLASLt workspace its algorithm asks for, at most 32 MiB).
    init = torch.randn(8192, 2048, generator=gen), torch.randn(128, 128, generator=gen)

    def build(offload):
        big, w = (torch.nn.Parameter(t.cuda()) for t in init)
        groups = [{"params": [w], "use_muon": True}, {"params": [big], "use_muon": False}]
        return [w, big], HybridMuon(groups, fp32_matmul_prec="highest", cpu_offload=offload)

    def step(params, opt):
        for p in params:
            p.grad = torch.ones_like(p)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        return base, torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base

    (params_off, off), (params_plain, plain) = build(True), build(False)
    for _ in range(2):  # first layouts, cuBLAS workspaces, lazily made scalars
        step(params_plain, plain)
        step(params_off, off)
    _, extra_plain, _ = step(params_plain, plain)  # plain: the state is resident before and after
    _, extra_off, left_off = step(params_off, off)
    state = sum(-(-v.nbytes // 512) * 512 for s in plain.state.values() for v in s.values())  # as allocated
    # Offloaded, the state is off the device before the step, so the step's peak above its start is
    # the one device copy bring_in makes (S, plus under 256 bytes of padding per tensor) plus what a
    # plain step needs above its start. A second full-size device copy (packing the state again to
    # send it out) would make it 2 S. The state is much larger than a step's own needs, so the bound
    # 1.1 (S + plain step) tells the two apart: 2 S > 1.1 (S + S / 2).
    assert state > 2 * extra_plain, (state, extra_plain)
    assert extra_off <= 1.1 * (state + extra_plain), (extra_off, state, extra_plain)
    assert extra_off >= 0.9 * state  # the state did come onto the device for the step
    assert left_off <= 0.05 * state, left_off  # and left it after
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(params_off, params_plain))


# ------------------------------------------------------------------ legacy names
def _ns_ref(x, steps=5):
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    w = x.T if tall else x
    w = w / w.norm().clamp_min(1e-7)
    for a, b, c in get_coefficients("simple", steps):
        g = w @ w.T
        w = a * w + (b * g + c * g @ g) @ w
    return w.T if tall else w


def test_muon_with_aux_adam_matches_keller_jordan(gen):
    model = Model(layers=1)
    w = model.layers[0].q_proj.weight
    b = model.layers[0].o_proj.bias
    w0, b0 = w.detach().double().clone(), b.detach().double().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = legacy.SingleDeviceMuonWithAuxAdam([dict(params=[w], use_muon=True, lr=0.05, weight_decay=0.1),
                                                 dict(params=[b], use_muon=False, lr=0.01)])
    buf = torch.zeros_like(w0)
    m1, m2 = torch.zeros_like(b0), torch.zeros_like(b0)
    for t in range(1, 3):
        gw, gb = torch.randn(w.shape, generator=gen), torch.randn(b.shape, generator=gen)
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        buf = buf.lerp(gw.double(), 0.05)
        u = _ns_ref(gw.double().lerp(buf, 0.95)) * max(1, w.shape[0] / w.shape[1]) ** 0.5
        w0 = w0 * (1 - 0.05 * 0.1) - 0.05 * u
        m1 = m1.lerp(gb.double(), 0.1)
        m2 = m2.lerp(gb.double().square(), 0.05)
        b0 = b0 - 0.01 * (m1 / (1 - 0.9**t)) / ((m2 / (1 - 0.95**t)).sqrt() + 1e-10)
    assert rel_err(w.detach().double(), w0) <= TOLERANCE["medium"]
    assert rel_err(b.detach().double(), b0) <= 1e-5
    assert set(opt.state[w]) == {"momentum_buffer"} and {"exp_avg", "exp_avg_sq", "step"} <= set(opt.state[b])


def test_legacy_names_warn_once_naming_hybrid_muon():
    legacy._warned.discard("MuonWithAuxAdam")
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.warns(DeprecationWarning, match="HybridMuon"):
        legacy.MuonWithAuxAdam([dict(params=[p], use_muon=True)])
