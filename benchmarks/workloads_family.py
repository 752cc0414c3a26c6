"""Steps of Emerging-Optimizers 0.4's orthogonalized family: megatron-eopt's classes.

EO 0.4.0 itself is not installed (eo040_peer.py): its column is listed as skipped, with the
reason. The constructor arguments are the run's schedule and precision (hyper.py).
MuonHyperball's parameters start on the sphere of radius 1 (it refuses others).
"""

from __future__ import annotations

import torch

import eo040_peer
import hyper
from timing import Case, Impl, rotation_count
from workloads_step import OURS, _step_parity, ours_class, step_case

EO040 = "EO 0.4.0"


def _ns() -> dict:
    return dict(fp32_matmul_prec=hyper.PRECISION, coefficient_type=hyper.COEFFICIENT_TYPE, num_ns_steps=hyper.NS_STEPS)


def family_kwargs(cls_name: str) -> dict:
    """Constructor arguments of one family class, shared by ours and EO's."""
    base = dict(lr=hyper.LR, momentum=hyper.MOMENTUM)
    if cls_name == "Scion":
        return dict(base, **_ns())
    if cls_name == "MOP":
        return dict(base, weight_decay=hyper.WEIGHT_DECAY, fp32_matmul_prec=hyper.PRECISION)
    if cls_name in ("PolarGrad", "Spel"):
        return dict(base, weight_decay=hyper.WEIGHT_DECAY, nesterov=hyper.NESTEROV, **_ns())
    if cls_name == "MuonHyperball":
        return dict(base, weight_decay=hyper.WEIGHT_DECAY, nesterov=hyper.NESTEROV, hyperball_radius=1.0, **_ns())
    if cls_name == "Muown":
        return dict(base, weight_decay=hyper.WEIGHT_DECAY, **_ns())
    raise ValueError(f"unknown family class {cls_name!r}")


def build_family_case(name: str, description: str, shapes: list[tuple[int, int]], device: torch.device,
                      cls_name: str) -> Case:
    gen = torch.Generator(device=device).manual_seed(4321)
    start = [torch.randn(m, n, device=device, generator=gen) * 0.02 for m, n in shapes]
    if cls_name == "MuonHyperball":
        start = [t / t.norm() for t in start]
    params = [torch.nn.Parameter(t) for t in start]
    copies = rotation_count(sum(m * n for m, n in shapes) * 4, device, None)
    inputs = [[torch.randn(m, n, device=device, generator=gen) * 0.02 for m, n in shapes] for _ in range(copies)]
    kwargs = family_kwargs(cls_name)

    builders, skipped = {}, {}
    ours = ours_class(cls_name)
    if ours is None:
        skipped[OURS] = f"megatron_eopt.optim.{cls_name} is not in this build"
    else:
        builders[OURS] = lambda ps: ours(ps, **kwargs).step
    eo, why = eo040_peer.load()
    if why:
        skipped[EO040] = why
    else:
        eo_cls = getattr(eo, cls_name)
        builders[EO040] = lambda ps: eo_cls(ps, **kwargs).step

    impls = [Impl(impl, (lambda b=build: (lambda _grads, s=b(params): s())), is_ours=impl == OURS)
             for impl, build in builders.items()]
    parity = (lambda: _step_parity(builders, shapes, device)) if cls_name != "MuonHyperball" else None
    return step_case(name, description, inputs, impls, params, shapes, skipped, parity)
