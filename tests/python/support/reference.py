"""Plain-PyTorch references of the package's math, evaluated in float64 where exactness matters."""

from __future__ import annotations

import math
import weakref

import torch

from megatron_eopt.newton_schulz import get_coefficients

# docs/design.md §9 tolerances on ||out - ref|| / ||ref||, by compute precision.
TOLERANCE = {"highest": 1e-5, "high": 1e-3, "medium": 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    err = (out - ref).norm() / ref.norm().clamp_min(1e-30)
    value = float(err)
    assert value == value, "NaN in the result"  # NaN never passes
    return value


def newton_schulz_ref(x, steps=5, coefficient_type="quintic", custom=None, eps=1e-7, transpose=None,
                      dtype=torch.float64):
    """NS exactly as docs/design.md §4.1, result in float64.

    dtype float64: everything in float64. Otherwise the reference packages' own recipe:
    normalize in fp32, then iterate with `dtype` storage (bf16 products accumulate in fp32).
    """
    coeffs = get_coefficients(coefficient_type, steps, custom)
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    X = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if transpose:
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    X = (X / norm).to(dtype)
    batched = X.ndim == 3
    if not batched:
        X = X.unsqueeze(0)
    for a, b, c in coeffs:  # the same fused products as Emerging-Optimizers' batched step
        A = X @ X.mT
        if c == 0.0:  # cubic rows (cubic5), as the reference packages branch (and torch's CPU bf16
            X = torch.baddbmm(X, A, X, beta=a, alpha=b)  # baddbmm drops beta when alpha is 0)
            continue
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    if not batched:
        X = X.squeeze(0)
    X = X.to(torch.float64)
    return X.mT if transpose else X


# Unit roundoff of the products' operands: fp32 ("highest"), TF32's 10-bit mantissa ("high" on
# CUDA; a CPU has no TF32 and computes "high" in fp32).
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11}


def ns_amplification(x, coefficient_type="quintic", steps=5, custom=None):
    """How much Newton-Schulz magnifies a relative rounding error, for this input and schedule.

    First-order model: singular value s of the normalized input follows s <- p_k(s) with
    p_k(s) = a s + b s^3 + c s^5, so a relative error e made on it at step k reaches the result
    as e * s_k * prod_{j >= k} |p_j'(s_j)| / |s_K|. Summed over the steps and maximized over the
    singular values; at least `steps` (one rounding per step with no magnification). Schedules
    that expand sigma = 1 steeply (cans: slope 26, polar_express: 13) reach 5e4 and 240 on rank-1
    inputs, where fp32 itself then lands 1e-3 from the exact result.
    """
    coeffs = get_coefficients(coefficient_type, steps, custom)
    # Several tolerances of one large input cost one SVD: the last call's input (the same live
    # tensor, unmodified since) and schedule give its result again.
    key = (x._version, coefficient_type, steps, None if custom is None else repr(custom))
    last = _last_amplification
    if last and last[0]() is x and last[1] == key:
        return last[2]
    X = x.detach().to("cpu", torch.float64)
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-300)
    worst = float(len(coeffs))
    for s in torch.linalg.svdvals(X).flatten().tolist():
        traj, slopes = [s], []
        for a, b, c in coeffs:
            v = traj[-1]
            slopes.append(abs(a + 3 * b * v * v + 5 * c * v**4))
            traj.append(a * v + b * v**3 + c * v**5)
        if abs(traj[-1]) < 1e-12:
            continue  # a zero singular value stays zero
        total, gain = 0.0, 1.0
        for k in reversed(range(len(coeffs))):
            gain *= slopes[k]
            total += gain * abs(traj[k])
        worst = max(worst, total / abs(traj[-1]))
    _last_amplification[:] = [weakref.ref(x), key, worst]
    return worst


_last_amplification: list = []  # (weak reference to the input, its version and schedule, amplification)


def ns_pair_amplification(x, coefficient_type="quintic", steps=5, custom=None):
    """How much Newton-Schulz magnifies an absolute perturbation of its (Frobenius-normalized) input,
    relative to the result's norm: the off-diagonal terms of the matrix function's derivative.

    With f the composed schedule, a perturbation E of X = U diag(s) V^T moves f(X) by terms
    (f(s_i) + f(s_j)) / (s_i + s_j) (and f(s_i) / s_i) times E's components in the singular
    bases, so ||df|| <= max of those x ||E||, against ||f(X)|| = sqrt(sum f(s)^2).
    ns_amplification follows each singular value alone; this adds the mixing of two: an input
    with two tiny singular values (a square matrix near rank deficiency) has f(s) / s near
    prod(a_k) (480 for quintic x5), where each singular value's own relative error stays small.
    """
    coeffs = get_coefficients(coefficient_type, steps, custom)
    X = x.detach().to("cpu", torch.float64)
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-300)
    worst = 1.0
    for sv in torch.linalg.svdvals(X.reshape(-1, *X.shape[-2:])):
        s = sv.tolist()
        f = []
        for v in s:
            for a, b, c in coeffs:
                v = a * v + b * v**3 + c * v**5
            f.append(v)
        norm = sum(v * v for v in f) ** 0.5
        if norm == 0:
            continue
        ratios = [abs(fi) / si for fi, si in zip(f, s) if si > 0]
        pairs = [abs(f[i] + f[j]) / (s[i] + s[j]) for i in range(len(s)) for j in range(i) if s[i] + s[j] > 0]
        worst = max(worst, max(ratios + pairs, default=0.0) / norm)
    return worst


def ns_tolerance(x, precision, device, coefficient_type="quintic", steps=5, custom=None):
    """Tolerance of an fp32 or TF32 Newton-Schulz result against the float64 reference.

    docs/design.md §9's figure where the arithmetic allows it, else 4 unit roundoffs times the input's
    amplification (ns_amplification): TF32 operands alone put a 5-step result 1e-3 to 6e-3 from the
    exact one (measured by emulating TF32 rounding on the CPU, and on an H100), and expanding
    schedules magnify fp32 rounding on inputs with a dominant singular value.
    """
    tf32 = precision == "high" and torch.device(device).type == "cuda"
    u = UNIT_ROUNDOFF["tf32" if tf32 else "fp32"]
    roundoffs = 4
    if min(x.shape[-2:]) == 1:
        # A vector's one singular value is its norm: a dot product over the long side, whose
        # rounding grows with log2 of its length in blocked or pairwise sums (ATen's GEMMs; the
        # symmetric kernel sums in blocks of 32), and a steep schedule then magnifies the first
        # step's error most (cans on a 64 x 1 input: 4.35 unit roundoffs seen through ATen's GEMM).
        roundoffs += math.log2(max(x.shape[-2:]))
    bound = max(TOLERANCE[precision], roundoffs * u * ns_amplification(x, coefficient_type, steps, custom))
    if tf32 and min(x.shape[-2:]) == 1:
        # A vector's TF32 rounding in B @ X turns its direction by about |B| / |p(s) / s| unit
        # roundoffs per step (3.9 in quintic's first), which ns_amplification (singular values only)
        # does not model: TF32 emulated on the CPU put 1-2% (round to nearest) to 10% (truncation)
        # of row-scaled (64, 1) draws up to 1.25x past the bound above.
        bound *= 1.5
    return bound


# bf16 unit roundoff (8 significant bits).
BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_input_tolerance(x, coefficient_type="quintic", steps=5, custom=None):
    """Tolerance against float64 of a result whose input was rounded to bf16 once and then iterated
    with fp32 products (the Gram iteration's "medium"): docs/design.md §9's 2e-2, or one bf16 rounding
    times the input's amplification (ns_amplification) where the schedule magnifies it more
    (polar_express on a 1 x n input: 238)."""
    return max(TOLERANCE["medium"], BF16_UNIT_ROUNDOFF * ns_amplification(x, coefficient_type, steps, custom))


def on_a_side_stream(fn):
    """``fn()`` run with a new CUDA stream current, that stream synchronized after: an op that
    launched on the default stream instead of the caller's current one would be read unfinished."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = fn()
    stream.synchronize()
    return out


def op_raises(kind, match: str):
    """pytest.raises for a direct ``torch.ops.megatron_eopt`` call that fails its argument checks.

    The op library uses the LibTorch stable ABI, which carries every C++ error to Python as a
    RuntimeError; the message leads with the Python type the wrappers re-raise it as
    ("ValueError: ..."), and that type (or one of a tuple of types) is checked here too.
    """
    import pytest

    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = "|".join(k.__name__ for k in kinds)
    return pytest.raises(RuntimeError, match=rf"^(?:{names}): (?s:.*){match}")
