"""QK-clip across devices and the CUDA qk_clip_ kernel: one op call per (device, dtype) of the
weights, the CUDA tiling against the CPU op bit for bit, and a model split over two GPUs."""

import copy

import pytest
import torch

import megatron_eopt as me
from megatron_eopt import ops
from megatron_eopt.optim import HybridMuon
from megatron_eopt.optim import qk_clip as qk
from megatron_eopt.optim.qk_clip import ClipConfig, apply_qk_clip, op_groups, parse_target

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 3, 10
CLIP = {"threshold": 5.0, "head_dim": HEAD_DIM}
# gamma = 5 / logit (1 at or below 5): 1, 1/4, 1/16, 1. Every q and k factor is then a power of two
# (MHA: 1, 1/2, 1/4, 1; GQA groups of 2: k 1/2, 1/4; q 2, 1/2, 1/4, 4), so the clipped weights are
# exact multiples of the originals and factors computed on any device agree bit for bit.
LOGITS = torch.tensor([1.0, 20.0, 80.0, 3.0])


class Attention(torch.nn.Module):
    def __init__(self, fused: bool, gqa: bool):
        super().__init__()
        kv = KV_HEADS if gqa else HEADS
        if fused:
            self.linear_qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * kv) * HEAD_DIM, bias=False)
        else:
            self.q_proj = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
            self.k_proj = torch.nn.Linear(HIDDEN, kv * HEAD_DIM, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)


class Model(torch.nn.Module):
    def __init__(self, layouts):
        super().__init__()
        self.layers = torch.nn.ModuleList(Attention(fused, gqa) for fused, gqa in layouts)


def _targets(model):
    return [t for n, p in model.named_parameters() if (t := parse_target(p, n)) is not None]


def _row_factors(attention: Attention, fused: bool, gqa: bool):
    """{weight name: per-row factor} of the clip with LOGITS (see the module docstring)."""
    kv = KV_HEADS if gqa else HEADS
    group = HEADS // kv
    gamma = torch.where(LOGITS > CLIP["threshold"], CLIP["threshold"] / LOGITS, torch.ones_like(LOGITS))
    k = gamma.view(kv, group).amin(1).sqrt()
    q = gamma / k.repeat_interleave(group)
    if fused:
        per_head = torch.cat([q.view(kv, group), k[:, None], torch.ones(kv, 1)], 1).reshape(-1)
        return {"linear_qkv": per_head.repeat_interleave(HEAD_DIM)}
    return {"q_proj": q.repeat_interleave(HEAD_DIM), "k_proj": k.repeat_interleave(HEAD_DIM)}


# ------------------------------------------------------------------ grouping (host only)
def test_op_groups_split_by_device_and_dtype():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)  # device objects need no GPU
    keys = [
        (cuda0, torch.bfloat16), (cuda1, torch.bfloat16), (cuda0, torch.bfloat16), (cuda1, torch.float32),
        (cpu, torch.bfloat16), (meta, torch.bfloat16), (cuda1, torch.bfloat16), ("cuda:0", torch.float32),
        ("cuda:0", torch.bfloat16),
    ]
    assert op_groups(keys) == [[0, 2, 8], [1, 6], [3], [4], [5], [7]]
    assert op_groups([]) == []
    assert op_groups([(cpu, torch.float16)] * 3) == [[0, 1, 2]]


def test_apply_qk_clip_calls_the_op_once_per_device_and_dtype(monkeypatch, gen):
    # Layers on two devices (cpu and meta, the fake one) and in two dtypes: every op call gets one
    # device and one dtype, every factor vector sits on its weight's device, and the cpu weights
    # are scaled as on one device.
    layouts = [(False, False), (True, True), (False, True), (True, False), (False, False)]
    placement = [("cpu", torch.float32), ("meta", torch.float32), ("cpu", torch.bfloat16),
                 ("meta", torch.bfloat16), ("cpu", torch.float32)]
    model = Model(layouts)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    for layer, (device, dtype) in zip(model.layers, placement):
        layer.to(device=device, dtype=dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type == "cpu"}
    calls = []
    real = ops.qk_clip_

    def recording(weights, factors, block_rows):
        calls.append([(w.device, w.dtype, f.device) for w, f in zip(weights, factors)])
        if weights[0].device.type == "cpu":
            real(weights, factors, block_rows)

    monkeypatch.setattr(qk.ops, "qk_clip_", recording)
    logits = {i: LOGITS.clone() for i in range(len(layouts))}
    logits[1] = logits[1].to("meta")  # the logits of a layer may live elsewhere than its weights
    apply_qk_clip(_targets(model), logits, ClipConfig.from_dict(CLIP))

    keys = [{(d, t) for d, t, _ in call} for call in calls]
    assert all(len(k) == 1 for k in keys)
    assert [k.pop() for k in keys] == [(torch.device(d), t) for d, t in
                                       [("cpu", torch.float32), ("meta", torch.float32), ("cpu", torch.bfloat16),
                                        ("meta", torch.bfloat16)]]
    assert all(d == f for call in calls for d, _, f in call)
    assert sum(len(call) for call in calls) == 2 * 3 + 2  # q and k of three layers, two fused weights
    for i, ((fused, gqa), (device, dtype)) in enumerate(zip(layouts, placement)):
        if device != "cpu":
            continue
        for name, rows in _row_factors(model.layers[i], fused, gqa).items():
            w = getattr(model.layers[i], name).weight
            assert torch.equal(w, before[f"layers.{i}.{name}.weight"] * rows[:, None].to(dtype))
        assert torch.equal(model.layers[i].o_proj.weight, before[f"layers.{i}.o_proj.weight"])


# ------------------------------------------------------------------ the CUDA kernel against the CPU op
# (rows, cols, block_rows): one head, one column, rows of one head each, columns around the kernel's
# 1024-column tile (qk_clip.h), rows wider than many tiles, and more tiles (9000) than the warps of
# the 1024 blocks a weight gets at most (8192), so warps loop.
SHAPES = [(1, 1, 1), (7, 1, 7), (6, 5, 2), (64, 1023, 64), (96, 1024, 32), (48, 1025, 16), (4099, 3, 1),
          (165, 2049, 5), (9000, 5, 9), (2, 70_001, 1), (24, 4100, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _specials(dtype):
    """Zeros, infinities, NaN, the largest value, the smallest normal and subnormal of `dtype`."""
    info = torch.finfo(dtype)
    subnormal = torch.tensor([1], dtype=_BITS[dtype]).view(dtype).item()
    return torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.max, -info.max, info.tiny,
                         -info.tiny, subnormal, -subnormal, 1.0, -1.0], dtype=torch.float32).to(dtype)


def _weight(shape, dtype, gen, specials=True):
    w = (torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 9, shape, generator=gen).float())).to(dtype)
    if specials and w.numel() > 0:
        s = _specials(dtype)
        n = min(s.numel(), w.numel())
        w.view(-1)[:n] = s[:n]
    return w


def _factors(heads, gen):
    """Random factors in [0, 2); with 8 heads or more, heads 1 to 5 get 0, 1, a tiny one, 1.75, 1/2."""
    f = torch.rand(heads, generator=gen) * 2
    if heads >= 8:
        f[1:6] = torch.tensor([0.0, 1.0, 1e-30, 1.75, 0.5])
    return f


def _assert_same_bits(a, b):
    """Bitwise equal; a NaN need only be a NaN (CUDA's arithmetic returns the canonical NaN, the CPU
    keeps the payload)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits_a, bits_b = a.view(_BITS[a.dtype])[~nan], b.view(_BITS[b.dtype])[~nan]
    mismatch = (bits_a != bits_b).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} elements differ, first at flat index {mismatch[0].item()}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_qk_clip_equals_cpu_bitwise(dtype, gen):
    weights = [_weight((r, c), dtype, gen) for r, c, _ in SHAPES]
    blocks = [b for _, _, b in SHAPES]
    factors = [_factors(r // b, gen) for r, _, b in SHAPES]
    originals = [w.clone() for w in weights]
    on_gpu = [w.cuda() for w in weights]
    me.qk_clip_(weights, factors, blocks)
    me.qk_clip_(on_gpu, [f.cuda() for f in factors], blocks)
    for w, g in zip(weights, on_gpu):
        _assert_same_bits(w, g)
    # Both are the plain formula: each row times its head's factor in fp32, rounded once.
    for w, o, f, b in zip(weights, originals, factors, blocks):
        _assert_same_bits(w, (o.float() * f.repeat_interleave(b)[:, None]).to(dtype))


# A view of a bigger base: rows not contiguous with each other, storage offsets that break every
# alignment, a row-strided view, a single row, a slice of a 3-D tensor.
VIEWS = [
    ((50, 1100), lambda t: t[:, 7:1037], 10),
    ((40, 33), lambda t: t[4:34], 3),
    ((64, 17), lambda t: t[::2], 8),
    ((3, 2000), lambda t: t[1:2, 1:], 1),
    ((4, 12, 6), lambda t: t[1], 4),
    ((2100, 1031), lambda t: t[3:2083, 5:1030], 20),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_qk_clip_strided_and_offset_views_equal_cpu_bitwise(dtype, gen):
    bases = [_weight(shape, dtype, gen, specials=False) for shape, _, _ in VIEWS]
    bases_gpu = [b.cuda() for b in bases]
    views = [v(b) for b, (_, v, _) in zip(bases, VIEWS)]
    views_gpu = [v(b) for b, (_, v, _) in zip(bases_gpu, VIEWS)]
    assert [v.stride() for v in views] == [v.stride() for v in views_gpu]
    assert any(v.storage_offset() % 8 != 0 for v in views_gpu)
    blocks = [b for _, _, b in VIEWS]
    factors = [_factors(v.shape[0] // b, gen) for v, b in zip(views, blocks)]
    originals = [b.clone() for b in bases]
    me.qk_clip_(views, factors, blocks)
    me.qk_clip_(views_gpu, [f.cuda() for f in factors], blocks)
    for base, base_gpu, original in zip(bases, bases_gpu, originals):
        _assert_same_bits(base, base_gpu)  # the views' elements, and nothing outside them changed
        assert not torch.equal(base, original)


@pytest.mark.gpu
def test_cuda_qk_clip_many_weights_span_several_launches(gen):
    # 70 weights (3 launches of at most 32 descriptors), empty ones among them.
    shapes = [((i % 7) * 4, 1 + (i * 37) % 1500, 4 if i % 7 else 1) for i in range(68)] + [(3, 0, 3), (0, 5, 1)]
    weights = [_weight((r, c), torch.bfloat16, gen) for r, c, _ in shapes]
    factors = [_factors(r // b, gen) for r, _, b in shapes]
    blocks = [b for _, _, b in shapes]
    on_gpu = [w.cuda() for w in weights]
    me.qk_clip_(weights, factors, blocks)
    me.qk_clip_(on_gpu, [f.cuda() for f in factors], blocks)
    for w, g in zip(weights, on_gpu):
        _assert_same_bits(w, g)


@pytest.mark.gpu
@pytest.mark.large_memory
def test_cuda_qk_clip_over_2_pow_31_elements():
    # 524416 x 4097 bf16 (2^31 + 1048704 elements, 4.3 GB; two copies and a small fp32 chunk alive):
    # rows past element 2^31 need the 64-bit row addresses. Every element is checked against
    # torch's formula (equal to the op's, see test_hybrid_muon's test_qk_clip_op_scales_row_blocks).
    block, cols = 128, 4097
    rows = block * 4097
    assert rows * cols > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
    original = w.clone()
    factors = torch.rand(rows // block, device="cuda", generator=g) + 0.5
    me.qk_clip_([w], [factors], [block])
    chunk = 64 * block
    for start in range(0, rows, chunk):
        rs = slice(start, min(rows, start + chunk))
        row_factor = factors[start // block: (rs.stop + block - 1) // block].repeat_interleave(block)
        want = (original[rs].float() * row_factor[:, None]).to(torch.bfloat16)
        assert torch.equal(w[rs], want), f"rows {rs.start}..{rs.stop}"
    # The last elements, and the CPU op on the last heads, bit for bit.
    tail = slice(rows - 3 * block, rows)
    cpu = original[tail].cpu()
    me.qk_clip_([cpu], [factors[-3:].cpu()], [block])
    _assert_same_bits(w[tail], cpu)


# ------------------------------------------------------------------ a model on two GPUs
@pytest.mark.gpu
@TWO_GPUS
def test_qk_clip_layers_on_two_gpus(monkeypatch, gen):
    # MHA fp32 on cuda:0, GQA fp32 on cuda:1, fused QKV (GQA) bf16 on cuda:1 and fused MHA bf16 on
    # cuda:0: one op call per (device, dtype), each on its own device; the result equals the same
    # clip on a CPU copy bit for bit and the exact product with the factors.
    layouts = [(False, False), (False, True), (True, True), (True, False)]
    placement = [("cuda:0", torch.float32), ("cuda:1", torch.float32), ("cuda:1", torch.bfloat16),
                 ("cuda:0", torch.bfloat16)]
    model = Model(layouts)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    for layer, (_, dtype) in zip(model.layers, placement):
        layer.to(dtype=dtype)
    on_cpu = copy.deepcopy(model)
    for layer, (device, _) in zip(model.layers, placement):
        layer.to(device)
    calls = []
    real = ops.qk_clip_

    def recording(weights, factors, block_rows):
        calls.append({(w.device, w.dtype, f.device) for w, f in zip(weights, factors)})
        real(weights, factors, block_rows)

    monkeypatch.setattr(qk.ops, "qk_clip_", recording)
    config = ClipConfig.from_dict(CLIP)
    # Logits on the CPU, on the layer's GPU and on the other GPU.
    logits = {0: LOGITS.clone(), 1: LOGITS.to("cuda:1"), 2: LOGITS.to("cuda:0"), 3: LOGITS.to("cuda:1")}
    apply_qk_clip(_targets(model), logits, config)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    assert calls == [{(torch.device(d), t, torch.device(d))} for d, t in placement]
    before = {n: p.detach().clone() for n, p in on_cpu.named_parameters()}
    apply_qk_clip(_targets(on_cpu), {i: LOGITS.clone() for i in logits}, config)
    for (n, p), (_, q) in zip(model.named_parameters(), on_cpu.named_parameters()):
        assert torch.equal(p.cpu(), q), n
    for i, ((fused, gqa), (device, dtype)) in enumerate(zip(layouts, placement)):
        for name, rows in _row_factors(on_cpu.layers[i], fused, gqa).items():
            w = getattr(model.layers[i], name).weight
            assert w.device == torch.device(device)
            assert torch.equal(w.cpu(), before[f"layers.{i}.{name}.weight"] * rows[:, None].to(dtype))
        assert torch.equal(model.layers[i].o_proj.weight.cpu(), before[f"layers.{i}.o_proj.weight"])


@pytest.mark.gpu
@TWO_GPUS
def test_hybrid_muon_clips_layers_on_two_gpus(gen):
    # A whole HybridMuon step over attention layers on cuda:0 and cuda:1. With lr = 0 (and no weight
    # decay) the update leaves every weight as it was (p + 0 * u), so after the step the clipped
    # weights are exactly the originals times their power-of-two factors.
    layouts = [(False, True), (True, True), (False, False)]
    devices = ["cuda:0", "cuda:1", "cuda:1"]
    model = Model(layouts)
    for layer, device in zip(model.layers, devices):
        layer.to(device)
    names, params = zip(*model.named_parameters())
    opt = HybridMuon([{"params": list(params), "names": list(names), "use_muon": True}], lr=0.0,
                     clip_config=CLIP)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    before = {n: p.detach().cpu().clone() for n, p in zip(names, params)}
    opt.step(qk_logits={0: LOGITS.clone(), 1: LOGITS.to("cuda:1"), 2: LOGITS.to("cuda:0")})
    clipped = set()
    for i, (fused, gqa) in enumerate(layouts):
        for name, rows in _row_factors(model.layers[i], fused, gqa).items():
            w = getattr(model.layers[i], name).weight
            assert w.device == torch.device(devices[i])
            key = f"layers.{i}.{name}.weight"
            assert torch.equal(w.cpu(), before[key] * rows[:, None]), key
            clipped.add(key)
    for n, p in zip(names, params):
        if n not in clipped:
            assert torch.equal(p.cpu(), before[n]), n


# ------------------------------------------------------------------ once per step, capturable
def test_hybrid_muon_plans_the_clip_once_per_step(monkeypatch, gen):
    # Planning reads DTensor logits whole (a full_tensor collective each): the step's input check and
    # the clip after the update share one plan.
    model = Model([(False, True), (True, True)])
    names, params = zip(*model.named_parameters())
    opt = HybridMuon([{"params": list(params), "names": list(names), "use_muon": True}], lr=0.0, clip_config=CLIP)
    calls = []
    original = qk.plan_clip

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("megatron_eopt.optim.hybrid.plan_clip", counting)
    before = {n: p.detach().clone() for n, p in zip(names, params)}
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step(qk_logits={0: LOGITS.clone(), 1: LOGITS.clone()})
    assert len(calls) == 1
    for i, (fused, gqa) in enumerate([(False, True), (True, True)]):
        for name, rows in _row_factors(model.layers[i], fused, gqa).items():
            key = f"layers.{i}.{name}.weight"
            assert torch.equal(getattr(model.layers[i], name).weight, before[key] * rows[:, None]), key
    opt.step()  # no logits: nothing planned, nothing clipped again
    assert len(calls) == 1


@pytest.mark.gpu
def test_hybrid_muon_step_with_selected_heads_replays_from_a_cuda_graph(gen):
    # q_indices select heads through a device mask made once: the captured step copies nothing from
    # the host, and replays equal eager steps with the same logits.
    config = dict(CLIP, q_indices=[1, 2], k_indices=[0])

    def build():
        torch.manual_seed(0)
        model = Model([(False, True), (True, False)]).cuda()
        names, params = zip(*model.named_parameters())
        opt = HybridMuon([{"params": list(params), "names": list(names), "use_muon": True}], lr=0.02,
                         clip_config=config, fp32_matmul_prec="highest")
        return params, opt

    grads = [torch.randn(p.shape, generator=gen).cuda() for p in build()[0]]
    logits = {0: LOGITS.cuda(), 1: (LOGITS * 0.5).cuda()}
    params, opt = build()
    eager, eager_opt = build()
    for p, q, g in zip(params, eager, grads):
        p.grad, q.grad = g.clone(), g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: state, plan and head masks made outside the capture
        opt.step(qk_logits=logits)
    torch.cuda.current_stream().wait_stream(side)
    eager_opt.step(qk_logits=logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step(qk_logits=logits)
    for _ in range(2):
        graph.replay()
        eager_opt.step(qk_logits=logits)
    torch.cuda.synchronize()
    for p, q in zip(params, eager):
        assert torch.equal(p, q)
