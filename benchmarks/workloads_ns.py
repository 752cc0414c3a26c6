"""Newton–Schulz alone: one matrix, a batch of equal shapes, or a model's list of mixed shapes."""

from __future__ import annotations

import torch

import hyper
import ns_flops
import peers
from timing import Case, Impl, rotation_count

import megatron_eopt as me

OURS = "megatron-eopt"


def _rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b))
    den = sum(float(y.double().square().sum()) for y in b)
    return (num / max(den, 1e-300)) ** 0.5


def _as_list(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return list(out)


def _eo_ns_fn(muon_utils, eo_utils, **extra):
    def run(x: torch.Tensor):
        with eo_utils.fp32_matmul_precision(hyper.PRECISION):
            return muon_utils.newton_schulz(x, hyper.NS_STEPS, coefficient_type=hyper.COEFFICIENT_TYPE, eps=hyper.EPS,
                                            **extra)

    return run


def split_apply(x: torch.Tensor, sizes: list[int], groups: int, ns_fn) -> torch.Tensor:
    """Megatron's QKV split done by hand: view (groups, sum(sizes), n), cut, orthogonalize and scale
    each part as a (groups * size, n) matrix, put the parts back in place."""
    n = x.shape[1]
    parts = torch.split(x.view(groups, sum(sizes), n), sizes, dim=1)
    outs = []
    for part, size in zip(parts, sizes):
        o = ns_fn(part.reshape(groups * size, n)).float()
        outs.append((o * peers.shape_scale(groups * size, n, hyper.SCALE_MODE)).view(groups, size, n))
    return torch.cat(outs, dim=1).view(-1, n)


def _per_shape(fn):
    """fn over a list of 2-D matrices: equal shapes stacked and run as one batch."""

    def run(xs):
        out = [None] * len(xs)
        for group in peers.group_by_shape(xs):
            stacked = fn(torch.stack([xs[i] for i in group]))
            for i, o in zip(group, stacked.unbind(0)):
                out[i] = o
        return out

    return run


def _laid_out(fn, layout: str, split):
    """A batched NS function as a workload's layout calls it: per shape for a list of matrices, per
    part for a split projection, whole for a stack."""
    if layout == "list":
        return _per_shape(fn)
    if layout == "split":
        return lambda x: split_apply(x, *split, fn)
    return fn


def _implementations(layout: str, device: torch.device, split: tuple[list[int], int] | None = None):
    """name -> fn(input) for the given input layout ("single", "batch", "list" or "split"), the
    reasons for implementations left out, and notes on how some ran."""
    fns: dict[str, callable] = {}
    skipped: dict[str, str] = {}
    notes: list[str] = []
    a, b, c = hyper.COEFFICIENTS[0]

    if layout == "split":
        sizes, groups = split
        fns[OURS] = lambda x: me.newton_schulz_split(
            x, sizes, groups, steps=hyper.NS_STEPS, coefficient_type=hyper.COEFFICIENT_TYPE,
            precision=hyper.PRECISION, scale_mode=hyper.SCALE_MODE,
        )
    elif layout == "list":
        fns[OURS] = lambda xs: me.newton_schulz_list(
            xs, steps=hyper.NS_STEPS, coefficient_type=hyper.COEFFICIENT_TYPE, precision=hyper.PRECISION
        )
    else:
        fns[OURS] = lambda x: me.newton_schulz(
            x, steps=hyper.NS_STEPS, coefficient_type=hyper.COEFFICIENT_TYPE, precision=hyper.PRECISION
        )

    _, muon_utils, eo_utils, why = peers.emerging_optimizers()
    if why:
        skipped[peers.EO_NS] = why
    else:
        eo = _eo_ns_fn(muon_utils, eo_utils)
        # Emerging-Optimizers takes 2-D or 3-D input; a model's mixed shapes go one by one.
        if layout == "split":
            fns[peers.EO_NS] = lambda x: split_apply(x, *split, eo)
        else:
            fns[peers.EO_NS] = (lambda xs: [eo(x) for x in xs]) if layout == "list" else eo
        # Its Triton SYRK path: 2-D matrices only (it refuses a bf16 batch with use_syrk).
        why = peers.eo_syrk_unavailable(muon_utils, device.type, hyper.PRECISION)
        if why is None and layout == "batch":
            why = "use_syrk takes 2-D matrices only (Emerging-Optimizers refuses a batch with it)"
        if why:
            skipped[peers.EO_NS_SYRK] = why
        else:
            syrk = _eo_ns_fn(muon_utils, eo_utils, use_syrk=True)
            if layout == "split":
                fns[peers.EO_NS_SYRK] = lambda x: split_apply(x, *split, syrk)
            else:
                fns[peers.EO_NS_SYRK] = (lambda xs: [syrk(x) for x in xs]) if layout == "list" else syrk

    why = peers.torch_muon_available(hyper.PRECISION, None if hyper.single_row() else hyper.COEFFICIENT_TYPE)
    if why:
        skipped[peers.TORCH_NS] = why
    else:
        tns = peers.torch_ns_function()

        def torch_ns(x):
            return tns(x, (a, b, c), hyper.NS_STEPS, hyper.EPS)

        # 2-D only: batches and lists run matrix by matrix (it returns bf16, as its optimizer uses it).
        if layout == "single":
            fns[peers.TORCH_NS] = torch_ns
        elif layout == "split":
            fns[peers.TORCH_NS] = lambda x: split_apply(x, *split, torch_ns)
        else:
            fns[peers.TORCH_NS] = lambda xs: [torch_ns(x) for x in xs]

    fns[peers.COMPILED] = _laid_out(peers.compiled_newton_schulz(hyper.COEFFICIENTS, hyper.PRECISION), layout, split)

    gram, how = peers.gram_newton_schulz(hyper.COEFFICIENTS, device.type, hyper.EPS)
    if gram is None:
        skipped[peers.GRAM_NS] = how
    else:
        notes.append(f"{peers.GRAM_NS}: {how}, restarts before steps {peers.GRAM_NS_RESTARTS}")
        fns[peers.GRAM_NS] = _laid_out(gram, layout, split)
    return fns, skipped, notes


def build_ns_case(
    name: str,
    description: str,
    shapes: list[tuple[int, int]],
    layout: str,
    device: torch.device,
    split: tuple[list[int], int] | None = None,
) -> Case:
    """layout "single": shapes = [(m, n)]; "batch": B equal shapes as one (B, m, n); "list": mixed
    2-D; "split": one fused (rows, n) matrix cut as ``split = (sizes, groups)`` (shapes = [(rows, n)])."""
    gen = torch.Generator(device=device).manual_seed(1234)
    set_bytes = sum(m * n for m, n in shapes) * 4
    budget = None
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] // 4
    copies = rotation_count(set_bytes, device, budget)

    def make_input():
        mats = [torch.randn(m, n, device=device, generator=gen) for m, n in shapes]
        if layout in ("single", "split"):
            return mats[0]
        if layout == "batch":
            return torch.stack(mats)
        return mats

    inputs = [make_input() for _ in range(copies)]
    fns, skipped, notes = _implementations(layout, device, split)
    # The matrices each call orthogonalizes (split: its parts), for the FLOPs of each algorithm.
    if layout == "split":
        sizes, groups = split
        matrices = [(groups * size, shapes[0][1]) for size in sizes]
    else:
        matrices = list(shapes)
    impl_flops = {OURS: ns_flops.ours_flops(matrices, device.type), peers.GRAM_NS: ns_flops.gram_peer_flops(matrices)}
    impls = [Impl(n, (lambda f=f: f), is_ours=(n == OURS), flops=impl_flops.get(n)) for n, f in fns.items()]

    def parity() -> dict[str, float]:
        ref = [o.float() for o in _as_list(fns[OURS](inputs[0]))]
        if layout == "batch":
            ref = list(ref[0].unbind(0))
        diffs = {}
        for impl_name, fn in fns.items():
            if impl_name == OURS:
                continue
            out = [o.float() for o in _as_list(fn(inputs[0]))]
            if layout == "batch" and len(out) == 1:
                out = list(out[0].unbind(0))
            diffs[impl_name] = _rel_diff(out, ref)
        return diffs

    flops = sum(hyper.ns_flops(m, n) for m, n in matrices)
    return Case(
        name=name,
        kind="ns",
        description=description,
        inputs=inputs,
        impls=impls,
        flops=flops,
        skipped=skipped,
        parity=parity,
        notes=[f"{copies} rotating input copies"] + notes,
    )
