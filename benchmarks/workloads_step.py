"""Whole optimizer steps on a model's set of hidden matrices, every optimizer with the same settings."""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

import hyper
import ns_flops
import peers
from timing import Case, Impl, rotation_count

OURS = "megatron-eopt"

StepBuilder = Callable[[list[torch.Tensor]], Callable[[], None]]


def ours_class(name: str):
    """megatron_eopt.optim.<name> when this build has it, else None."""
    if importlib.util.find_spec("megatron_eopt.optim") is None:
        return None
    import megatron_eopt.optim as optim

    return getattr(optim, name, None)


def _muon_kwargs_eo_style() -> dict:
    """Emerging-Optimizers' Muon constructor (megatron-eopt's Muon takes the same)."""
    return dict(
        hyper.step_settings(),
        weight_decay_method="decoupled",
        fp32_matmul_prec=hyper.PRECISION,
        coefficient_type=hyper.COEFFICIENT_TYPE,
        num_ns_steps=hyper.NS_STEPS,
        scale_mode=hyper.SCALE_MODE,
        extra_scale_factor=hyper.EXTRA_SCALE,
    )


def _adaptive_kwargs(method: str) -> dict:
    return dict(_muon_kwargs_eo_style(), moment2_method=method, beta2=hyper.BETA2, eps=hyper.MOMENT2_EPS)


def step_builders(adaptive: str | None = None) -> tuple[dict[str, StepBuilder], dict[str, str]]:
    """name -> (params -> step()) for every available implementation, and why others are missing.

    ``adaptive``: None for Muon, else the AdaptiveMuon second-moment method (adamuon, normuon, namo).
    """
    builders: dict[str, StepBuilder] = {}
    skipped: dict[str, str] = {}
    cls_name = "Muon" if adaptive is None else "AdaptiveMuon"
    kwargs = _muon_kwargs_eo_style() if adaptive is None else _adaptive_kwargs(adaptive)

    ours = ours_class(cls_name)
    if ours is None:
        skipped[OURS] = f"megatron_eopt.optim.{cls_name} is not in this build"
    else:
        builders[OURS] = lambda params: ours(params, **kwargs).step

    eo, _, _, why = peers.emerging_optimizers()
    eo_name = peers.EO_MUON if adaptive is None else peers.EO_ADAPTIVE
    if why:
        skipped[eo_name] = why
    else:
        eo_cls = getattr(eo, cls_name)
        builders[eo_name] = lambda params: eo_cls(params, **kwargs).step

    if adaptive is not None:
        builders[peers.COMPILED] = lambda params: peers.PlainBatchedAdaptiveMuon(
            params, moment2_method=adaptive, beta2=hyper.BETA2, eps=hyper.MOMENT2_EPS, **_plain_kwargs()
        ).step
        skipped[peers.TORCH_MUON] = "has no second-moment (AdaptiveMuon) variant"
        return builders, skipped

    why = peers.torch_muon_available(hyper.PRECISION, None if hyper.single_row() else hyper.COEFFICIENT_TYPE)
    if why:
        skipped[peers.TORCH_MUON] = why
    else:
        assert hyper.SCALE_MODE == "shape_scaling"  # torch's "original" lr adjustment

        def torch_muon(params):
            return torch.optim.Muon(
                params,
                lr=hyper.LR,
                weight_decay=hyper.WEIGHT_DECAY,
                momentum=hyper.MOMENTUM,
                nesterov=hyper.NESTEROV,
                ns_coefficients=hyper.COEFFICIENTS[0],
                eps=hyper.EPS,
                ns_steps=hyper.NS_STEPS,
                adjust_lr_fn="original",
            ).step

        builders[peers.TORCH_MUON] = torch_muon

    builders[peers.COMPILED] = lambda params: peers.PlainBatchedMuon(params, **_plain_kwargs()).step
    skipped[peers.GRAM_NS] = (
        "its Muon has its own lr adjustment and runs Newton–Schulz in fp16 (no fast path on CPUs); "
        "its Newton–Schulz is measured in the ns_ workloads"
    )
    return builders, skipped


def _plain_kwargs() -> dict:
    return dict(
        hyper.step_settings(),
        coefficients=hyper.COEFFICIENTS,
        scale_mode=hyper.SCALE_MODE,
        extra_scale=hyper.EXTRA_SCALE,
        precision=hyper.PRECISION,
    )


def _install_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def _step_parity(builders: dict[str, StepBuilder], shapes: list[tuple[int, int]], device) -> dict[str, float]:
    """Two steps from the same start on a few matrices of the set: each peer's change vs ours."""
    if OURS not in builders:
        return {}
    distinct = list(dict.fromkeys(shapes))
    picked = sorted(distinct, key=lambda s: s[0] * s[1])[:3]  # the smallest shapes keep this cheap
    gen = torch.Generator(device=device).manual_seed(99)
    start = [torch.randn(m, n, device=device, generator=gen) * 0.02 for m, n in picked]
    grads = [[torch.randn(m, n, device=device, generator=gen) for m, n in picked] for _ in range(2)]

    deltas = {}
    for name, build in builders.items():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        step = build(params)
        for g in grads:
            _install_grads(params, [x.clone() for x in g])
            step()
        deltas[name] = [p.detach() - s for p, s in zip(params, start)]
    ref = deltas[OURS]
    out = {}
    for name, delta in deltas.items():
        if name == OURS:
            continue
        num = sum(float((d.double() - r.double()).square().sum()) for d, r in zip(delta, ref))
        den = sum(float(r.double().square().sum()) for r in ref)
        out[name] = (num / max(den, 1e-300)) ** 0.5
    return out


def build_step_case(
    name: str, description: str, shapes: list[tuple[int, int]], device: torch.device, adaptive: str | None = None
) -> Case:
    """One Muon (or AdaptiveMuon with ``adaptive`` = its moment2 method) step over ``shapes``
    (each a separate parameter, as in a model)."""
    gen = torch.Generator(device=device).manual_seed(4321)
    params = [torch.nn.Parameter(torch.randn(m, n, device=device, generator=gen) * 0.02) for m, n in shapes]
    set_bytes = sum(m * n for m, n in shapes) * 4
    budget = torch.cuda.mem_get_info(device)[0] // 8 if device.type == "cuda" else None
    copies = rotation_count(set_bytes, device, budget)
    inputs = [[torch.randn(m, n, device=device, generator=gen) for m, n in shapes] for _ in range(copies)]

    builders, skipped = step_builders(adaptive)
    impls = []
    ours_flops = ns_flops.ours_flops(shapes, device.type)
    for impl_name, build in builders.items():
        # Each optimizer keeps its own state; all of them update the same parameters.
        impls.append(Impl(impl_name, (lambda b=build: (lambda _grads, s=b(params): s())), is_ours=impl_name == OURS,
                          flops=ours_flops if impl_name == OURS else None))

    return step_case(name, description, inputs, impls, params, shapes, skipped,
                     parity=lambda: _step_parity(builders, shapes, device), note=f", {copies} gradient sets")


def step_case(name: str, description: str, inputs, impls, params, shapes, skipped, parity, note: str = "") -> Case:
    """A step workload on ``params`` (matrices of ``shapes``): each call's gradients installed first,
    FLOPs counted as its Newton–Schulz's."""
    return Case(
        name=name,
        kind="step",
        description=description,
        inputs=inputs,
        impls=impls,
        prepare=lambda grads: _install_grads(params, grads),
        flops=sum(hyper.ns_flops(m, n) for m, n in shapes),
        skipped=skipped,
        parity=parity,
        notes=[f"{len(shapes)} matrices, {sum(m * n for m, n in shapes) / 1e6:.1f} M params{note}"],
    )
