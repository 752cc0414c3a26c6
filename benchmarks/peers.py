"""The implementations megatron-eopt is measured against, with the same hyper-parameters.

- Emerging-Optimizers 0.3.0: ``Muon`` (a per-parameter loop), its ``newton_schulz`` and its
  ``newton_schulz(use_syrk=True)`` (a Triton SYRK kernel for X·Xᵀ: bf16 on CUDA, 2-D inputs only).
- ``torch.optim.Muon`` (PyTorch >= 2.9, single-tensor loop) and its Newton–Schulz function.
- A plain-PyTorch batched implementation written for this benchmark: torch._foreach_* momentum,
  weight decay and update, equal shapes stacked, Newton–Schulz compiled with ``torch.compile``.
- gram-newton-schulz (Dao-AILab, PyPI ``gram-newton-schulz``): its ``GramNewtonSchulz`` with the
  torch backend (its GPU kernels need quack / CUTLASS, not installed), compiled as it does itself.
"""

from __future__ import annotations

import typing
from types import SimpleNamespace
from typing import Sequence

import torch

from megatron_eopt._precision import products_precision
from megatron_eopt.newton_schulz import get_muon_scale_factor

# Emerging-Optimizers 0.3.0 imports typing.override, which Python 3.11 lacks.
if not hasattr(typing, "override"):
    try:
        import typing_extensions

        typing.override = typing_extensions.override
    except ImportError:
        pass

EO_MUON = "Emerging-Optimizers Muon"
EO_ADAPTIVE = "Emerging-Optimizers AdaptiveMuon"
EO_NS = "Emerging-Optimizers newton_schulz"
EO_NS_SYRK = "Emerging-Optimizers newton_schulz, use_syrk"
TORCH_MUON = "torch.optim.Muon"
TORCH_NS = "torch.optim.Muon NS"
COMPILED = "torch.compile batched"
FOREACH = "torch._foreach"
LOOP = "per-tensor loop"
GRAM_NS = "gram-newton-schulz (torch)"


def emerging_optimizers():
    """The installed Emerging-Optimizers package, or the reason it cannot be used."""
    try:
        import emerging_optimizers.orthogonalized_optimizers as eo  # noqa: F401
        from emerging_optimizers.orthogonalized_optimizers import muon_utils
        from emerging_optimizers import utils as eo_utils

        return eo, muon_utils, eo_utils, None
    except Exception as exc:  # not installed, or needs a newer Python
        return None, None, None, f"emerging_optimizers not importable ({type(exc).__name__}: {exc})"


def eo_syrk_unavailable(muon_utils, device_type: str, precision: str) -> str | None:
    """None when the installed Emerging-Optimizers' newton_schulz takes ``use_syrk`` (0.3.0 does)
    and would use its kernel here (CUDA, bf16 products), else why not."""
    import inspect

    if "use_syrk" not in inspect.signature(muon_utils.newton_schulz).parameters:
        return "the installed Emerging-Optimizers has no use_syrk (0.3.0 and later have)"
    if device_type != "cuda" or precision != "medium":
        return "use_syrk runs its Triton kernel on CUDA with bf16 products only"
    return None


def torch_muon_available(precision: str | None = None, schedule: str | None = None) -> str | None:
    """None when torch.optim.Muon exists and can run the configuration, else why not: it takes one
    (a, b, c) row (``schedule``: the run's coefficient type when that has more) and computes in bf16
    only (``precision``: the run's, None for the default)."""
    if not hasattr(torch.optim, "Muon"):
        return f"torch {torch.__version__} has no torch.optim.Muon (needs >= 2.9)"
    if schedule is not None:
        return f"takes one (a, b, c) row; this run's schedule is {schedule}"
    if precision not in (None, "medium"):
        return f"computes in bf16 only; this run's precision is {precision}"
    return None


def torch_ns_function():
    from torch.optim import _muon

    return _muon._zeropower_via_newtonschulz


def compute_dtype(precision: str) -> torch.dtype:
    """The storage type of a precision's products: bf16 for "medium", fp32 otherwise."""
    return torch.bfloat16 if precision == "medium" else torch.float32


# ------------------------------------------------------------------ plain batched Newton–Schulz
def plain_newton_schulz(x: torch.Tensor, coefficients: Sequence[tuple[float, float, float]], eps: float = 1e-7,
                        dtype: torch.dtype = torch.bfloat16):
    """Batched NS in plain PyTorch: fp32 Frobenius normalization, products in ``dtype``."""
    batched = x if x.dim() == 3 else x.unsqueeze(0)
    transpose = batched.size(-2) > batched.size(-1)
    if transpose:
        batched = batched.mT
    X = batched / torch.linalg.vector_norm(batched, dim=(-2, -1), keepdim=True).clamp_min(eps)
    X = X.to(dtype)
    for a, b, c in coefficients:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    out = X.to(torch.float32)
    if transpose:
        out = out.mT
    return out if x.dim() == 3 else out.squeeze(0)


_COMPILED_NS = {}


def compiled_newton_schulz(coefficients: Sequence[tuple[float, float, float]], precision: str = "medium"):
    """One compiled NS per schedule and precision; dynamic shapes so every matrix shape shares the
    compilation."""
    key = (tuple(tuple(row) for row in coefficients), precision)
    if key not in _COMPILED_NS:
        rows = [tuple(row) for row in coefficients]
        dtype = compute_dtype(precision)
        compiled = torch.compile(lambda x: plain_newton_schulz(x, rows, dtype=dtype), dynamic=True)

        def ns(x):
            with products_precision(precision):
                return compiled(x)

        _COMPILED_NS[key] = ns
    return _COMPILED_NS[key]


# ------------------------------------------------------------------ gram-newton-schulz
def _fp32_backend():
    """gram-newton-schulz's torch backend with every product in fp32: its iteration casts X to fp16
    first, and a CPU without native fp16 GEMMs runs fp16 products about 100x slower than fp32. Only
    that first rounding to fp16 stays; R, Q and the result are fp32."""

    def f(t):
        return t.float()

    return SimpleNamespace(
        sym_mm=lambda A, B: f(A) @ f(B),
        sym_baddbmm=lambda A, B, C, alpha=1.0, beta=1.0: torch.baddbmm(f(C), f(A), f(B), alpha=alpha, beta=beta),
        mm=lambda A, B: f(A) @ f(B),
        mm_add=lambda A, B, C, beta: torch.baddbmm(f(C), f(A), f(B), beta=beta),
    )


GRAM_NS_RESTARTS = [2]  # GramNewtonSchulz's default: one restart before the third step


def gram_newton_schulz(coefficients: Sequence[tuple[float, float, float]], device_type: str, eps: float = 1e-7):
    """gram-newton-schulz's GramNewtonSchulz (torch backend, its own compilation) as fn(x) -> fp32,
    and a note on how it ran; or (None, why not)."""
    try:
        import gram_newton_schulz as gns
        from gram_newton_schulz import gram_newton_schulz as gns_impl
    except Exception as exc:  # not installed
        return None, f"gram_newton_schulz not importable ({type(exc).__name__}: {exc})"
    rows = [list(row) for row in coefficients]
    if device_type == "cuda":
        # Its own torch path: fp16 products, compiled with CUDA graphs (its default).
        ns = gns.GramNewtonSchulz(ns_epsilon=eps, ns_use_kernels=False, ns_coefficients=rows,
                                  gram_newton_schulz_reset_iterations=GRAM_NS_RESTARTS)
        return (lambda x: ns(x).float()), "torch backend, fp16 products"
    compile_kwargs = {"fullgraph": True}  # its default minus "reduce-overhead" (CUDA graphs)
    ns = gns.GramNewtonSchulz(ns_epsilon=eps, ns_use_kernels=False, ns_coefficients=rows,
                              gram_newton_schulz_reset_iterations=GRAM_NS_RESTARTS, compile_kwargs=compile_kwargs)
    backend = _fp32_backend()
    ns._gram_torch = gns_impl._make_compiled_gram(backend, rows, GRAM_NS_RESTARTS, eps, compile_kwargs)
    ns._standard_torch = gns_impl._make_compiled_standard(backend, rows, eps, compile_kwargs)
    return (lambda x: ns(x).float()), "torch backend with fp32 products (X rounded to fp16 once)"


def group_by_shape(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append(i)
    return list(groups.values())


def shape_scale(m: int, n: int, mode: str) -> float:
    """Muon's update scale of an (m, n) matrix (a formula every implementation shares)."""
    return get_muon_scale_factor(m, n, mode)


class PlainBatchedMuon:
    """Muon (decoupled weight decay, EMA momentum, optional Nesterov) written as a user would batch it.

    Elementwise work runs as torch._foreach_* kernels over all parameters; the momentum of equal
    shapes is stacked and orthogonalized by one compiled batched Newton–Schulz.
    """

    def __init__(self, params, *, lr, momentum, weight_decay, nesterov, coefficients, scale_mode, extra_scale,
                 precision="medium"):
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov
        self.ns = compiled_newton_schulz(coefficients, precision)
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.groups = group_by_shape(self.params)
        self.scales = [
            shape_scale(self.params[g[0]].size(-2), self.params[g[0]].size(-1), scale_mode) * extra_scale
            for g in self.groups
        ]

    def _decay_and_momentum(self):
        """Decoupled decay and the momentum EMA over every parameter; returns (params, grads, updates)."""
        params, grads, bufs = self.params, [p.grad for p in self.params], self.buffers
        if self.weight_decay != 0:
            torch._foreach_mul_(params, 1.0 - self.lr * self.weight_decay)
        torch._foreach_lerp_(bufs, grads, 1.0 - self.momentum)
        return params, grads, torch._foreach_lerp(grads, bufs, self.momentum) if self.nesterov else bufs

    @torch.no_grad()
    def step(self):
        params, _, updates = self._decay_and_momentum()
        for group, scale in zip(self.groups, self.scales):
            stacked = torch.stack([updates[i] for i in group])
            orthogonal = self.ns(stacked)
            torch._foreach_add_([params[i] for i in group], list(orthogonal.unbind(0)), alpha=-self.lr * scale)


# ------------------------------------------------------------------ plain batched AdaptiveMuon
def plain_moment2_normalize(O, V, grads, ns_inputs, method: str, beta2: float, eps: float):
    """docs/design.md §4.7 on a stacked batch O (B, m, n) of raw NS outputs; V is the stacked state."""
    if method == "adamuon":
        V.lerp_(O.square(), 1.0 - beta2)
        return O / (V.sqrt() + eps)
    if method == "normuon":
        dim = -1 if O.size(-2) >= O.size(-1) else -2
        V.lerp_(O.square().mean(dim=dim, keepdim=True), 1.0 - beta2)
        U = O * V.clamp_min(eps).rsqrt()
        norm_o = torch.linalg.vector_norm(O, dim=(-2, -1), keepdim=True)
        norm_u = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True)
        return U * (norm_o / norm_u.clamp_min(eps))
    if method == "namo":
        V.lerp_(torch.linalg.vector_norm(grads, dim=(-2, -1), keepdim=True).square(), 1.0 - beta2)
        return O * (torch.linalg.vector_norm(ns_inputs, dim=(-2, -1), keepdim=True) / (V.sqrt() + eps))
    raise ValueError(f"unknown moment2 method {method!r}")


_COMPILED_NORMALIZE = {}


def compiled_moment2_normalize(method: str):
    if method not in _COMPILED_NORMALIZE:

        def normalize(O, V, grads, ns_inputs, beta2, eps):
            return plain_moment2_normalize(O, V, grads, ns_inputs, method, beta2, eps)

        _COMPILED_NORMALIZE[method] = torch.compile(normalize, dynamic=True)
    return _COMPILED_NORMALIZE[method]


class PlainBatchedAdaptiveMuon(PlainBatchedMuon):
    """PlainBatchedMuon with AdaptiveMuon's second moment (kept stacked per shape group), applied
    to the raw NS output before the Muon scale; NS and the normalization are compiled."""

    def __init__(self, params, *, moment2_method, beta2, eps, **kwargs):
        super().__init__(params, **kwargs)
        self.method, self.beta2, self.eps = moment2_method, beta2, eps
        self.normalize = compiled_moment2_normalize(moment2_method)
        self.moment2 = []
        for group in self.groups:
            m, n = self.params[group[0]].shape
            if moment2_method == "adamuon":
                shape = (len(group), m, n)
            elif moment2_method == "normuon":
                shape = (len(group), m, 1) if m >= n else (len(group), 1, n)
            else:
                shape = (len(group), 1, 1)
            self.moment2.append(torch.zeros(shape, device=self.params[group[0]].device))

    @torch.no_grad()
    def step(self):
        params, grads, updates = self._decay_and_momentum()
        for group, scale, V in zip(self.groups, self.scales, self.moment2):
            ns_in = torch.stack([updates[i] for i in group])
            g = torch.stack([grads[i] for i in group]) if self.method == "namo" else ns_in
            normalized = self.normalize(self.ns(ns_in), V, g, ns_in, self.beta2, self.eps)
            torch._foreach_add_([params[i] for i in group], list(normalized.unbind(0)), alpha=-self.lr * scale)
