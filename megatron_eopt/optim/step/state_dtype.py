"""Low-memory state of the fused optimizers (``state_dtype``): creating it, and converting checkpoints.

The formats and ops are in :mod:`megatron_eopt.low_memory_state`. Per parameter the state holds
``momentum_buffer`` (codes shaped like the parameter), ``momentum_buffer_scales`` (int8 / fp8) and,
for AdaMuon's elementwise second moment, ``moment2_buffer`` / ``moment2_buffer_scales``; with block
scales also ``state_block_size`` (an int), so a checkpoint says how its blocks were cut.

``load_state_dict`` takes a checkpoint of any state dtype: entries in the optimizer's own format
(same block size) are kept bit for bit; others are read as fp32 values and stored in the
optimizer's format, rounded to nearest. torch's loader casts every floating-point state tensor to
its parameter's dtype, which would destroy codes, so the converted entries bypass it.

Resuming bit for bit: ``state_dict()`` adds to the state of every parameter with low-memory state
``state_seed`` (a 0-dim int64 tensor: the stochastic rounding's seed of the parameter's device after
the last step) and ``state_format`` (a 0-dim int64 CPU tensor: :data:`FORMAT_VERSION`, the meaning
of the codes); ``load_state_dict`` also takes them as Python ints. Neither is kept in
``optimizer.state``. ``load_state_dict`` sets each device's seed from the checkpoint, so the next
step draws what the uninterrupted run would have drawn. A checkpoint without ``state_seed``
(written before the seed was saved, or with fp32 state) restarts the seed at 0, as a freshly
constructed optimizer does: the run continues correctly (the rounding stays unbiased) but its
draws are not those of the uninterrupted run. (torch.distributed.checkpoint loads into the state
dict it is given, which has both keys: an older DCP checkpoint needs
``DefaultLoadPlanner(allow_partial_load=True)``.) A checkpoint whose ``state_format`` is newer than
:data:`FORMAT_VERSION` (or not a positive int) is refused before anything changes; one without
``state_format`` is read as the current format.

Format versions: 1: bf16 momentum; int8 codes with ``absmax / 127`` block scales; fp8 momentum in
squared e4m3 codes (``absmax / sqrt(448)`` block scales); AdaMuon's fp8 second moment as ``sqrt(v)``
in linear e4m3 codes (see :mod:`megatron_eopt.low_memory_state`). Blocks along the rows of the
parameter's last dim. 2: the same codes; an N-D parameter stepped with ``nd_mode="flatten"`` has
its blocks along the rows of its (size(0), -1) matrix view (scales of shape (size(0), blocks)). A
version-1 checkpoint of such a parameter is told apart by its scales' shape and converted on load
(read as values, stored in the new blocks, rounded to nearest); every other entry is unchanged.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping

import torch

from ... import low_memory_state as lms
from ..multirank.dtensor_layout import is_dtensor, local

MOMENTUM = "momentum_buffer"
MOMENT2 = "moment2_buffer"
BLOCK_KEY = "state_block_size"
SEED_KEY = "state_seed"
FORMAT_KEY = "state_format"
FORMAT_VERSION = 2  # raise (and convert older versions on load) whenever a code's meaning changes


def scales_key(key: str) -> str:
    return key + "_scales"


def _codes_dtype(key: str, state_dtype: str) -> torch.dtype | None:
    return lms.momentum_dtype(state_dtype) if key == MOMENTUM else lms.moment2_dtype(state_dtype)


def block_rows(shape, view) -> tuple[int, ...]:
    """The shape whose rows the blocks run along, for a state shaped like a parameter of ``shape``
    whose matrix view is ``view``: the parameter's own shape where the view keeps its last dim
    (2-D, nd_mode "batch"), else the view ("flatten": (size(0), -1); a (256, 256, 3, 3) convolution's
    rows are 2304 long, not 3, so int8 takes about one byte per value, not 2.3)."""
    shape, view = tuple(shape), tuple(view)
    if len(shape) <= 2 or view[-1:] == shape[-1:]:
        return shape
    return _flat(shape)


def _flat(shape) -> tuple[int, ...]:
    return (shape[0], math.prod(shape[1:]))


def state_scales_shape(shape, view, block_size: int) -> tuple[int, ...]:
    """The block scales of a state shaped like a parameter of ``shape`` with matrix view ``view``."""
    return lms.scales_shape(block_rows(shape, view), block_size)


def _scales_layout(codes_shape, scales_shape, block_size: int) -> tuple[int, ...] | None:
    """The rows a checkpoint's scales were cut along (the codes' own last dim, or their (size(0), -1)
    view, see block_rows), told apart by the scales' shape; None when they fit neither."""
    codes_shape, scales_shape = tuple(codes_shape), tuple(scales_shape)
    for rows in (codes_shape, _flat(codes_shape)) if len(codes_shape) > 2 else (codes_shape,):
        if lms.scales_shape(rows, block_size) == scales_shape:
            return rows
    return None


def new_state(p: torch.Tensor, key: str, state_dtype: str, block_size: int, view) -> dict[str, Any]:
    """Zero state of ``key`` for p in ``state_dtype`` (not "fp32"): codes shaped like p, block scales
    along the rows of its matrix view ``view`` (block_rows).

    A DTensor p gets DTensor codes and scales on its mesh with its placements; a shard of the blocks'
    rows must hold whole blocks (check_sharding).
    """
    dtype = _codes_dtype(key, state_dtype)
    codes = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
    out: dict[str, Any] = {key: codes}
    if not lms.has_scales(dtype):
        return out
    loc = local(p)
    rows = _flat(loc.shape) if len(block_rows(p.shape, view)) != p.dim() else tuple(loc.shape)
    scales = torch.zeros(lms.scales_shape(rows, block_size), dtype=torch.float32, device=loc.device)
    out[scales_key(key)] = _shaped_like_param(scales, p, state_scales_shape(p.shape, view, block_size))
    out[BLOCK_KEY] = block_size
    return out


def check_sharding(p: torch.Tensor, state_dtype: str, block_size: int, where: str) -> None:
    """Block scales run along rows: a DTensor may shard its last dimension only where every shard
    holds whole blocks of the unsharded rows (each shard starts at a multiple of ``block_size``, and
    the scales split over the ranks as the blocks do), so every rank keeps the scales of its own
    blocks and the blocks are those of the unsharded parameter."""
    if state_dtype not in ("int8", "fp8") or not is_dtensor(p):
        return
    from ..multirank.dtensor_layout import _box, _is_shard

    last = p.ndim - 1
    cut = [pl for pl in p.placements if _is_shard(pl) and pl.dim % p.ndim == last]
    if not cut:
        return
    shape = tuple(p.shape)
    scales = lms.scales_shape(shape, block_size)
    mesh_shape = tuple(p.device_mesh.mesh.shape)
    whole = all(type(pl).__name__ == "Shard" for pl in cut)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)) if whole else ():
        (offset, size), (s_offset, s_size) = (_box(shape, p.placements, coordinate, mesh_shape),
                                              _box(scales, p.placements, coordinate, mesh_shape))
        if size[last] == 0:
            whole = s_size[last] == 0
        else:
            whole = offset[last] % block_size == 0 and s_offset[last] == offset[last] // block_size and \
                s_size[last] == -(-size[last] // block_size)
        if not whole:
            break
    if not whole:
        raise ValueError(
            f"state_dtype={state_dtype!r} keeps one scale per block of {block_size} values of a row, but {where} "
            f"of shape {shape} with placements {list(p.placements)} shards its rows (the last dimension) where a "
            f"shard does not start at a multiple of {block_size} (state_block_size) or the ranks would not hold the "
            "scales of their own blocks: pick a state_block_size that divides every shard's width, or use "
            "state_dtype='bf16' or 'fp32' for it"
        )


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors of one parameter's state (codes and scales counted)."""
    return sum(local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


# ------------------------------------------------------------------ checkpoints
def _incoming_format(key: str, data: torch.Tensor) -> str:
    if data.dtype == torch.int8:
        return "int8"
    if data.dtype == torch.float8_e4m3fn:
        return "fp8" if key == MOMENTUM else "sqrt-fp8"
    # bf16 codes and a bf16 parameter's own bf16 buffer hold the same values: read either as values.
    return "values"


def _as_values(key: str, values: Mapping[str, Any], fmt: str, label: str) -> torch.Tensor:
    """The fp32 values of an incoming state entry (blocks along the codes' rows, or along their
    (size(0), -1) view for an N-D parameter stepped with nd_mode "flatten": block_rows)."""
    data = local(values[key])
    if fmt == "values":
        return data.to(torch.float32)
    scales = values.get(scales_key(key))
    block = values.get(BLOCK_KEY, lms.DEFAULT_BLOCK_SIZE)
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"load_state_dict: state['{key}'] of {label} holds {data.dtype} codes but the checkpoint has "
                         f"no '{scales_key(key)}'; nothing was loaded")
    scales = local(scales)
    rows = _scales_layout(data.shape, scales.shape, block)
    if rows is None:
        raise ValueError(
            f"load_state_dict: state['{scales_key(key)}'] of {label} has shape {tuple(scales.shape)}, but codes of "
            f"shape {tuple(data.shape)} in blocks of {block} need {lms.scales_shape(data.shape, block)} (or "
            f"{lms.scales_shape(_flat(data.shape), block)} along the rows of its matrix view); nothing "
            "was loaded"
        )
    out = lms.dequantize(data.reshape(rows), scales.to(data.device), block, linear_fp8=fmt == "sqrt-fp8")
    out = out.reshape(data.shape)
    return out * out if fmt == "sqrt-fp8" else out


def split_state_dict(optimizer, state_dict: Mapping[str, Any], target_of) -> tuple[dict[str, Any], dict]:
    """Converts the low-memory entries of ``state_dict`` to the formats the optimizer keeps.

    ``target_of(p)`` gives ``(state_dtype, block_size, keys, view)`` for a parameter whose momentum
    (and the keys listed) the optimizer may keep in a low-memory format, ``view`` the parameter's
    matrix view (its blocks' rows: block_rows), or None. Returns the state dict
    for torch's loader (fp32 entries only, codes removed) and ``{saved index: {key: tensor}}`` to put
    into the state after it (see :func:`restore`). Pure: raises before anything is changed.
    """
    groups = optimizer.param_groups
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        return dict(state_dict), {}
    index_param = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        for pi, (index, p) in enumerate(zip(saved["params"], group["params"])):
            index_param[index] = (p, f"param_groups[{gi}]['params'][{pi}]")
    new_state: dict[Any, Any] = {}
    held: dict[Any, dict[str, Any]] = {}
    for index, values in state_dict.get("state", {}).items():
        entry = index_param.get(index)
        target = None if entry is None or not isinstance(values, Mapping) else target_of(entry[0])
        if target is None:
            new_state[index] = values
            continue
        p, label = entry
        state_dtype, block_size, keys, view = target
        rows = block_rows(p.shape, view)
        values = dict(values)
        check_format(values, label)
        values.pop(FORMAT_KEY, None)
        seed = values.pop(SEED_KEY, None)
        if seed is not None:
            seed = local(seed) if isinstance(seed, torch.Tensor) else seed
            if isinstance(seed, torch.Tensor):
                ok = seed.numel() == 1 and not seed.is_floating_point() and not seed.is_complex() \
                    and seed.dtype != torch.bool
            else:
                ok = isinstance(seed, int) and not isinstance(seed, bool)
            if not ok:
                raise ValueError(f"load_state_dict: state['{SEED_KEY}'] of {label} must be an int or a one-element "
                                 f"integer tensor, got {seed!r}; nothing was loaded")
            held.setdefault(index, {})[SEED_KEY] = seed
        for key in keys:
            if key not in values or not isinstance(values[key], torch.Tensor):
                continue
            if not lms.is_low_memory(state_dtype) and values[key].dtype not in (torch.int8, torch.float8_e4m3fn):
                continue  # fp32 into fp32: torch's loader (and its checks) as for any optimizer
            if tuple(values[key].shape) != tuple(p.shape):
                raise ValueError(
                    f"load_state_dict: state['{key}'] of {label} has shape {tuple(values[key].shape)}, but the "
                    f"parameter of shape {tuple(p.shape)} needs shape {tuple(p.shape)}; nothing was loaded"
                )
            fmt = _incoming_format(key, values[key])
            incoming_scales = values.get(scales_key(key))
            same = (
                lms.is_low_memory(state_dtype) and values[key].dtype == _codes_dtype(key, state_dtype)
                and (not lms.has_scales(values[key].dtype)
                     or (values.get(BLOCK_KEY, lms.DEFAULT_BLOCK_SIZE) == block_size
                         and isinstance(incoming_scales, torch.Tensor)
                         and tuple(incoming_scales.shape) == lms.scales_shape(rows, block_size)))
            )
            if same:
                if fmt != "values":
                    _as_values(key, values, fmt, label)  # validates the scales
                kept = {key: values.pop(key)}
                if scales_key(key) in values:
                    kept[scales_key(key)] = values.pop(scales_key(key))
            else:
                v = _as_values(key, values, fmt, label)
                values.pop(scales_key(key), None)
                values.pop(key)
                if not lms.is_low_memory(state_dtype) or (key == MOMENT2 and lms.moment2_dtype(state_dtype) is None):
                    values[key] = v  # cast to the parameter's state dtype by torch's loader
                    continue
                dtype = _codes_dtype(key, state_dtype)
                moment2_fp8 = dtype == torch.float8_e4m3fn and key == MOMENT2  # stored as sqrt(v), linear codes
                v = v.reshape(_flat(v.shape) if len(rows) != p.dim() else v.shape)
                codes, scales = lms.quantize(v.sqrt() if moment2_fp8 else v, dtype, block_size, linear_fp8=moment2_fp8)
                kept = {key: _shaped_like_param(codes.reshape(local(p).shape), p, tuple(p.shape))}
                if scales is not None:
                    kept[scales_key(key)] = _shaped_like_param(scales, p, lms.scales_shape(rows, block_size))
            if any(lms.has_scales(t.dtype) for t in kept.values() if isinstance(t, torch.Tensor)):
                kept[BLOCK_KEY] = block_size
            held.setdefault(index, {}).update(kept)
        values.pop(BLOCK_KEY, None)  # held with the codes it describes, if any
        new_state[index] = values
    out = dict(state_dict)
    out["state"] = new_state
    return out, held


def _shaped_like_param(t: torch.Tensor, p: torch.Tensor, shape) -> torch.Tensor:
    """A local state tensor as p keeps it: for a DTensor p, a DTensor of global ``shape`` (contiguous)
    on p's mesh with p's placements; otherwise t itself."""
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor

    shape = tuple(shape)
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(t.to(p.to_local().device), p.device_mesh, p.placements, run_check=False, shape=shape,
                              stride=stride)


def restore(optimizer, state_dict: Mapping[str, Any], held: dict,
            seeds: dict[torch.device, torch.Tensor] | None = None) -> None:
    """Puts the held entries of :func:`split_state_dict` into the loaded optimizer's state, and sets
    ``seeds`` (the stochastic rounding's seed per device) from the checkpoint: each device's to the
    ``state_seed`` of its parameters (one value: they were saved from one seed), 0 where the
    checkpoint has none (see the module's docstring). Copied in place, without host synchronization."""
    found: dict[torch.device, Any] = {}
    saved_groups = state_dict.get("param_groups", [])
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for index, p in zip(saved["params"], group["params"]):
            if index not in held:
                continue
            device = local(p).device
            entries = {k: (v.to(device) if isinstance(v, torch.Tensor) and not is_dtensor(v) else v)
                       for k, v in held[index].items()}
            seed = entries.pop(SEED_KEY, None)
            if seed is not None:
                found.setdefault(device, seed)
            if entries:
                optimizer.state[p].update(entries)
    for device, seed in (seeds or {}).items():
        value = found.get(device, 0)
        if isinstance(value, torch.Tensor):
            seed.copy_(value.reshape(()).to(device=seed.device, dtype=seed.dtype), non_blocking=True)
        else:
            seed.fill_(value)


def check_format(values: Mapping[str, Any], label: str) -> None:
    """Refuses a parameter's state written in a low-memory format this version cannot read."""
    version = values.get(FORMAT_KEY)
    if version is None:
        return  # written before formats were versioned: the current format
    if isinstance(version, torch.Tensor):
        version = local(version)
        if version.numel() == 1 and not version.is_floating_point() and version.dtype != torch.bool:
            version = int(version)  # a host read of one value (checkpoints are loaded between steps)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(
            f"load_state_dict: state['{FORMAT_KEY}'] of {label} is {version!r}, but this version of megatron_eopt "
            f"reads low-memory state formats 1 to {FORMAT_VERSION}: the checkpoint was written by a newer release "
            "(load it with that release, or save it with dequantize_state_dict there); nothing was loaded"
        )


def add_resume_entries(state_dict: dict[str, Any], param_groups, seeds: dict[torch.device, torch.Tensor],
                       owns=lambda p: True) -> dict[str, Any]:
    """Adds ``state_seed`` and ``state_format`` to the saved state of every parameter ``owns(p)``
    whose state is low-memory (copies the per-parameter dicts: the live state is not changed).

    Both are 0-dim int64 tensors (the seed a copy of its device's, taken without host
    synchronization; the version on the CPU): torch.distributed.checkpoint loads tensors into the
    state dict it is given, and a plain tensor is replicated across ranks as the seed is."""
    values_of: dict[torch.device, torch.Tensor] = {}
    state = dict(state_dict.get("state", {}))
    for saved, group in zip(state_dict.get("param_groups", []), param_groups):
        for index, p in zip(saved["params"], group["params"]):
            entry = state.get(index)
            if not isinstance(entry, Mapping) or MOMENTUM not in entry or not owns(p):
                continue
            device = local(p).device
            entry = dict(entry)
            entry[FORMAT_KEY] = torch.tensor(FORMAT_VERSION, dtype=torch.int64)
            if device in seeds:
                if device not in values_of:
                    values_of[device] = seeds[device].clone()
                entry[SEED_KEY] = values_of[device].clone()
            state[index] = entry
    out = dict(state_dict)
    out["state"] = state
    return out


def dequantize_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an optimizer state_dict with every low-memory entry as fp32 values.

    For peers that keep fp32 state (Emerging-Optimizers, torch.optim.Muon): their ``load_state_dict``
    would cast int8 / fp8 codes to numbers without their scales.
    """
    out = dict(state_dict)
    new_state = {}
    for index, values in state_dict.get("state", {}).items():
        if not isinstance(values, Mapping):
            new_state[index] = values
            continue
        values = dict(values)
        check_format(values, f"state[{index!r}]")
        values.pop(FORMAT_KEY, None)
        values.pop(SEED_KEY, None)
        for key in (MOMENTUM, MOMENT2):
            data = values.get(key)
            if not isinstance(data, torch.Tensor) or data.dtype not in (torch.int8, torch.float8_e4m3fn):
                continue
            fmt = _incoming_format(key, data)
            values[key] = _as_values(key, values, fmt, f"state[{index!r}]")
            values.pop(scales_key(key), None)
        values.pop(BLOCK_KEY, None)
        new_state[index] = values
    out["state"] = new_state
    return out
