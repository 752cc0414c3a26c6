"""``python -m megatron_eopt.doctor``: build facts and a self-test of every op on every device.

Run it first on a new machine (and on every new GPU): it prints the package version, the torch
and CUDA versions the library was built against next to the running ones, the compiled CUDA
architectures next to each device's capability, and then runs every op, a Muon step and an
AdaptiveMuon step on small awkward shapes (1 x n, n x 1, primes, tall, wide, batches) on every
device. On a GPU each result is compared with the CPU path; on the CPU with plain-PyTorch float64
references. On a GPU it also forces the cuBLAS GEMM fallback (what serves the problems cuBLASLt
has no algorithm for) and replays Newton-Schulz and a whole Muon step from CUDA graphs. Every
check prints pass or fail with its max error; the exit status is 1 when any
check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

import megatron_eopt as me
from megatron_eopt._library import (
    LIBRARY_PATH,
    build_info,
    cpu_symmetric_products,
    cuda_kernels_built,
    cuda_symmetric_products,
    forced_blas_fallback,
    gemm_counts,
    set_cuda_symmetric_products,
)
from megatron_eopt.coefficients import get_coefficients, get_muon_scale_factor
from megatron_eopt.ops._newton_schulz import _ns_arguments

# Awkward shapes (row / column vectors, primes both ways, square) and a batch.
MATRICES = [(1, 37), (37, 1), (97, 37), (37, 97), (16, 16)]
BATCH = (3, 24, 40)
ELEMENTWISE = [(1, 37), (37, 1), (97, 37), (7,), (3, 5, 4), (70_001,)]


@dataclass
class Result:
    device: str
    name: str
    error: float
    tolerance: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


# ------------------------------------------------------------------ float64 references (CPU checks)
def ns_ref(x: torch.Tensor, steps: int = 5, coefficient_type: str = "quintic") -> torch.Tensor:
    """docs/design.md §4.1 in float64: Frobenius-normalize, iterate on the short side."""
    x = x.double()
    tall = x.shape[-2] > x.shape[-1]
    w = x.mT if tall else x
    w = w / w.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-7)
    for a, b, c in get_coefficients(coefficient_type, steps):
        g = w @ w.mT
        w = a * w + (b * g + c * g @ g) @ w
    return w.mT if tall else w


def momentum_ref(g, m, momentum, nesterov):
    g, m = g.double(), m.double()
    m = m + (1 - momentum) * (g - m)
    return m, (g + momentum * (m - g) if nesterov else m)


# ------------------------------------------------------------------ the checks
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, gen, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _on(t: torch.Tensor, device: str) -> torch.Tensor:
    """A copy on `device` (never `t` itself: the ops work in place and the inputs are reused)."""
    return t.to(device, copy=True)


def _compare(device: str, reference: Callable[[], torch.Tensor], ours: Callable[[str], torch.Tensor]):
    """(result on device, reference): the CPU path for a GPU, the float64 reference on the CPU."""
    if device == "cpu":
        return ours("cpu"), reference()
    return ours(device), ours("cpu")


def check_newton_schulz(device: str, seed: int) -> list[Result]:
    out = []
    gen = _gen(seed)
    precisions = ["highest", "medium"] if device != "cpu" else ["highest"]
    for shape in MATRICES + [BATCH, (2, 64, 256)]:
        x = _randn(shape, gen)
        for precision in precisions:
            for algorithm in ("standard", "gram") if shape == (2, 64, 256) else ("auto",):
                got, want = _compare(
                    device,
                    lambda: ns_ref(x),
                    lambda d: me.newton_schulz(_on(x, d), precision=precision if d != "cpu" else "highest",
                                               algorithm=algorithm),
                )
                tol = 5e-2 if precision == "medium" else 2e-3
                out.append(Result(device, f"newton_schulz {precision} {algorithm} {tuple(shape)}", rel_err(got, want),
                                  tol))
    xs = [_randn(s, gen) for s in MATRICES]
    got, want = _compare(device, lambda: torch.cat([ns_ref(x).flatten() for x in xs]),
                         lambda d: torch.cat([y.flatten() for y in me.newton_schulz_list([_on(x, d) for x in xs],
                                                                                        precision="highest")]))
    out.append(Result(device, "newton_schulz_list highest", rel_err(got, want), 2e-3))
    # The in place op (the fused step's) equals the op bit for bit on this device, on each path: the
    # result over the input, or (fp32 with an even step count) through a copy.
    for precision in ["highest", "medium"] if device != "cpu" else ["highest"]:
        for algorithm in ("standard", "gram"):
            for steps in (4, 5):
                x = _on(_randn((2, 48, 80), gen), device)
                coefficients, repeat_last = _ns_arguments(steps, "quintic", None, 1e-7, precision, algorithm)
                args = (coefficients, steps, repeat_last, 1e-7, None, precision, algorithm)
                want = torch.ops.megatron_eopt.newton_schulz(x, *args)
                torch.ops.megatron_eopt.newton_schulz_(x, *args)
                out.append(Result(device, f"newton_schulz_ (in place) {precision} {algorithm} {steps} steps",
                                  rel_err(x, want), 0.0))
    return out


def check_split(device: str, seed: int) -> list[Result]:
    gen = _gen(seed)
    sizes, groups, n = [8, 4, 4], 2, 24  # a GQA QKV projection: 2 query groups
    x = _randn((groups * sum(sizes), n), gen)

    def reference():
        view = x.double().view(groups, sum(sizes), n)
        parts, offset = [], 0
        for s in sizes:
            part = view[:, offset : offset + s].reshape(groups * s, n)
            parts.append((ns_ref(part) * get_muon_scale_factor(groups * s, n)).view(groups, s, n))
            offset += s
        return torch.cat(parts, dim=1).view_as(x)

    got, want = _compare(device, reference,
                         lambda d: me.newton_schulz_split(_on(x, d), sizes, groups, precision="highest"))
    return [Result(device, "newton_schulz_split qkv highest", rel_err(got, want), 2e-3)]


def check_foreach(device: str, seed: int) -> list[Result]:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gen = _gen(seed)
        grads = [_randn(s, gen, dtype) for s in ELEMENTWISE]
        bufs = [_randn(s, gen, dtype) for s in ELEMENTWISE]
        params = [_randn(s, gen, dtype) for s in ELEMENTWISE]

        def run(d):
            g = [_on(t, d) for t in grads]
            m = [_on(t, d) for t in bufs]
            ns = [torch.empty(s, device=d) for s in ELEMENTWISE]
            me.foreach_momentum_(g, m, ns, momentum=0.9, nesterov=True)
            p = [_on(t, d) for t in params]
            me.foreach_update_(p, ns, [0.5 + i for i in range(len(p))], lr=0.01, weight_decay=0.1)
            return torch.cat([t.float().flatten() for t in m + ns + p])

        def reference():
            res = [momentum_ref(g, m, 0.9, True) for g, m in zip(grads, bufs)]
            new_p = [p.double() * (1 - 0.01 * 0.1) - 0.01 * (0.5 + i) * r[1] for i, (p, r) in enumerate(zip(params, res))]
            return torch.cat([t.flatten() for t in [r[0] for r in res] + [r[1] for r in res] + new_p])

        got, want = _compare(device, reference, run)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        out.append(Result(device, f"foreach_momentum_ + foreach_update_ {str(dtype)[6:]}", rel_err(got, want), tol))
    return out


def check_second_moment(device: str, seed: int) -> list[Result]:
    out = []
    gen = _gen(seed)
    shapes = [(1, 37), (37, 1), (97, 37), (16, 16)]
    updates = [_randn(s, gen) / math.sqrt(max(s)) for s in shapes]
    grads = [_randn(s, gen) for s in shapes]
    for method in me.MOMENT2_METHODS:
        def run(d, method=method):
            u = [_on(t, d) for t in updates]
            v = [me.new_moment2_buffer(method, t) + 0.5 for t in u]
            g = [_on(t, d) for t in grads]
            if method == "adamuon":
                me.adamuon_normalize_(u, v, beta2=0.9)
            elif method == "normuon":
                me.normuon_normalize_(u, v, beta2=0.9)
            else:
                me.namo_normalize_(u, v, g, g, beta2=0.9)
            return torch.cat([t.flatten() for t in u + v])

        def reference(method=method):
            res_u, res_v = [], []
            for o, g in zip(updates, grads):
                o = o.double()
                if method == "adamuon":
                    v = 0.9 * torch.full_like(o, 0.5) + 0.1 * o.square()
                    u = o / (v.sqrt() + 1e-8)
                elif method == "normuon":
                    dim = -1 if o.shape[0] >= o.shape[1] else -2
                    r = o.square().mean(dim=dim, keepdim=True)
                    v = 0.9 * torch.full_like(r, 0.5) + 0.1 * r
                    w = o * v.clamp_min(1e-8).rsqrt()
                    u = w * (o.norm() / w.norm().clamp_min(1e-8))
                else:
                    g = g.double()
                    v = 0.9 * torch.full((1,), 0.5, dtype=torch.float64) + 0.1 * g.norm().square()
                    u = o * (g.norm() / (v.sqrt() + 1e-8))
                res_u.append(u)
                res_v.append(v)
            return torch.cat([t.flatten() for t in res_u + res_v])

        got, want = _compare(device, reference, run)
        out.append(Result(device, f"{method}_normalize_", rel_err(got, want), 1e-5))
    return out


def check_optimizers(device: str, seed: int) -> list[Result]:
    out = []
    shapes = MATRICES + [(24, 40), (24, 40)]
    for name, make in (
        ("Muon step", lambda ps: me.optim.Muon(ps, lr=0.02, weight_decay=0.1, nesterov=True,
                                               fp32_matmul_prec="highest")),
        ("AdaptiveMuon (normuon) step", lambda ps: me.optim.AdaptiveMuon(ps, 0.02, 0.9, 0.1, moment2_method="normuon",
                                                                           fp32_matmul_prec="highest")),
    ):
        gen = _gen(seed)
        start = [_randn(s, gen) * 0.1 for s in shapes]
        grads = [[_randn(s, gen) for s in shapes] for _ in range(2)]

        def run(d, make=make):
            params = [torch.nn.Parameter(_on(p, d)) for p in start]
            opt = make(params)
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = _on(g, d)
                opt.step()
            return torch.cat([(p.detach() - s.to(d)).flatten() for p, s in zip(params, start)])

        def reference(name=name):
            # Muon in float64 (docs/design.md §4.6; NorMuon §4.7), decoupled decay, Nesterov for Muon.
            params = [p.double() for p in start]
            bufs = [torch.zeros_like(p) for p in params]
            vs = [None] * len(params)
            adaptive = name.startswith("Adaptive")
            mu = 0.9 if adaptive else 0.95
            for step in grads:
                for i, g in enumerate(step):
                    params[i] = params[i] * (1 - 0.02 * 0.1)
                    bufs[i], x = momentum_ref(g, bufs[i], mu, not adaptive)
                    o = ns_ref(x)
                    if adaptive:
                        dim = -1 if o.shape[0] >= o.shape[1] else -2
                        r = o.square().mean(dim=dim, keepdim=True)
                        vs[i] = 0.95 * (vs[i] if vs[i] is not None else torch.zeros_like(r)) + 0.05 * r
                        w = o * vs[i].clamp_min(1e-8).rsqrt()
                        o = w * (o.norm() / w.norm().clamp_min(1e-8))
                    params[i] = params[i] - 0.02 * get_muon_scale_factor(*o.shape) * o
            return torch.cat([(p - s.double()).flatten() for p, s in zip(params, start)])

        got, want = _compare(device, reference, run)
        out.append(Result(device, name, rel_err(got, want), 2e-3))
    return out


def check_blas_fallback(device: str, seed: int) -> list[Result]:
    """The cuBLAS GEMM path that serves problems cuBLASLt has no algorithm for, forced on every
    GEMM, against the CPU path; and that it really ran."""
    if device == "cpu":
        return []
    out = []
    gen = _gen(seed + 1)
    for shape in MATRICES + [BATCH]:
        x = _randn(shape, gen)
        for precision in ("highest", "high", "medium"):
            for algorithm in ("standard", "gram"):
                before = gemm_counts()[1]
                with forced_blas_fallback():
                    got = me.newton_schulz(_on(x, device), precision=precision, algorithm=algorithm)
                    torch.cuda.synchronize(device)
                ran = gemm_counts()[1] - before
                want = me.newton_schulz(x, precision="highest", algorithm=algorithm)
                tol = {"highest": 2e-3, "high": 1e-2, "medium": 5e-2}[precision]
                out.append(Result(device, f"fallback GEMM {precision} {algorithm} {tuple(shape)}",
                                  rel_err(got, want) if ran > 0 else math.inf, tol,
                                  "" if ran > 0 else "the fallback did not run"))
    return out


def check_symmetric_products(device: str, seed: int) -> list[Result]:
    """Newton–Schulz with every symmetric product as lower block panels plus a mirror (a rule that
    panels these small shapes), against the CPU path; and that the panels really ran (more GEMMs)."""
    if device == "cpu":
        return []
    out = []
    gen = _gen(seed + 2)
    before_rule = cuda_symmetric_products()
    try:
        for shape in [(2, 320, 704), (1, 193, 193), (3, 200, 130)]:
            x = _randn(shape, gen)
            for precision in ("highest", "medium"):
                for algorithm in ("standard", "gram"):
                    set_cuda_symmetric_products(1)
                    before = sum(gemm_counts())
                    me.newton_schulz(_on(x, device), precision=precision, algorithm=algorithm)
                    full_calls = sum(gemm_counts()) - before
                    set_cuda_symmetric_products(4, 64)
                    before = sum(gemm_counts())
                    got = me.newton_schulz(_on(x, device), precision=precision, algorithm=algorithm)
                    torch.cuda.synchronize(device)
                    panel_calls = sum(gemm_counts()) - before
                    want = me.newton_schulz(x, precision="highest", algorithm=algorithm)
                    ran = panel_calls > full_calls
                    out.append(Result(device, f"symmetric panels {precision} {algorithm} {tuple(shape)}",
                                      rel_err(got, want) if ran else math.inf, 5e-2 if precision == "medium" else 2e-3,
                                      "" if ran else "the panels did not run"))
    finally:
        set_cuda_symmetric_products(*(before_rule or (None,)))
    return out


def check_graph_capture(device: str, seed: int) -> list[Result]:
    """Newton-Schulz and a whole Muon step captured in a CUDA graph after a warm-up, replayed on
    new inputs: equal to the same calls run eagerly."""
    if device == "cpu":
        return []
    out = []
    gen = _gen(seed + 2)
    dev = torch.device(device)
    for shape, precision, algorithm in (((97, 37), "medium", "standard"), ((3, 24, 40), "medium", "gram"),
                                        ((1, 37), "highest", "standard"), ((64, 256), "high", "gram")):
        static = _randn(shape, gen, device=device)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: plans, handles, allocations
            me.newton_schulz(static, precision=precision, algorithm=algorithm)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = me.newton_schulz(static, precision=precision, algorithm=algorithm)
        worst = 0.0
        for _ in range(2):
            fresh = _randn(shape, gen, device=device)
            static.copy_(fresh)
            graph.replay()
            eager = me.newton_schulz(fresh, precision=precision, algorithm=algorithm)
            torch.cuda.synchronize(dev)
            worst = max(worst, 0.0 if torch.equal(result, eager) else max(rel_err(result, eager), 1e-30))
        out.append(Result(device, f"graph replay newton_schulz {precision} {algorithm} {shape}", worst, 0.0))

    shapes = [(24, 40), (40, 24), (1, 37)]
    start = [_randn(s, gen, device=device) * 0.1 for s in shapes]
    steps = [[_randn(s, gen, device=device) for s in shapes] for _ in range(3)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    eager_params = [torch.nn.Parameter(p.clone()) for p in start]
    lr = torch.tensor(0.02, device=device)
    opt = me.optim.Muon(params, lr=lr, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest")
    eager = me.optim.Muon(eager_params, lr=0.02, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest")
    static_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static_grads):
        p.grad = g
    opt.init_state()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up (plans, device scalars), then params and state restored
        saved = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
        opt.step()
        for p, s0 in zip(params, start):
            p.data.copy_(s0)
            for k, v in saved[p].items():
                opt.state[p][k].copy_(v)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for t, grads in enumerate(steps):
        for s, g in zip(static_grads, grads):
            s.copy_(g)
        lr.fill_(0.02 / (t + 1))
        graph.replay()
        for p, g in zip(eager_params, grads):
            p.grad = g.clone()
        eager.param_groups[0]["lr"] = 0.02 / (t + 1)
        eager.step()
    torch.cuda.synchronize(dev)
    got = torch.cat([(p.detach() - s).flatten() for p, s in zip(params, start)])
    want = torch.cat([(p.detach() - s).flatten() for p, s in zip(eager_params, start)])
    out.append(Result(device, "graph replay Muon step (tensor lr)", rel_err(got, want), 1e-6))
    return out


def check_low_memory_state(device: str, seed: int) -> list[Result]:
    """The bf16 / int8 / fp8 state ops: on the CPU against float64 (NS input exact, state within its
    format's rounding); on a GPU bit for bit against the CPU (both run the same math and draws)."""
    from megatron_eopt import low_memory_state as lms

    out = []
    gen = _gen(seed)
    shapes = [(1, 300), (300, 1), (97, 37), (16, 512)]
    grads = [_randn(s, gen) for s in shapes]
    start = [_randn(s, gen) * 0.1 for s in shapes]
    # rel. L2 error of the stored state: stochastic rounding errs by at most one step of the grid
    state_tol = {"bf16": 1e-2, "int8": 3e-2, "fp8": 6e-2}
    for fmt, tol in state_tol.items():
        dtype = lms.momentum_dtype(fmt)
        stored = [lms.quantize(m, dtype) for m in start]

        def run(d, stored=stored):
            codes = [c.to(d, copy=True) for c, _ in stored]
            scales = [s.to(d, copy=True) for _, s in stored if s is not None]
            ns = [torch.empty(sh, device=d) for sh in shapes]
            lms.foreach_momentum_quantized_([_on(g, d) for g in grads], codes, scales, ns, momentum=0.9,
                                            nesterov=True, seed=torch.full((), seed + 1, dtype=torch.int64, device=d))
            back = [lms.dequantize(c, s) for c, s in zip(codes, scales or [None] * len(codes))]
            return torch.cat([t.flatten() for t in ns]), torch.cat([t.flatten() for t in back])

        if device == "cpu":
            ns, back = run("cpu")
            refs = [momentum_ref(g, lms.dequantize(c, s), 0.9, True) for g, (c, s) in zip(grads, stored)]
            want_ns = torch.cat([r[1].flatten() for r in refs])
            want_m = torch.cat([r[0].flatten() for r in refs])
            out.append(Result(device, f"foreach_momentum_quantized_ {fmt}: NS input", rel_err(ns, want_ns), 1e-6))
            out.append(Result(device, f"foreach_momentum_quantized_ {fmt}: state", rel_err(back, want_m), tol))
        else:
            got, want = run(device), run("cpu")
            out.append(Result(device, f"foreach_momentum_quantized_ {fmt} (bits vs CPU)",
                              rel_err(torch.cat(got), torch.cat(want)), 0.0))
    return out


CHECKS = [check_newton_schulz, check_split, check_foreach, check_second_moment, check_optimizers,
          check_low_memory_state, check_blas_fallback, check_symmetric_products, check_graph_capture]


def run_checks(devices: list[str], seed: int = 0) -> list[Result]:
    results = []
    for device in devices:
        for check in CHECKS:
            try:
                results += check(device, seed)
            except Exception as e:  # a crash is a failed check, reported with its cause
                detail = "".join(traceback.format_exception_only(type(e), e)).strip()
                results.append(Result(device, check.__name__.removeprefix("check_"), math.inf, 0.0, detail))
    return results


# ------------------------------------------------------------------ build facts
def arch_covers(archs: list[str], capability: tuple[int, int]) -> bool:
    """True when one of CMake's architecture entries runs on a device of this capability: machine
    code (``90-real``, ``90``) for the same major and a minor not above the device's, or PTX
    (``100``, ``90-virtual``) for any capability not above the device's."""
    major, minor = capability
    for entry in archs:
        number, _, kind = entry.partition("-")
        digits = "".join(ch for ch in number if ch.isdigit())
        if not digits:
            continue
        a_major, a_minor = int(digits[:-1] or 0), int(digits[-1])
        if number.endswith(("a", "f")):  # arch-specific machine code: that exact capability only
            if kind in ("", "real") and (a_major, a_minor) == (major, minor):
                return True
            continue
        if kind in ("", "real") and a_major == major and a_minor <= minor:
            return True
        if kind in ("", "virtual") and (a_major, a_minor) <= (major, minor):
            return True
    return False


def cpu_plan_lines() -> list[str]:
    """What the CPU Newton–Schulz runs for each size class, and why: the probe times this CPU
    measured (megatron_eopt.cpu_product_plan) and the settings that override them."""
    bf16 = me.cpu_bf16_products()
    syrk = cpu_symmetric_products()
    lines = [f"CPU: bf16 GEMM instructions {'found' if bf16['bf16_instructions'] else 'not found'}; AVX-512 "
             f"symmetric kernel fp32 {'runs' if syrk['available']['fp32'] else 'not available'}, bf16 "
             f"{'runs' if syrk['available']['bf16'] else 'not available'}; settings: set_cpu_symmetric_products "
             f"{syrk['mode']}, set_cpu_bf16_products {bf16['mode']}"]
    for side, label in ((256, "sides < 384"), (768, "sides 384 to 1535"), (2048, "sides >= 1536")):
        plan = me.cpu_product_plan(side)
        ms = plan["ms"]
        timed = ", ".join(f"{k} {v:.2f}" for k, v in ms.items() if v is not None)
        use = plan["in_use"]
        lines.append(f"CPU products, {label} (probe {plan['probe'][0]}x{plan['probe'][1]}, ms: {timed}): "
                     f"X·Xᵀ fp32 on {use['symmetric_fp32']} ({plan['measured']['gemm_fp32']} GEMM where ATen's), "
                     f"bf16 on {use['symmetric_bf16']} ({plan['measured']['gemm_bf16']}); \"medium\" on "
                     f"{use['medium']} GEMMs (bf16 {plan['bf16_speedup']:.2f}x fp32 for the Gram choice)"
                     + ("" if use == {k: plan["measured"][k] for k in use} else "; set by the settings"))
    return lines


def facts() -> tuple[list[str], bool]:
    """Lines about the build and the machine, and whether they show a problem."""
    info = build_info()
    ok = True
    lines = [f"megatron-eopt {me.__version__} ({LIBRARY_PATH})"]
    running = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    floor = tuple(int(v) for v in info["torch_floor"].split("."))
    supported = running >= floor
    lines.append(f"torch: built against {info['torch']} for torch >= {info['torch_floor']} (stable ABI), running "
                 f"{torch.__version__}"
                 + ("" if supported else f"  [UNSUPPORTED: needs torch >= {info['torch_floor']}]"))
    ok &= supported
    lines.extend(cpu_plan_lines())
    if not cuda_kernels_built():
        lines.append(f"CUDA kernels: not loaded: {info['cuda_status']}")
    else:
        lines.append(f"CUDA kernels: built with CUDA {info['cuda']} for {', '.join(info['cuda_archs'])}; "
                     f"torch's CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            covered = cuda_kernels_built() and arch_covers(info["cuda_archs"], cap)
            ok &= covered
            lines.append(f"cuda:{i}: {torch.cuda.get_device_name(i)}, capability {cap[0]}.{cap[1]}: "
                         + ("covered by the build" if covered else
                            "NO KERNEL for this device: rebuild with MEGATRON_EOPT_CUDA_ARCHS including "
                            f"{cap[0]}{cap[1]}"))
    else:
        lines.append("no CUDA device visible")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_eopt.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", help="device to test (repeatable); default: cpu and every GPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the test data")
    args = parser.parse_args(argv)
    lines, ok = facts()
    for line in lines:
        print(line)
    devices = args.device or (["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())
                                         if cuda_kernels_built()])
    results = run_checks(devices, args.seed)
    width = max(len(r.name) for r in results)
    for r in results:
        status = "PASS" if r.passed else "FAIL"
        print(f"{status}  {r.device:<7} {r.name:<{width}}  max rel err {r.error:.2e} (tol {r.tolerance:.0e})"
              + (f"  {r.detail}" if r.detail else ""))
    failed = [r for r in results if not r.passed]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed"
          + ("" if ok else "; the build does not match this machine (see above)"))
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
