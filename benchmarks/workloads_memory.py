"""Memory-bound ops alone, over a model's list of matrices, against torch._foreach_* and a per-tensor
loop doing the same math. Throughput counts the bytes each op must move: every tensor it reads
once plus every tensor it writes once (docs/benchmarks.md's floors: momentum over 1e9 fp32 params moves 16 GB)."""

from __future__ import annotations

import torch

import hyper
import peers
from timing import Case, Impl

import megatron_eopt as me

OURS = "megatron-eopt"


def _rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b))
    den = sum(float(y.double().square().sum()) for y in b)
    return (num / max(den, 1e-300)) ** 0.5


def _randn_list(shapes, gen, device, dtype=torch.float32):
    return [torch.randn(m, n, device=device, generator=gen).to(dtype) for m, n in shapes]


def _parity(run_impls: dict, make_state, outputs) -> dict[str, float]:
    """Runs each implementation once on its own copy of a fresh state; compares outputs with ours."""
    results = {}
    for name, run in run_impls.items():
        state = make_state()
        run(state)
        results[name] = outputs(state)
    ref = results.pop(OURS)
    return {name: _rel_diff(out, ref) for name, out in results.items()}


# ------------------------------------------------------------------ foreach_momentum_
def momentum_impls(ns_dtype: torch.dtype, device: torch.device):
    """name -> run(state) where state = (grads, bufs, ns_inputs); Nesterov EMA momentum."""
    mu = hyper.MOMENTUM
    wd = torch.zeros((), device=device)  # decoupled decay is applied by the update op

    def ours(state):
        grads, bufs, ns = state
        me.foreach_momentum_(grads, bufs, ns, momentum=mu, nesterov=True, weight_decay=wd,
                             weight_decay_method="decoupled")

    def foreach(state):
        grads, bufs, ns = state
        torch._foreach_lerp_(bufs, grads, 1.0 - mu)
        out = torch._foreach_lerp(grads, bufs, mu)
        if ns_dtype == torch.float32:
            ns[:] = out  # the new tensors are the NS input, no copy
        else:
            torch._foreach_copy_(ns, out)

    def loop(state):
        grads, bufs, ns = state
        for i, (g, b) in enumerate(zip(grads, bufs)):
            b.lerp_(g, 1.0 - mu)
            out = g.lerp(b, mu)
            ns[i] = out if ns_dtype == torch.float32 else out.to(ns_dtype)

    return {OURS: ours, peers.FOREACH: foreach, peers.LOOP: loop}


def memory_case(name: str, description: str, impls, bytes_moved: int, parity, note: str) -> Case:
    """A memory-bound workload of one call on prepared state: timed against the bytes it moves."""
    return Case(name=name, kind="memory", description=description, inputs=[None], impls=impls,
                bytes_moved=bytes_moved, parity=parity, notes=[note])


def build_momentum_case(name: str, shapes, ns_dtype: torch.dtype, device: torch.device) -> Case:
    gen = torch.Generator(device=device).manual_seed(7)
    grads, bufs = _randn_list(shapes, gen, device), _randn_list(shapes, gen, device)
    ns = [torch.empty(m, n, device=device, dtype=ns_dtype) for m, n in shapes]
    # The peers produce the NS input out of place (fp32: the list's entries are replaced).
    state = (grads, bufs, ns)
    impls_fns = momentum_impls(ns_dtype, device)
    impls = [Impl(n, (lambda f=f: (lambda _inp: f(state))), is_ours=n == OURS) for n, f in impls_fns.items()]
    numel = sum(m * n for m, n in shapes)
    ns_bytes = torch.empty((), dtype=ns_dtype).element_size()

    small = shapes[:3]

    def make_small():
        g2 = torch.Generator(device=device).manual_seed(8)
        return (_randn_list(small, g2, device), _randn_list(small, g2, device),
                [torch.empty(m, n, device=device, dtype=ns_dtype) for m, n in small])

    description = (f"foreach_momentum_ (Nesterov EMA), {len(shapes)} tensors, {numel / 1e6:.0f} M fp32 params, "
                   f"NS input in {str(ns_dtype).replace('torch.', '')}")
    return memory_case(name, description, impls,
                       bytes_moved=numel * (4 + 4 + 4 + ns_bytes),  # read grad, read + write buffer, write NS input
                       parity=lambda: _parity(impls_fns, make_small, lambda s: list(s[1]) + [t.float() for t in s[2]]),
                       note="bytes: grad read, buffer read and written, NS input written")


# ------------------------------------------------------------------ foreach_update_
def update_impls(device: torch.device, scales: list[float]):
    """name -> run(state) where state = (params, updates): decoupled decay, then the scaled update."""
    lr, wd = hyper.LR, hyper.WEIGHT_DECAY
    lr_t = torch.full((), lr, device=device)
    wd_t = torch.full((), wd, device=device)
    neg_scaled = [-lr * s for s in scales]

    def ours(state):
        params, updates = state
        me.foreach_update_(params, updates, scales, lr=lr_t, weight_decay=wd_t, weight_decay_method="decoupled")

    def foreach(state):
        params, updates = state
        torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_add_(params, torch._foreach_mul(updates, neg_scaled))

    def loop(state):
        params, updates = state
        for p, u, s in zip(params, updates, neg_scaled):
            p.mul_(1.0 - lr * wd)
            p.add_(u, alpha=s)

    return {OURS: ours, peers.FOREACH: foreach, peers.LOOP: loop}


def build_update_case(name: str, shapes, device: torch.device) -> Case:
    gen = torch.Generator(device=device).manual_seed(9)
    params = _randn_list(shapes, gen, device)
    updates = _randn_list(shapes, gen, device)
    scales = [peers.shape_scale(m, n, hyper.SCALE_MODE) for m, n in shapes]
    state = (params, updates)
    impls_fns = update_impls(device, scales)
    impls = [Impl(n, (lambda f=f: (lambda _inp: f(state))), is_ours=n == OURS) for n, f in impls_fns.items()]
    numel = sum(m * n for m, n in shapes)
    small = shapes[:3]
    small_fns = update_impls(device, scales[:3])

    def make_small():
        g2 = torch.Generator(device=device).manual_seed(10)
        return (_randn_list(small, g2, device), _randn_list(small, g2, device))

    description = f"foreach_update_ (decoupled decay + scaled update), {len(shapes)} tensors, {numel / 1e6:.0f} M fp32 params"
    return memory_case(name, description, impls,
                       bytes_moved=numel * (4 + 4 + 4),  # read param, read update, write param
                       parity=lambda: _parity(small_fns, make_small, lambda s: list(s[0])),
                       note="bytes: param read and written, update read")


# ------------------------------------------------------------------ second-moment normalizations
def _shorter_side_mean_square(o: torch.Tensor) -> torch.Tensor:
    m, n = o.shape
    return o.square().mean(dim=1, keepdim=True) if m >= n else o.square().mean(dim=0, keepdim=True)


def moment2_impls(method: str):
    """name -> run(state), state = (updates O, moment2 v, grads, ns_inputs); docs/design.md §4.7 math.

    torch._foreach has no row/column reductions: the NorMuon peer takes those per tensor and
    everything else as foreach ops; NAMO's norms are torch._foreach_norm.
    """
    beta2, eps = hyper.BETA2, hyper.MOMENT2_EPS

    if method == "adamuon":

        def ours(state):
            me.adamuon_normalize_(state[0], state[1], beta2=beta2, eps=eps)

        def foreach(state):
            o, v = state[0], state[1]
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, o, o, 1.0 - beta2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, eps)
            torch._foreach_div_(o, denom)

        def loop(state):
            for o, v in zip(state[0], state[1]):
                v.lerp_(o.square(), 1.0 - beta2)
                o.div_(v.sqrt().add_(eps))

    elif method == "normuon":

        def ours(state):
            me.normuon_normalize_(state[0], state[1], beta2=beta2, eps=eps)

        def foreach(state):
            o, v = state[0], state[1]
            norms = torch._foreach_norm(o)
            torch._foreach_lerp_(v, [_shorter_side_mean_square(x) for x in o], 1.0 - beta2)
            inv = torch._foreach_maximum(v, eps)
            torch._foreach_rsqrt_(inv)
            torch._foreach_mul_(o, inv)
            torch._foreach_mul_(o, torch._foreach_div(norms, torch._foreach_clamp_min(torch._foreach_norm(o), eps)))

        def loop(state):
            for o, v in zip(state[0], state[1]):
                norm = o.norm()
                v.lerp_(_shorter_side_mean_square(o), 1.0 - beta2)
                o.mul_(v.clamp_min(eps).rsqrt())
                o.mul_(norm / o.norm().clamp_min(eps))

    elif method == "namo":

        def ours(state):
            me.namo_normalize_(state[0], state[1], state[2], state[3], beta2=beta2, eps=eps)

        def foreach(state):
            o, v, grads, ns = state
            gnorm = torch._foreach_norm(grads)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, gnorm, gnorm, 1.0 - beta2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, eps)
            torch._foreach_mul_(o, torch._foreach_div(torch._foreach_norm(ns), denom))

        def loop(state):
            for o, v, g, x in zip(*state):
                v.mul_(beta2).add_(g.norm().square(), alpha=1.0 - beta2)
                o.mul_(x.norm() / (v.sqrt() + eps))

    else:
        raise ValueError(method)
    return {OURS: ours, peers.FOREACH: foreach, peers.LOOP: loop}


def build_moment2_case(name: str, method: str, shapes, device: torch.device) -> Case:
    from megatron_eopt import moment2_shape

    def make_state(shape_list, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        o = _randn_list(shape_list, gen, device)
        v = [torch.rand(moment2_shape(method, m, n), device=device, generator=gen) for m, n in shape_list]
        extra = (_randn_list(shape_list, gen, device), _randn_list(shape_list, gen, device)) if method == "namo" else ((), ())
        return (o, v) + extra

    state = make_state(shapes, 11)
    fns = moment2_impls(method)
    impls = [Impl(n, (lambda f=f: (lambda _inp: f(state))), is_ours=n == OURS) for n, f in fns.items()]
    numel = sum(m * n for m, n in shapes)
    moment2_numel = sum(torch.Size(moment2_shape(method, m, n)).numel() for m, n in shapes)
    if method == "namo":
        per_elem, what = 16, "O read and written, gradient and NS input read"
    else:
        per_elem, what = 8, "O read and written"
    description = f"{method}_normalize_, {len(shapes)} tensors, {numel / 1e6:.0f} M fp32 elements"
    return memory_case(name, description, impls,
                       bytes_moved=numel * per_elem + moment2_numel * 8,  # + the state read and written
                       parity=lambda: _parity(fns, lambda: make_state(shapes[:3], 12), lambda s: list(s[0]) + list(s[1])),
                       note=f"bytes: {what}, second moment read and written")
