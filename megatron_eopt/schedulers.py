"""Learning-rate schedules for a set of optimizers: linear warmup, then linear or cosine decay.

One ``torch.optim.lr_scheduler.LambdaLR`` per optimizer, all following the same multiplier of
each param group's initial lr, so a Muon + AdamW pair built by
:func:`megatron_eopt.build_optimizers` keeps its lr ratio through the schedule.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["build_schedulers", "lr_multiplier"]

DecayT = Literal["linear", "cosine", "constant"]
_DECAYS = ("linear", "cosine", "constant")


def _check_schedule(warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> None:
    for name, value in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})")
    if decay not in _DECAYS:
        raise ValueError(f"decay must be one of {_DECAYS}, got {decay!r}")
    if not (isinstance(min_lr_ratio, (int, float)) and 0.0 <= min_lr_ratio <= 1.0):
        raise ValueError(f"min_lr_ratio must be a number in [0, 1], got {min_lr_ratio!r}")


def lr_multiplier(
    warmup_steps: int, total_steps: int, decay: DecayT = "linear", min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """The lr multiplier as a function of the number of optimizer steps taken so far.

    - warmup, steps ``0 .. warmup_steps-1``: ``(step + 1) / warmup_steps`` (the first step
      already trains, the last warmup step runs at the full lr);
    - decay, steps ``warmup_steps .. total_steps``: from 1 down to ``min_lr_ratio``, linearly
      or along a half cosine; ``constant`` stays at 1;
    - after ``total_steps``: ``min_lr_ratio`` (``constant``: 1).
    """
    _check_schedule(warmup_steps, total_steps, decay, min_lr_ratio)
    decay_steps = total_steps - warmup_steps

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        progress = 1.0 if decay_steps == 0 else min(1.0, (step - warmup_steps) / decay_steps)
        if decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return multiplier


def build_schedulers(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    warmup_steps: int,
    total_steps: int,
    decay: DecayT = "linear",
    min_lr_ratio: float = 0.0,
) -> list[LambdaLR]:
    """One ``LambdaLR`` per optimizer following :func:`lr_multiplier`.

    Call ``scheduler.step()`` once after each ``optimizer.step()``. Creating the schedulers
    sets every group's lr to its step-0 value (``initial_lr`` times the multiplier at 0).
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{i}] must be a torch.optim.Optimizer, got {type(opt).__name__}")
    multiplier = lr_multiplier(warmup_steps, total_steps, decay, min_lr_ratio)
    return [LambdaLR(opt, lr_lambda=multiplier) for opt in optimizers]
