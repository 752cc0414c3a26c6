"""Muown: Muon with internal weight normalization (Emerging-Optimizers 0.4 contrib ``Muown``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.optim.optimizer import ParamsT

from ..step_stats import records_step_stats
from .muon import Muon


class Muown(Muon):
    """Muown (arXiv:2605.10797): each 2-D weight ``W = g ⊙ v/‖v‖_row`` is split into a per-row
    magnitude ``g`` (bias-corrected Adam, ``betas``, ``adam_eps``, decoupled weight decay) and a
    direction ``v`` (Muon: momentum EMA of the direction gradient, Newton–Schulz, scale), both at
    ``lr``; the weight is rebuilt as ``g · v_new/‖v_new‖_row``. EO 0.4 contrib's constructor,
    defaults and numerics; the Newton–Schulz of all parameters of one shape runs as one batch.
    State: ``step``, ``g``, ``v_norm``, ``momentum_buffer`` (fp32), ``m_g``, ``v_g``. ``step`` is a
    0-dim float64 CPU tensor, as torch's Adam keeps its step: an eager step does its count and bias
    corrections on the host (no device work per parameter), and a compiled step is one graph for
    every count (torch.compile retraces for each new Python int; it moves the tensor to the
    param's device). Checkpoints keep EO's Python int, both ways.
    A param that is not a matrix is a TypeError at ``step()`` (when it has a gradient), as in EO.
    """

    _nd_error_type = TypeError  # EO's Muown

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        use_syrk: bool = False,
    ) -> None:
        self.betas = betas
        self.adam_eps = adam_eps
        super().__init__(
            params,
            lr,
            momentum,
            weight_decay,
            nesterov=False,
            weight_decay_method="decoupled",
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            use_syrk=use_syrk,
        )

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            if p.dim() != 2:
                raise TypeError("Muown is only supported for 2D parameters")
            state = self.state[p]
            if len(state) == 0:
                # Start where Muon would: g = v_norm = the row norms, floored so a zero row gives no 0/0.
                row_norm = p.norm(dim=1, keepdim=True).to(torch.float32).clamp_min(1e-12)
                state["step"] = _step_tensor(0)
                state["g"] = row_norm.clone()
                state["v_norm"] = row_norm.clone()
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                state["m_g"] = torch.zeros_like(row_norm)
                state["v_g"] = torch.zeros_like(row_norm)

    @torch.no_grad()
    def init_state(self) -> None:
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    @torch.no_grad()
    @records_step_stats
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            raise ValueError("closure is not supported")
        error = self._step_time_error()  # before any state is created (EO creates some first)
        if error is not None:
            raise error
        work = []  # (p, group, state, v, grad_g) of every parameter with a gradient
        for group in self.param_groups:
            self._init_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                # The weight-norm split of W and of its gradient.
                u = p.to(torch.float32) / state["g"]
                v = u * state["v_norm"]
                grad = p.grad.to(torch.float32)
                grad_g = (grad * u).sum(dim=1, keepdim=True)
                grad_v = (state["g"] / state["v_norm"]) * (grad - u * grad_g)
                state["momentum_buffer"].lerp_(grad_v, 1 - group["momentum"])
                work.append((p, group, state, v, grad_g))
        directions = self._batched_directions([w[2]["momentum_buffer"] for w in work])
        beta1, beta2 = self.betas
        for (p, group, state, v, grad_g), direction in zip(work, directions):
            lr = group["lr"]
            step = state["step"].add_(1)  # float64: beta ** step as EO's Python float
            m_g, v_g, g = state["m_g"], state["v_g"], state["g"]
            m_g.lerp_(grad_g, 1 - beta1)
            v_g.lerp_(grad_g.square(), 1 - beta2)
            magnitude_update = (m_g / (1.0 - beta1**step)) / ((v_g / (1.0 - beta2**step)).sqrt() + self.adam_eps)
            g.add_(magnitude_update, alpha=-lr)
            self._apply_weight_decay_inplace(g, grad_g, lr, group["weight_decay"])  # decoupled, on the magnitude
            v_new = v.add(direction, alpha=-lr)
            v_norm_new = v_new.norm(dim=1, keepdim=True)
            p.copy_(g * (v_new / v_norm_new))
            state["v_norm"].copy_(v_norm_new)  # in place: a compiled step keeps its state's addresses
        return None

    def state_dict(self) -> dict:
        state_dict = super().state_dict()
        # EO's checkpoint holds the step count as a Python int (a copy of each entry: the packed
        # state shares its dicts with the live state)
        state_dict["state"] = {
            index: {**entry, "step": int(entry["step"])} if torch.is_tensor(entry.get("step")) else entry
            for index, entry in state_dict["state"].items()
        }
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            if "step" in entry and not torch.is_tensor(entry["step"]):
                entry["step"] = _step_tensor(entry["step"])

    def _batched_directions(self, momenta: list[torch.Tensor]) -> list[torch.Tensor]:
        """The scaled Newton–Schulz of each momentum; equal shapes as one batch."""
        out: list[torch.Tensor | None] = [None] * len(momenta)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(momenta):
            by_shape.setdefault((tuple(m.shape), m.device), []).append(i)
        for (shape, _device), index in by_shape.items():
            results = self.scaled_orthogonalize_fn(torch.stack([momenta[i] for i in index]))
            for i, r in zip(index, results.unbind(0)):
                out[i] = r
        return out


def _step_tensor(count: int) -> torch.Tensor:
    return torch.tensor(float(count), dtype=torch.float64)
