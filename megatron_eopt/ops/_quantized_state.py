"""The quantized-state op family (``foreach_momentum_quantized_``, ``adamuon_normalize_quantized_``):
the low-memory state's formats, quantize / dequantize, the stochastic rounding's draw layout, the
ops' wrappers and their fake kernels (the Python side of csrc's ``quantized_state_*``).

The formats (``state_dtype`` "bf16", "int8", "fp8"), their block scales and the state keys are
described in :mod:`megatron_eopt.low_memory_state`, the public module of these names; the
optimizers' use of them (creating the state, converting checkpoints) is
:mod:`megatron_eopt.optim.step.state_dtype`'s.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .._errors import call_op
from ._checks import (
    _check_momentum,
    _check_weight_decay_method,
    _fake_list_dtype,
    _moment2_scalars,
    _ops,
    _optional_scalar,
    _step_scalar,
    _tensor_list,
)
from ._constants import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, STATE_DTYPES

_FORMAT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_E4M3_MAX_ROOT = math.sqrt(448.0)  # the top of squared fp8 codes (the momentum's)
_QUANTIZED_DTYPES = (torch.bfloat16, torch.int8, torch.float8_e4m3fn)
_FP32_SMALLEST_NORMAL = 1.17549435e-38


def validate_state_dtype(state_dtype: str) -> str:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    return state_dtype


def is_low_memory(state_dtype: str) -> bool:
    """True for a state stored in a format of this module ("bf16", "int8", "fp8"), rounded
    stochastically by the quantized ops; False for "fp32", the parameters' own dtype."""
    return state_dtype != "fp32"


def validate_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"state_block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
    return block_size


def momentum_dtype(state_dtype: str) -> torch.dtype | None:
    """The torch dtype of the momentum codes (None: fp32 state in the parameter's dtype)."""
    return {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(state_dtype)


def moment2_dtype(state_dtype: str) -> torch.dtype | None:
    """The torch dtype of AdaMuon's second-moment codes (None: fp32)."""
    return {"bf16": torch.bfloat16, "int8": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}.get(state_dtype)


def has_scales(dtype: torch.dtype) -> bool:
    return dtype in _FORMAT_MAX


def scales_shape(shape: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Shape of the block scales of a state of ``shape``: one per block of each row."""
    shape = tuple(shape) or (1,)
    return shape[:-1] + (math.ceil(shape[-1] / block_size),)


# ------------------------------------------------------------------ conversions (checkpoints)
def _blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """x as (rows, blocks, block_size), the last block of each row zero-padded; and the row length."""
    row = x.shape[-1] if x.dim() > 0 else 1
    rows = x.numel() // row if row else 0
    flat = x.reshape(rows, row)
    pad = (-row) % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(rows, (row + pad) // block_size, block_size), row


def _squared(dtype: torch.dtype, linear_fp8: bool) -> bool:
    return dtype == torch.float8_e4m3fn and not linear_fp8


def quantize(x: torch.Tensor, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE, *, linear_fp8: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 values -> (codes shaped like x, scales or None), rounded to nearest (checkpoint conversion).

    The block scales follow the kernels' rule: absmax / max (0 below fp32's smallest normal, NaN
    for a block holding a non-finite value). fp8 codes are the momentum's squared codes (rounded to
    the nearest grid value of the magnitude), or with ``linear_fp8`` the second moment's linear ones.
    """
    x = x.detach().to(torch.float32)
    if dtype == torch.bfloat16:
        return x.to(torch.bfloat16), None
    squared = _squared(dtype, linear_fp8)
    top = _E4M3_MAX_ROOT if squared else _FORMAT_MAX[dtype]
    blocks, row = _blocks(x, block_size)
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
    live = absmax >= _FP32_SMALLEST_NORMAL
    # Divisions by a tensor, not a Python number: torch computes x / scalar on CUDA as x * (1 / scalar)
    # and scalar / x everywhere as reciprocal(x) * scalar, each one rounding off the kernels' IEEE quotient.
    top_t = absmax.new_full((), top)
    scale = torch.where(finite, torch.where(live, absmax / top_t, torch.zeros_like(absmax)),
                        torch.full_like(absmax, math.nan))
    inverse = torch.where(finite & live, top_t / absmax, torch.zeros_like(absmax))
    y = torch.nan_to_num(blocks * inverse, nan=0.0).clamp(-top, top)
    if dtype == torch.int8:
        codes = y.round().to(torch.int8)
    elif squared:
        codes = _nearest_squared_codes(y)
    else:
        codes = y.to(torch.float8_e4m3fn)
    codes = codes.view(blocks.shape[0], blocks.shape[1] * block_size)[:, :row].reshape(x.shape)
    return codes.contiguous(), scale.view(*scales_shape(x.shape, block_size)).contiguous()


def _nearest_squared_codes(y: torch.Tensor) -> torch.Tensor:
    """Squared fp8 codes of scaled values y (|y| <= sqrt(448)): the grid value sqrt(e4m3) nearest |y|."""
    t = y.abs()
    near = (t * t).to(torch.float8_e4m3fn)  # nearest in the square: the answer or a neighbour of it
    bits = near.view(torch.uint8).to(torch.int32)
    grid = _squared_grid(y.device)
    candidates = torch.stack([(bits - 1).clamp(0, 0x7E), bits.clamp(0, 0x7E), (bits + 1).clamp(0, 0x7E)]).long()
    best = (grid[candidates] - t).abs().argmin(dim=0, keepdim=True)
    code = candidates.gather(0, best)[0]
    return (code | torch.where(torch.signbit(y), 0x80, 0)).to(torch.uint8).view(torch.float8_e4m3fn)


def _squared_grid(device) -> torch.Tensor:
    """sqrt(e4m3(c)) for the magnitude codes c = 0 .. 0x7E (the kernels' e4m3_root)."""
    return torch.arange(0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).to(torch.float32).sqrt()


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None, block_size: int = DEFAULT_BLOCK_SIZE, *,
               linear_fp8: bool = False) -> torch.Tensor:
    """codes (and scales) -> fp32 values, as the kernels read them (fp8: squared codes, or linear
    ones with ``linear_fp8``, see :func:`quantize`). Blocks run along the codes' last dim, or, for
    N-D codes with 2-D scales of one row per ``size(0)``, along their (size(0), -1) view (the state of
    an N-D parameter stepped with ``nd_mode="flatten"``)."""
    if scales is None:
        return codes.to(torch.float32)
    if codes.dim() > 2 and scales.dim() == 2:
        flat = (codes.shape[0], math.prod(codes.shape[1:]))
        if tuple(scales.shape) == scales_shape(flat, block_size):
            return dequantize(codes.reshape(flat), scales, block_size, linear_fp8=linear_fp8).reshape(codes.shape)
    values = codes.to(torch.float32)
    if _squared(codes.dtype, linear_fp8):
        values = torch.copysign(values.abs().sqrt(), values)
    blocks, row = _blocks(values, block_size)
    values = blocks * scales.to(torch.float32).reshape(blocks.shape[0], blocks.shape[1], 1)
    return values.view(blocks.shape[0], blocks.shape[1] * block_size)[:, :row].reshape(codes.shape).contiguous()


# ------------------------------------------------------------------ ops
def _seed_tensor(seed, device) -> torch.Tensor:
    if isinstance(seed, torch.Tensor):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or a 0-dim int64 tensor, got {type(seed).__name__}")
    return torch.full((), seed, dtype=torch.int64, device=device)


def foreach_momentum_quantized_(
    grads: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    ns_inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    *,
    momentum,
    nesterov: bool,
    weight_decay=0.0,
    weight_decay_method: str = "decoupled",
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed=0,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    draws: Sequence[Sequence[int]] | None = None,
) -> None:
    """:func:`~megatron_eopt.ops.foreach_momentum_` with the momentum in a low-memory format.

    ``states[i]`` holds the momentum as bf16, int8 or float8_e4m3fn codes; ``scales[i]`` its fp32
    block scales (empty list for bf16), laid out as :func:`scales_shape`. Per block the op reads
    the codes, steps in fp32, writes ``ns_inputs[i]`` from the fp32 momentum, and stores the new
    momentum with stochastic rounding drawn from ``seed`` (an int, or a 0-dim int64 tensor on the
    lists' device that the caller advances every step). ``grads``, ``params`` and ``ns_inputs``
    pair up with ``states[i]`` element by element in row-major order.

    ``draws``: None (tensor i draws with key i at its own element indices) or, per tensor, ``(key,
    local_rows, global_rows, global_cols, base)``: the rows of ``states[i]`` (its last dim long) form
    matrices of ``local_rows`` rows, each a box of a ``(global_rows, global_cols)`` matrix of a
    stack starting at element ``base``; every element draws at its index in that whole stack under
    ``key``. A shard, a chunk and the whole parameter then draw alike (:func:`draw_layout`).
    """
    grads, states = _tensor_list("grads", grads), _tensor_list("states", states)
    scales = _tensor_list("scales", scales)
    ns_inputs, params = _tensor_list("ns_inputs", ns_inputs), _tensor_list("params", params)
    _check_weight_decay_method(weight_decay_method)
    validate_block_size(block_size)
    device = next((xs[0].device for xs in (grads, states, ns_inputs) if xs), None)
    if device is None:
        return
    mu = _step_scalar("momentum", momentum, device, _check_momentum)
    wd = _step_scalar("weight_decay", weight_decay, device)
    call_op(_ops.foreach_momentum_quantized_, grads, states, scales, ns_inputs, params, mu, bool(nesterov), wd,
            weight_decay_method, block_size, _seed_tensor(seed, device), _optional_scalar("grad_scale", grad_scale),
            _optional_scalar("found_inf", found_inf), _flat_draws(draws, len(states)))


def adamuon_normalize_quantized_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    *,
    beta2=0.95,
    eps=1e-8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed=0,
    found_inf: torch.Tensor | None = None,
    draws: Sequence[Sequence[int]] | None = None,
) -> None:
    """:func:`~megatron_eopt.ops.adamuon_normalize_` with the second moment in a low-memory format:
    ``moment2[i]`` bf16 (v) or float8_e4m3fn (``sqrt(v)`` with block ``scales[i]``); ``draws`` as
    :func:`foreach_momentum_quantized_`'s."""
    updates, moment2 = _tensor_list("updates", updates), _tensor_list("moment2", moment2)
    scales = _tensor_list("scales", scales)
    validate_block_size(block_size)
    if not updates:
        return
    device = updates[0].device
    b, e = _moment2_scalars(device, beta2, eps)
    call_op(_ops.adamuon_normalize_quantized_, updates, moment2, scales, b, e, block_size, _seed_tensor(seed, device),
            _optional_scalar("found_inf", found_inf), _flat_draws(draws, len(moment2)))


DRAW_VALUES = 5  # per tensor: key, local_rows, global_rows, global_cols, base


def _flat_draws(draws, n: int) -> list[int]:
    if draws is None:
        return []
    flat = [int(v) for d in draws for v in d]
    if len(draws) != n or len(flat) != DRAW_VALUES * n:
        raise ValueError(f"draws must hold one (key, local_rows, global_rows, global_cols, base) per tensor, got "
                         f"{len(draws)} entries for {n} tensors")
    return flat


def draw_layout(key: int, local_view: Sequence[int], global_view: Sequence[int],
                offset: Sequence[int] = ()) -> tuple[int, int, int, int, int]:
    """The ``draws`` entry of a tensor holding the box of a parameter's matrix view that starts at
    ``offset`` (zeros: the whole view) and has the shape ``local_view`` ((m, n) or (E, m, n)), in a
    view of shape ``global_view``: every element then draws at its index in the whole view."""
    local_view, global_view = tuple(local_view), tuple(global_view)
    offset = tuple(offset) or (0,) * len(global_view)
    rows, cols = global_view[-2:]
    strides = [rows * cols, cols, 1][-len(global_view):]
    base = sum(o * s for o, s in zip(offset, strides))
    return int(key), max(1, int(local_view[-2])), max(1, int(rows)), max(1, int(cols), int(local_view[-1])), int(base)


# ------------------------------------------------------------------ fake kernels
def _fake_check_state(op, name, i, state, scales, numel, block_size) -> None:
    torch._check_value(state.numel() == numel, lambda: f"{op}: {name}[{i}] has {state.numel()} elements, expected {numel}")
    if has_scales(state.dtype):
        want = math.prod(scales_shape(state.shape, block_size))
        torch._check_value(scales[i].numel() == want, lambda: f"{op}: scales[{i}] must hold {want} values")
        torch._check_type(scales[i].dtype == torch.float32, lambda: f"{op}: scales[{i}] must be float32")


@torch.library.register_fake("megatron_eopt::foreach_momentum_quantized_")
def _foreach_momentum_quantized_fake(grads, states, scales, ns_inputs, params, momentum, nesterov, weight_decay,
                                     weight_decay_method, block_size, seed, grad_scale=None, found_inf=None, draws=()):
    op = "foreach_momentum_quantized_"
    n = len(grads)
    torch._check_value(len(draws) in (0, DRAW_VALUES * n), lambda: f"{op}: draws must hold 5 values per tensor")
    torch._check_value(len(states) == n and len(ns_inputs) == n, lambda: f"{op}: list lengths differ")
    torch._check_value(1 <= block_size <= MAX_BLOCK_SIZE, lambda: f"{op}: block_size out of range")
    dtype = _fake_list_dtype(op, "states", states, _QUANTIZED_DTYPES)
    torch._check_value(len(scales) == (n if dtype is not None and has_scales(dtype) else 0),
                       lambda: f"{op}: scales must have one tensor per state (none for bfloat16)")
    for i in range(n):
        torch._check_value(ns_inputs[i].numel() == grads[i].numel(), lambda: f"{op}: ns_inputs[{i}] numel differs")
        _fake_check_state(op, "states", i, states[i], scales, grads[i].numel(), block_size)
    return None


@torch.library.register_fake("megatron_eopt::adamuon_normalize_quantized_")
def _adamuon_normalize_quantized_fake(updates, moment2, scales, beta2, eps, block_size, seed, found_inf=None,
                                      draws=()):
    op = "adamuon_normalize_quantized_"
    n = len(updates)
    torch._check_value(len(draws) in (0, DRAW_VALUES * n), lambda: f"{op}: draws must hold 5 values per tensor")
    torch._check_value(len(moment2) == n, lambda: f"{op}: list lengths differ")
    dtype = _fake_list_dtype(op, "moment2", moment2, (torch.bfloat16, torch.float8_e4m3fn))
    torch._check_value(len(scales) == (n if dtype is not None and has_scales(dtype) else 0),
                       lambda: f"{op}: scales must have one tensor per state (none for bfloat16)")
    for i in range(n):
        _fake_check_state(op, "moment2", i, moment2[i], scales, updates[i].numel(), block_size)
    return None
