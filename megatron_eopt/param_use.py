"""Which matrices a model's weights hold, read from how one forward pass uses them.

The routing tables of :mod:`megatron_eopt.model_views` know the layouts of the modules they name;
a weight of any other module, or a bare ``nn.Parameter``, is a matrix only by its shape there.
:func:`trace_parameter_uses` runs the model's forward once on example inputs under a
``TorchDispatchMode`` and records what the aten ops do with each parameter:

- a product (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, ``mv``: what ``F.linear``,
  ``@``, ``matmul`` and ``einsum`` become) makes it a matrix. Which of its dims the product
  contracts with the input's features is its *in* side, the other its *out* side: (out, in) as
  ``nn.Linear`` stores it, or (in, out) as ``Conv1D``. A dim indexed away before the product
  (``W[e]``, ``W.view(E, f, h)[e]``, ``W[expert_ids]``) or a ``bmm`` batch dim is one matrix per
  index (stacked experts); a weight whose other side spans its trailing dims (an ``einsum`` over
  (d_model, heads, head_dim)) is one matrix (``nd_mode="flatten"``);
- the product's output split along its output features (``split``, ``chunk``, ``unbind``, a
  ``view`` into (..., heads, 3, head_dim) followed by ``unbind`` or indexing, slices, steps of 2)
  into parts that are not concatenated back (rotary embeddings split and re-join their halves) is
  a fused projection: the parts' sizes are its ``split_shapes``, as are those of a weight split
  along its output rows before its products (``wq, wk, wv = w.split(...)``). Two parts that meet in
  one elementwise product (``act(gate) * up``) are a fused gate/up;
- a product whose output reaches ``topk`` (or ``argmax``) is a router; one whose output is what
  the model returns, or reaches ``log_softmax`` / a loss, is an output head;
- ``embedding``, ``index_select`` or indexing by an integer tensor whose result never reaches a
  product is a lookup table (an embedding, a relative-position bias table); a weight only ever used
  elementwise (``-exp(A_log)``, ``q + r_w_bias``) is not a matrix.

Every derived tensor (views, transposes, reshapes, dtype copies, indexing, slices) is followed back
to its parameter by identity, as a map from the tensor's dims to factors of the parameter's dims.
The forward runs on the meta device first (``torch.func.functional_call`` with meta tensors in
place of the parameters and buffers, so a model of any size costs no memory); a forward that cannot
run on meta (data-dependent shapes, ``.item()``) runs once more on the real parameters with the
example inputs, under ``torch.no_grad()`` and in eval mode. What the trace cannot read (a weight
used by an op it does not know, products that disagree, a layout the param-group keys cannot carry)
is reported in :attr:`ParameterUses.problems`, never guessed.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
from torch import nn

from .model_views import MatrixView, check_view_options

from .param_use_sharded import fsdp_hooks_set_aside, is_sharded, sharded_trace_problem
from .param_use_tracer import _PRODUCT_LIKE, ParameterUses, ParamUse, _ParamRecord, _Root, _Tracer

__all__ = ["ParamUse", "ParameterUses", "example_forward_inputs", "trace_parameter_uses"]


def _split_of(product: _Root) -> tuple[tuple[int, ...] | None, bool, str | None]:
    """(split sizes of the output features, gate/up, problem) of one product's output."""
    found = []
    for atom, pieces in product.pieces.items():
        if atom in product.rejoined:
            continue
        spans = sorted(pieces)
        at, sizes = 0, []
        for start, length in spans:
            if start != at:
                break
            sizes.append(length * atom[1])
            at += length
        if at != atom[2]:
            return None, False, f"output features sliced into {spans} of {atom[2]} (not a partition)"
        found.append((atom, tuple(sizes)))
    if not found:
        return None, False, None
    if len(found) > 1:
        return None, False, f"output features split in {len(found)} ways"
    atom, sizes = found[0]
    if len(sizes) == 1:
        return None, False, None
    return sizes, atom in product.glu and len(sizes) == 2, None  # gate and up: two parts that meet


def _decide(rec: _ParamRecord, fused_gate_up: str, routers: str) -> ParamUse:
    name, shape = rec.name, rec.root.shape
    lookups = [lk for lk in rec.lookups if not lk.reached_product]
    productlike = sorted(op for op in rec.other if _PRODUCT_LIKE.search(op))
    if rec.lost or productlike:
        return ParamUse(name, "unknown", f"used by {', '.join(sorted(rec.lost) + productlike)}")
    if not rec.products:
        if lookups:
            return ParamUse(name, "embedding", f"index lookup ({lookups[0].what})")
        if rec.elementwise or rec.other:
            ops = ", ".join(sorted(rec.elementwise | rec.other))
            return ParamUse(name, "not_matrix", f"no product, only elementwise / reducing ops ({ops})")
        return ParamUse(name, "unused", "not used by the traced forward")
    routed = any(u.product.router or u.product.resolved().router for u in rec.products)
    head = any(u.product.loss or u.product.resolved().loss for u in rec.products)
    if lookups:
        return ParamUse(name, "tied", f"index lookup ({lookups[0].what}) and product: tied embedding / head")
    if head and not routed:
        return ParamUse(name, "head", "product giving the model's output / loss")
    roles = rec.products[0].roles
    if any(u.roles != roles for u in rec.products[1:]):
        return ParamUse(name, "unknown", "multiplied in products that disagree on its in / out sides")
    per_dim = []
    for dim, size in enumerate(shape):
        atoms = sorted((a for a in roles if a[0] == dim), key=lambda a: -a[1])
        covered = 1
        for a in atoms:
            covered *= a[2]
        if covered != size:
            return ParamUse(name, "unknown", f"multiplied through a part of its dim {dim} only")
        per_dim.append(tuple(roles[a] for a in atoms))
    if len(shape) == 2 and () in per_dim and per_dim != [(), ()]:  # a size-1 side: the other role
        known = per_dim[0] or per_dim[1]
        if known in (("out",), ("in",)):
            per_dim = [p or (("in",) if known == ("out",) else ("out",)) for p in per_dim]
    splits = {_split_of(u.product.resolved()) for u in rec.products}
    problems = [p for _, _, p in splits if p]
    if problems:
        return ParamUse(name, "unknown", problems[0])
    if len(splits) > 1:
        return ParamUse(name, "unknown", "output split in some products and not in others")
    split, glu, _ = splits.pop()
    if any(u.partial for u in rec.products):
        # the weight split before its products (wq, wk, wv = w.split(d)): its output rows in parts
        atoms = {p[0] for u in rec.products for p in u.partial}
        if len(atoms) != 1 or any(len(u.partial) != 1 for u in rec.products) or split is not None:
            return ParamUse(name, "unknown", "multiplied in slices")
        atom = atoms.pop()
        spans = sorted({(p[1], p[2]) for u in rec.products for p in u.partial})
        at, parts = 0, []
        for start, length in spans:
            if start != at:
                break
            parts.append(length * atom[1])
            at += length
        if roles.get(atom) != "out" or at != atom[2] or len(parts) < 2:
            side = ", its input side (no param-group keys split a matrix's columns)" if roles.get(atom) == "in" else ""
            return ParamUse(name, "unknown", f"multiplied in slices {spans} of its dim {atom[0]}{side}")
        split, glu = tuple(parts), False
    seen = []
    sizes = split
    nd_mode = "error"
    if len(shape) == 2 and per_dim[0] in (("out",), ("in",)) and per_dim[1] in (("out",), ("in",)) \
            and per_dim[0] != per_dim[1]:
        layout = "out_in" if per_dim[0] == ("out",) else "in_out"
    elif len(shape) >= 3 and all(r == ("batch",) for r in per_dim[:-2]) and \
            {per_dim[-2], per_dim[-1]} == {("out",), ("in",)}:
        layout = "out_in" if per_dim[-2] == ("out",) else "in_out"
        nd_mode = "batch"
        seen.append(f"{'x'.join(map(str, shape[:-2]))} stacked matrices")
    elif len(shape) >= 3 and per_dim[0] in (("out",), ("in",)) and all(
            set(r) == {"in", "out"} - set(per_dim[0]) for r in per_dim[1:]):
        # one matrix whose other side spans the trailing dims (XLNet's (d_model, heads, head_dim))
        layout = "out_in" if per_dim[0] == ("out",) else "in_out"
        nd_mode = "flatten"
        seen.append(f"one matrix {shape[0]} x {'x'.join(map(str, shape[1:]))}")
    elif len(shape) == 2 and ("batch", "out") in per_dim and ("in",) in per_dim:
        stacked = 0 if per_dim[0] == ("batch", "out") else 1
        experts = [a for a in roles if a[0] == stacked and roles[a] == "batch"][0][2]
        rows = shape[stacked] // experts
        if split is not None:
            return ParamUse(name, "unsupported", f"{experts} matrices stacked along dim {stacked}, each split "
                            "again: no param-group keys describe them (store the stack 3-D)")
        layout = "out_in" if stacked == 0 else "in_out"
        sizes = (rows,) * experts
        seen.append(f"{experts} matrices stacked along dim {stacked}")
    elif len(shape) == 2 and ("batch", "in") in per_dim:
        return ParamUse(name, "unsupported", "matrices stacked along their input dim: no param-group keys "
                        "describe them (store the stack (E, out, in) or (E, in, out))")
    else:
        return ParamUse(name, "unknown", f"multiplied with dims as {per_dim}")
    seen.append("(out, in)" if layout == "out_in" else "(in, out)")
    if routed:
        return ParamUse(name, "router", "product feeding a top-k over its outputs",
                        MatrixView("router", f"router ({' '.join(seen)}; routers={routers!r})", nd_mode, layout,
                                   optimizer=routers))
    if split is not None and sizes == split:
        parts = " + ".join(map(str, split))
        if glu:
            if fused_gate_up == "whole":
                seen.append(f"fused gate/up [{parts}] whole")
                sizes = None
            else:
                seen.append(f"fused gate/up split [{parts}]")
        else:
            seen.append(f"{'weight' if any(u.partial for u in rec.products) else 'output'} split [{parts}]")
    what = "product " + ", ".join(seen)
    kind = {"batch": "experts", "flatten": "nd"}.get(nd_mode, "fused" if sizes is not None else "linear")
    return ParamUse(name, "matrix", what, MatrixView(kind, f"use: {what}", nd_mode, layout, sizes))


def _is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__) and hasattr(model, "config")


def example_forward_inputs(model: nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` as (args, kwargs) for one ``model(*args, **kwargs)`` call: a tuple / list of
    positional args, a dict of keyword args, or one tensor; None for a transformers model: its
    ``dummy_inputs`` (a small ``input_ids``; ``pixel_values`` of its config's image size for a
    model whose main input they are). A TypeError names ``model.forward``'s signature
    when they do not bind to it."""
    if example_inputs is None:
        if not _is_transformers_model(model):
            raise ValueError(f"example_inputs: {type(model).__name__} is not a transformers model, so the trace "
                             "needs example inputs for one forward call (a tuple of args or a dict of kwargs)")
        dummy = None
        try:
            dummy = model.dummy_inputs
        except Exception:
            dummy = None
        config = model.config
        if getattr(model, "main_input_name", "input_ids") == "pixel_values" and (
                not isinstance(dummy, Mapping) or "pixel_values" not in dummy):
            size = getattr(config, "image_size", 224)
            size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
            dummy = {"pixel_values": torch.randn(1, getattr(config, "num_channels", 3), *size)}
        if not isinstance(dummy, Mapping) or not dummy:
            dummy = {"input_ids": torch.tensor([[1, 2, 3, 0], [0, 3, 2, 1]])}
        example_inputs = dict(dummy)
    if isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TypeError(f"example_inputs must be a tuple of positional args, a dict of keyword args or a tensor, got "
                        f"{type(example_inputs).__name__}")
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return args, kwargs
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"example_inputs do not fit {type(model).__name__}.forward{signature}: {exc}") from None
    return args, kwargs


def _takes(model: nn.Module, argument: str) -> bool:
    try:
        return argument in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _to(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, Mapping):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to(v, device) for v in tree) if not hasattr(tree, "_fields") else \
            type(tree)(*(_to(v, device) for v in tree))
    return tree


def _param_names(model: nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), (name, p))
    return out


def _module_tensors(model: nn.Module) -> dict:
    """Each module's buffers and tensor attributes, to undo what a forward on meta caches on them
    (a rotary table computed on first use, say)."""
    return {m: (dict(m._buffers), dict(vars(m))) for m in model.modules()}


def _restore_module_tensors(model: nn.Module, state: dict) -> None:
    for m in model.modules():
        buffers, attrs = state.get(m, ({}, {}))
        for k in list(m._buffers):
            if k not in buffers:
                del m._buffers[k]
            elif m._buffers[k] is not buffers[k]:
                m._buffers[k] = buffers[k]
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and v.device.type == "meta" and attrs.get(k) is not v:
                if k in attrs:
                    setattr(m, k, attrs[k])
                else:
                    delattr(m, k)


def _run(model, params, args, kwargs, meta: bool):
    if meta:
        replacement: dict[int, torch.Tensor] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + \
                list(model.named_buffers(remove_duplicate=False)):
            if id(t) not in replacement:
                replacement[id(t)] = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            tensors[name] = replacement[id(t)]
        traced = {id(replacement[k]): (name, replacement[k]) for k, (name, _) in params.items()}
        tracer = _Tracer(traced)
        back = {id(replacement[k]): k for k in params}
        state = _module_tensors(model)
        try:
            with torch.no_grad(), fsdp_hooks_set_aside(model), tracer:  # DTensors: param_use_sharded.py
                result = torch.func.functional_call(model, tensors, _to(args, "meta"), _to(kwargs, "meta"),
                                                    tie_weights=True, strict=False)
        finally:
            _restore_module_tensors(model, state)
        tracer.outputs(result)
        return tracer, back
    device = next((p.device for _, p in params.values()), torch.device("cpu"))
    tracer = _Tracer(params)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), tracer:
            result = model(*_to(args, device), **_to(kwargs, device))
        tracer.outputs(result)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return tracer, {k: k for k in params}


def trace_parameter_uses(model: nn.Module, example_inputs: Any = None, *, fused_gate_up: str = "split",
                         routers: str = "adamw", real_fallback: bool = True) -> ParameterUses:
    """Run ``model``'s forward once on ``example_inputs`` (see :func:`example_forward_inputs`) and
    read from the ops what each parameter is (see the module docstring). ``fused_gate_up`` and
    ``routers`` are those of :func:`megatron_eopt.route_parameters`. The forward runs on meta
    tensors; where it cannot, on the real parameters (``real_fallback``). A forward that fails both
    ways gives ``error`` and no uses; bad ``example_inputs`` are a TypeError naming the forward's
    signature. DTensor parameters are traced at their global shapes, FSDP2's hooks set aside, on
    meta only; under other forward hooks (tensor parallelism) a ValueError names the parameter
    (:mod:`megatron_eopt.param_use_sharded`)."""
    check_view_options(fused_gate_up, routers)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        if (problem := sharded_trace_problem(model)) is not None:
            raise ValueError(f"example_inputs: {problem}")
        real_fallback = False  # a forward on the shards would gather them
    args, kwargs = example_forward_inputs(model, example_inputs)
    params = _param_names(model)
    errors = []
    tracer = back = None
    ran_on = ""
    attempts = [kwargs]
    if example_inputs is None and "use_cache" not in kwargs and _takes(model, "use_cache"):
        # a transformers model's dummy inputs once more without a cache: the cache of a hybrid model
        # (linear attention / SSM layers) may refuse a first call; the weights' use is the same
        attempts.append(dict(kwargs, use_cache=False))
    for call_kwargs in attempts:
        tracer = None
        for meta in (True, False):
            if not meta and (not real_fallback or any(p.device.type == "meta" for _, p in params.values())):
                break
            try:
                tracer, back = _run(model, params, args, call_kwargs, meta)
                ran_on = "meta" if meta else "real"
                if not (meta and tracer.unreadable and real_fallback and
                        all(p.device.type != "meta" for _, p in params.values())):
                    break
                errors.append("meta: an output split by an index only real tensors hold")
            except Exception as exc:
                errors.append(f"{'meta' if meta else 'real'}: {type(exc).__name__}: {str(exc)[:300]}")
        if tracer is not None:
            break
    if tracer is None:
        return ParameterUses({}, error="; ".join(errors))
    uses: dict[int, ParamUse] = {}
    problems = []
    for key, rec in tracer.records.items():
        use = _decide(rec, fused_gate_up, routers)
        uses[back[key]] = use
        if use.kind == "unknown":
            problems.append(f"{use.name}: {use.seen}")
    return ParameterUses(uses, ran_on, None, problems)
