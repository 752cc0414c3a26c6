"""The check every optimizer's ``load_state_dict`` runs before it changes anything.

torch's ``Optimizer.load_state_dict`` casts floating-point state to the parameter's dtype and
device and otherwise takes whatever it is given: a momentum buffer saved transposed ((4, 8) for an
(8, 4) parameter) is accepted and the next step runs on wrong data, and a wrong numel fails later
inside a ``view`` with no hint of which parameter or checkpoint key is at fault. Here every state
tensor whose layout the optimizer knows is compared with what its parameter needs (shape, a dtype
the load can cast to, a device it can move to), and a misfit is refused with an error naming the
parameter, the key and both shapes, while the optimizer is still untouched.

An optimizer says what it expects through ``_expected_state(p, key)`` returning ``(shape, dtype)``
or ``None`` (not checked: counters such as ``step``, keys it does not know); without that method,
the keys torch's optimizers and ours keep shaped like the parameter are checked.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

# State that is shaped like its parameter in torch's optimizers and in ours.
LIKE_PARAM_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

Expected = Callable[[torch.Tensor, str], "tuple[tuple[int, ...], torch.dtype] | None"]


def like_param(p: torch.Tensor, key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The default expectation: the keys of ``LIKE_PARAM_KEYS`` have the parameter's shape and dtype."""
    return (tuple(p.shape), p.dtype) if key in LIKE_PARAM_KEYS else None


def check_loaded_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                       expected: Expected | None = None) -> None:
    """Raises ``ValueError`` when a state tensor of ``state_dict`` cannot serve its parameter.

    Parameters are matched to the saved indices as ``load_state_dict`` matches them (group by
    group, in order). A group structure that differs is left to ``load_state_dict``'s own error.
    """
    if expected is None:
        expected = getattr(optimizer, "_expected_state", like_param)
    groups = optimizer.param_groups
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        return
    if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups)):
        return
    where: dict[Any, tuple[torch.Tensor, str]] = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        names = group.get("names") or saved.get("param_names") or group.get("param_names")
        for pi, (index, p) in enumerate(zip(saved["params"], group["params"])):
            label = f"param_groups[{gi}]['params'][{pi}]"
            if names is not None and pi < len(names):
                label += f" ({names[pi]})"
            where[index] = (p, label)
    for index, param_state in state_dict.get("state", {}).items():
        if index not in where or not isinstance(param_state, Mapping):
            continue
        p, label = where[index]
        for key, value in param_state.items():
            if not isinstance(value, torch.Tensor):
                continue
            want = expected(p, key)
            if want is None:
                continue
            shape, dtype = want
            _check_one(value, tuple(shape), dtype, p, key, label)


def _check_one(value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, p: torch.Tensor, key: str,
               label: str) -> None:
    if tuple(value.shape) != shape:
        raise ValueError(
            f"load_state_dict: state['{key}'] of {label} has shape {tuple(value.shape)}, but the parameter of "
            f"shape {tuple(p.shape)} needs shape {shape} (a checkpoint of another model, or of another "
            "optimizer layout); nothing was loaded"
        )
    # The load casts floating-point state to the parameter's dtype and keeps anything else as it
    # is: an integer or complex buffer would reach the fused ops unconverted.
    if value.is_floating_point() != dtype.is_floating_point or value.is_complex() != dtype.is_complex:
        raise ValueError(
            f"load_state_dict: state['{key}'] of {label} (shape {tuple(value.shape)}) is {value.dtype}, which "
            f"cannot be cast to the {dtype} the parameter of shape {tuple(p.shape)} needs; nothing was loaded"
        )
    local_device = _device_of(p)
    if value.device.type == "meta" and local_device.type != "meta":
        raise ValueError(
            f"load_state_dict: state['{key}'] of {label} (shape {tuple(value.shape)}) is on the meta device and "
            f"holds no data to move to the parameter's {local_device}; nothing was loaded"
        )


def _device_of(p: torch.Tensor) -> torch.device:
    to_local = getattr(p, "to_local", None)
    return to_local().device if callable(to_local) else p.device
