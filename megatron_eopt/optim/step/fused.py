"""The phases of the fused step, per chunk of matrices (see ``orthogonalized`` for the sequence):
momentum into stacked Newton–Schulz inputs, batched Newton–Schulz (and a subclass's
``orthogonalize``), second-moment normalization, decay and update.

A mixin of :class:`~megatron_eopt.optim.orthogonalized.OrthogonalizedOptimizer`, which owns the
plan, the configuration and ``step()``; this module holds what one step does with them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ... import low_memory_state as lms
from ... import ops
from ..._errors import call_op
from ...second_moment import moment2_view
from .._config import check_step_value
from ..multirank.tp_modes import (
    distributed_orthogonalize,
    gather_shards,
    gtp_orthogonalize,
    layer_sharded_orthogonalize,
    local_chunk,
    tp_namo_normalize_,
    tp_normuon_normalize_,
)
from ..matrix_view import MatrixSplit, split_newton_schulz
from .grouping import Plan, Stack
from ..multirank.layer_homes import home_orthogonalize
from ..multirank.agreement import capturing_cuda_graph
from ..multirank.dtensor_layout import is_dtensor, local
from ..multirank.sharded_statistics import sharded_namo_, sharded_normuon_
from .block_periodic import block_orthogonalize, block_scale
from .layout import ChunkLayout, buffer_floats

_OPS = torch.ops.megatron_eopt


# The device types whose fused step orthogonalizes its Newton–Schulz inputs in place. CUDA joins
# once a GPU run has measured it (until then: set_in_place_newton_schulz(cuda=True), or the
# environment variable MEGATRON_EOPT_IN_PLACE_NS_CUDA=1 when the package is imported).
_IN_PLACE_DEVICE_TYPES = {"cpu"} | ({"cuda"} if os.environ.get("MEGATRON_EOPT_IN_PLACE_NS_CUDA") == "1" else set())


def in_place_newton_schulz(device: torch.device | str) -> bool:
    """Whether the fused step on ``device`` orthogonalizes its Newton–Schulz inputs in place
    (``torch.ops.megatron_eopt.newton_schulz_``): the results take the inputs' memory, a quarter
    of each matrix's working set in the step, with bit-identical results."""
    return torch.device(device).type in _IN_PLACE_DEVICE_TYPES


def set_in_place_newton_schulz(*, cuda: bool) -> None:
    """Process-wide: whether the fused step on CUDA devices orthogonalizes in place (the CPU always
    does). Off by default until measured on a GPU; results are the same bits either way."""
    if not isinstance(cuda, bool):
        raise TypeError(f"set_in_place_newton_schulz: cuda must be True or False, got {cuda!r}")
    (_IN_PLACE_DEVICE_TYPES.add if cuda else _IN_PLACE_DEVICE_TYPES.discard)("cuda")


class FusedStep:
    """The fused step's checks and phases (see the module docstring)."""

    # ------------------------------------------------------------------ checks and per-step values
    def _check_grads(self, plan: Plan, active: list[bool]) -> None:
        self._check_grads_of(plan, (i for i, a in enumerate(active) if a))

    def _check_grads_of(self, plan: Plan, indices) -> None:
        """The grads of the entries ``indices`` (each has one), checked against their params."""
        for i in indices:
            entry = plan.entries[i]
            p, g = entry.param, entry.param.grad
            if g.is_sparse:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients (param of shape {tuple(p.shape)})"
                )
            # entry.sharding: p is a DTensor (the plan is rebuilt when a param is replaced)
            if entry.sharding is not None and (not is_dtensor(g) or g.placements != p.placements
                                               or g.device_mesh != p.device_mesh):
                raise ValueError(
                    f"grad of a DTensor param of shape {tuple(p.shape)} with placements {list(p.placements)} must be a "
                    f"DTensor on the same mesh and placements, got "
                    f"{list(g.placements) if is_dtensor(g) else type(g).__name__}"
                )
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(
                    f"grad of a param of shape {tuple(p.shape)}, {p.dtype} on {p.device} must match it, got "
                    f"shape {tuple(g.shape)}, {g.dtype} on {g.device}"
                )

    def _write_hyperparameters(self, plan: Plan, active: list[bool]) -> None:
        """Checks the per-step values of the groups in use, then writes them to the device tensors."""
        groups_used = {plan.entries[i].group_index for i in range(len(plan.entries)) if active[i]}
        keys = self._step_keys()
        for gi in sorted(groups_used):
            group = self.param_groups[gi]
            for key in keys:
                check_step_value(key, group[key], f"param_groups[{gi}]", self._momentum_below_one)
        if not torch.compiler.is_compiling() and capturing_cuda_graph(plan):
            # A host value (Python number or CPU tensor) is written into the graph as a constant.
            # That is what a constant momentum or weight decay wants, but a learning rate is
            # scheduled: a captured host lr would replay its capture-time value forever.
            for gi in sorted(groups_used):
                if _host_value(self.param_groups[gi]["lr"]) is not None:
                    raise RuntimeError(
                        f"param_groups[{gi}]['lr'] is a Python number while a CUDA graph is being captured: "
                        "the graph would replay the value it had at capture time. Store it as a 0-dim tensor "
                        f"on the device (param_groups[{gi}]['lr'] = torch.tensor(value, device='cuda')) and "
                        "update it in place between replays (other per-step values given as numbers are "
                        "captured as constants)."
                    )
        for (gi, _device), tensors in self._hyper.items():
            if gi in groups_used:
                group = self.param_groups[gi]
                for key, buf in tensors.items():
                    _write_scalar(buf, group[key])

    def _momentum_grad_divisor(self, hyper: dict[str, torch.Tensor], grad_scale: torch.Tensor | None):
        """What the momentum op divides the gradients by: GradScaler's scale (None: nothing).
        A subclass may fold a per-group factor in (``hyper`` holds the group's device scalars),
        e.g. ``1 - momentum`` for an SGD-style buffer ``buf = momentum·buf + g``."""
        return grad_scale

    # MuonBP (step.block_periodic): off unless a class sets block_period
    block_period: int | None = None
    block_lr_scale: float = 1.0
    _block_steps: int = 0  # fused steps taken, which decide the next one's kind

    @torch._disable_dynamo
    def _block_step_now(self) -> bool:
        """Whether this step orthogonalizes sharded matrices shard by shard (a graph break under
        torch.compile: the step's kind is a Python decision)."""
        period = self.block_period
        return period is not None and (self._block_steps + 1) % period != 0

    @torch._disable_dynamo
    def _count_block_step(self) -> None:
        if self.block_period is not None:
            self._block_steps += 1

    def _grad_scaler_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """GradScaler's grad_scale and found_inf, set on the optimizer for the duration of step()."""
        return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)


    # The phases of one chunk. ``members`` are the chunk's entries with a grad; ``ns_inputs``,
    # ``updates`` and ``scales`` are dicts keyed by entry index.
    def _scaler_tensors_per_device(self, plan: Plan) -> dict:
        """GradScaler's (grad_scale, found_inf), one copy per device, as torch's fused optimizers do."""
        grad_scale, found_inf = self._grad_scaler_tensors()
        scalers: dict[torch.device, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for bucket in plan.buckets:
            if bucket.device not in scalers:
                scalers[bucket.device] = (
                    None if grad_scale is None else grad_scale.to(bucket.device, non_blocking=True),
                    None if found_inf is None else found_inf.to(bucket.device, non_blocking=True),
                )
        return scalers

    @staticmethod
    def _ns_input_buffers(layouts: tuple[ChunkLayout, ...]) -> dict[torch.device, torch.Tensor]:
        """One flat fp32 buffer per device, as large as the stacked NS inputs of the largest chunk:
        every chunk of the step writes its inputs into it (sharded matrices have their own)."""
        return {device: torch.empty(floats, dtype=torch.float32, device=device)
                for device, floats in buffer_floats(layouts).items()}

    @staticmethod
    def _ns_input_views(plan: Plan, layout: ChunkLayout, inputs: dict) -> tuple[dict, dict]:
        """The NS input of each member, and per stack its members with their (k, m, n) input: the
        stacks lie one after another in the device's flat buffer and each member's input is its slice
        (an nd_mode "batch" entry its E consecutive slices); a sharded matrix has its own local part."""
        entries = plan.entries
        ns_inputs: dict[int, torch.Tensor] = {}
        for i in layout.own_inputs:
            e = entries[i]
            ns_inputs[i] = torch.empty(e.local_shape, dtype=torch.float32, device=e.param.device)
        stacked: dict[int, tuple[list[int], torch.Tensor]] = {}
        for slot in layout.stacks:
            floats = slot.count * slot.rows * slot.cols
            buf = inputs[slot.device][slot.start : slot.start + floats].view(slot.count, slot.rows, slot.cols)
            stacked[slot.stack_index] = (list(slot.members), buf)
            slices = buf.unbind(0)  # one call for every matrix's view: the step's host time counts
            for i, k, batch in zip(slot.members, slot.firsts, slot.batches):
                ns_inputs[i] = slices[k] if batch is None else buf[k : k + batch]
        return ns_inputs, stacked

    def _momentum_phase(self, plan: Plan, layout: ChunkLayout, ns_inputs: dict, scalers: dict) -> list[tuple]:
        """1. Momentum (and L2 decay, Nesterov) per bucket, writing the NS inputs. Returns what the
        update phase needs per bucket."""
        entries = plan.entries
        # The chunk's members per bucket, in the bucket's (entry) order: a one-chunk step launches
        # exactly what an unchunked one does. Costs the chunk's size, not the model's.
        launches = []
        for bi, bucket_members, plain in layout.buckets:
            bucket = plan.buckets[bi]
            states = [self._init_entry_state(i) for i in bucket_members]
            group = self.param_groups[bucket.group_index]
            group_cfg = plan.configs[bucket.group_index]
            # The ops run on local matrix views (DTensor: to_local(); nd_mode: (E, m, n) or
            # (size(0), -1)); they take any dense layout (a transposed parameter and its
            # row-major NS input).
            if plain:  # the params are their own matrix views, and so are their grads (_check_grads)
                params = [entries[i].param for i in bucket_members]
                grads = [local(p.grad) for p in params]
            else:
                params = [entries[i].view(entries[i].param) for i in bucket_members]
                grads = [entries[i].view(entries[i].param.grad) for i in bucket_members]
            hyper = {k: buf.view(()) for k, buf in self._hyper[(bucket.group_index, bucket.device)].items()}
            scale_t, inf_t = scalers[bucket.device]
            momentum_args = dict(
                momentum=hyper["momentum"],
                nesterov=group_cfg.nesterov,
                weight_decay=hyper["weight_decay"],
                weight_decay_method=group_cfg.weight_decay_method,
                grad_scale=self._momentum_grad_divisor(hyper, scale_t),
                found_inf=inf_t,
            )
            l2_params = params if group_cfg.weight_decay_method == "l2" else ()
            outs = [ns_inputs[i] for i in bucket_members]
            if not self._low_memory_state:
                bufs = [s["momentum_buffer"] for s in states] if plain else \
                    [entries[i].view(s["momentum_buffer"]) for i, s in zip(bucket_members, states)]
                # The op itself, not the checking wrapper: every argument is the step's own
                # (device scalars, lists built above), and a wrapper call per bucket and chunk
                # shows in a small model's step time.
                call_op(_OPS.foreach_momentum_, grads, bufs, outs, list(l2_params), momentum_args["momentum"],
                        momentum_args["nesterov"], momentum_args["weight_decay"], momentum_args["weight_decay_method"],
                        momentum_args["grad_scale"], momentum_args["found_inf"])
            else:  # codes as the local matrix view (blocks along its rows); the other lists pair up element
                # by element; draws keyed by each param's id and each element's index in the whole view
                codes = [entries[i].view(s["momentum_buffer"]) for i, s in zip(bucket_members, states)]
                scales = [local(s["momentum_buffer_scales"]) for s in states if "momentum_buffer_scales" in s]
                ops.foreach_momentum_quantized_(grads, codes, scales, outs, l2_params, block_size=self.state_block_size,
                                                seed=self._state_seeds[bucket.device],
                                                draws=[entries[i].draws for i in bucket_members], **momentum_args)
            launches.append((bucket, group, group_cfg, bucket_members, params, grads, states, hyper, scale_t, inf_t))
        return launches

    def _orthogonalize_phase(self, plan: Plan, members: list[int], ns_inputs: dict,
                             stacked: dict, loads: dict | None = None) -> tuple[dict, dict]:
        """2. Newton–Schulz per stack (sharded matrices: owner or gather mode, see multirank.sharded), then a
        subclass's orthogonalize() override. Returns the raw updates and their scales. ``loads``: the
        owners' and layer-sharded homes' loads this chunk's balancing starts from (``step.balance``;
        updated in place), None: zero."""
        loads = {} if loads is None else loads
        entries = plan.entries
        updates: dict[int, torch.Tensor] = {}
        by_config: dict[int, list[int]] = {}  # sharded matrices: groups with their own settings run apart
        for i in members:
            if entries[i].spans_ranks:
                by_config.setdefault(id(plan.configs[entries[i].group_index]), []).append(i)
        # MuonBP: shards orthogonalized where they are (step.block_periodic)
        block = self.block_period is not None and bool(by_config) and self._block_step_now()
        for sharded in by_config.values():
            cfg = plan.configs[entries[sharded[0]].group_index]
            if block:
                outs = block_orthogonalize(cfg, [ns_inputs[i] for i in sharded])
            else:
                outs = self._sharded.run([entries[i].sharding for i in sharded], [ns_inputs[i] for i in sharded],
                                         cfg, [entries[i].split for i in sharded], loads)
            updates.update(zip(sharded, outs))
        # Nothing reads a Newton–Schulz input after its Newton–Schulz (but NAMO's normalization and
        # an orthogonalize() override), so the results may take the inputs' memory: a quarter of a
        # matrix's working set in the step.
        in_place = self._config.moment2_method != "namo" and self._orthogonalize_is_base()
        for si, (stack_members, x) in stacked.items():
            self._count_ns_inputs_below_eps(plan.stacks[si], x)
            results = self._orthogonalize(plan.stacks[si], x, in_place=in_place and in_place_newton_schulz(x.device),
                                          loads=loads)
            slices = results.unbind(0) if isinstance(results, torch.Tensor) else results
            k = 0
            for i in stack_members:
                e = entries[i]
                if len(e.local_shape) == 2:
                    updates[i] = slices[k]
                else:  # the E results of a batch entry: contiguous slices of one output
                    updates[i] = torch.stack(results[k : k + e.batch]) if isinstance(results, list) \
                        else results[k : k + e.batch]
                k += e.batch
        scales = {i: entries[i].update_scale for i in members}
        if block:
            for sharded in by_config.values():
                for i in sharded:
                    scales[i] = block_scale(plan.configs[entries[i].group_index], tuple(ns_inputs[i].shape),
                                            self.block_lr_scale)
        if not self._orthogonalize_is_base():
            self._call_orthogonalize_override(entries, members, ns_inputs, updates, scales)
        return updates, scales

    def _count_ns_inputs_below_eps(self, stack: Stack, x: torch.Tensor) -> None:
        """Adds to the step's count the matrices of one (k, m, n) stack whose Frobenius norm is below
        the normalization eps (their Newton–Schulz output degenerates), before the Newton–Schulz may
        overwrite ``x``. A tensor-parallel stack holds shards, whose norms are not the matrices'; it
        is not counted (a DTensor sharded across ranks is counted whole by the sharded path, on the
        rank that orthogonalizes it: ``_count_below_eps``)."""
        if stack.tp is None and stack.gtp is None:
            self._count_below_eps(x, stack.config.ns_eps)

    def _count_below_eps(self, x: torch.Tensor, eps: float) -> None:
        """One norm per matrix of ``x`` (k, m, n) and a sum, on the device, no host sync."""
        if self.__dict__.get("_overlap") is not None:  # backward's work counts from a worker thread and the hooks
            with self._engine.lock:
                self._count_below_eps_unlocked(x, eps)
        else:
            self._count_below_eps_unlocked(x, eps)

    def _count_below_eps_unlocked(self, x: torch.Tensor, eps: float) -> None:
        counts = self.__dict__.get("_ns_below_eps_counts")
        if counts is None:
            counts = self._ns_below_eps_counts = {}
        count = counts.get(x.device)
        if count is None:
            count = counts[x.device] = torch.zeros((), dtype=torch.int64, device=x.device)
        norms = torch.linalg.vector_norm(x, dim=(-2, -1))
        count.add_((norms < eps).sum())

    def _reset_ns_inputs_below_eps(self, plan: Plan) -> None:
        """Zeroes the step's count; the first step makes it on the first parameter's device, so that a
        rank that runs no Newton–Schulz itself (owner mode) still reads 0 rather than None."""
        counts = self.__dict__.get("_ns_below_eps_counts")
        if counts is None:
            counts = self._ns_below_eps_counts = {}
        if not counts and plan.entries:
            device = local(plan.entries[0].param).device
            counts[device] = torch.zeros((), dtype=torch.int64, device=device)
        for count in counts.values():
            count.zero_()

    @property
    def ns_inputs_below_eps(self) -> torch.Tensor | None:
        """How many matrices entered Newton–Schulz with a Frobenius norm below its normalization eps
        (``ns_eps``) in the last fused step: a 0-D int64 tensor on the matrices' device (the sum over
        devices on the first), read without a host sync; None before the first fused step. Such a
        matrix's update is degenerate (a gradient clipped or underflowed to ~0, Megatron-LM's silent
        failure under a global clip). Tensor-parallel shards are not counted; a matrix sharded across
        ranks (DTensor) is counted by the rank that runs its Newton–Schulz (its owner, so a sum over
        the ranks counts each once; every rank in gather mode)."""
        counts = self.__dict__.get("_ns_below_eps_counts")
        if not counts:
            return None
        values = list(counts.values())
        total = values[0]
        for v in values[1:]:
            total = total + v.to(total.device)
        return total

    def _update_phase(self, plan: Plan, launches: list[tuple], updates: dict, scales: dict, ns_inputs: dict) -> None:
        """3. Second-moment normalization (AdaptiveMuon), 4. decay + update, per bucket."""
        hook = self._weight_update_hook
        for bucket, group, group_cfg, members, params, grads, states, hyper, scale_t, inf_t in launches:
            bucket_updates = [updates[i] for i in members]
            bucket_scales = [scales[i] for i in members]
            if self._config.moment2_method is not None:
                self._normalize(group, members, bucket_updates, grads, states, [ns_inputs[i] for i in members],
                                hyper, scale_t, inf_t)
            # cautious decay too: its mask reads the unscaled update and p before the decay, in the op
            if hook is None:
                call_op(_OPS.foreach_update_, params, bucket_updates, bucket_scales, hyper["lr"],
                        hyper["weight_decay"], group_cfg.weight_decay_method, inf_t)  # the op, as above
            else:
                self._hooked_update(hook, params, bucket_updates, bucket_scales, hyper, inf_t,
                                    group_cfg.weight_decay_method)

    def _hooked_update(self, hook, params, updates, scales, hyper, found_inf, weight_decay_method) -> None:
        """Decay, weight-update hook around ``p -= lr·update``, batched over one bucket (EO main's order:
        the hook sees the decayed weight and the scaled update)."""
        if weight_decay_method != "l2":  # decay alone: the update scaled by 0 leaves p as decay made it
            ops.foreach_update_(params, updates, [0.0] * len(params), lr=hyper["lr"],
                                weight_decay=hyper["weight_decay"], weight_decay_method=weight_decay_method,
                                found_inf=found_inf)
        torch._foreach_mul_(updates, scales)
        state = hook.fused_pre(params, updates)
        ops.foreach_update_(params, updates, [1.0] * len(params), lr=hyper["lr"], weight_decay=0.0,
                            weight_decay_method="decoupled", found_inf=found_inf)
        hook.fused_post(params, state)

    def _call_orthogonalize_override(self, entries, members, ns_inputs, updates, scales) -> None:
        """Runs a subclass's orthogonalize() for every member (its results replace the batched ones)."""
        muon = self._config.moment2_method is None
        batched = {}
        for i in members:
            e = entries[i]
            # Muon's orthogonalize returns the scaled update; QKV parts are scaled already.
            result = updates[i] * e.update_scale if muon and e.update_scale != 1.0 else updates[i]
            batched[id(e.param)] = (ns_inputs[i], result)
        self._batched = batched
        try:
            for i in members:
                e = entries[i]
                group = self.param_groups[e.group_index]
                out = self.orthogonalize(e.param, ns_inputs[i], **{k: v for k, v in group.items() if k != "params"})
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != e.local_shape:
                    raise ValueError(
                        f"{type(self).__name__}.orthogonalize must return a tensor of shape {e.local_shape} for a "
                        f"param of shape {tuple(e.param.shape)}, got "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                    )
                updates[i] = out.to(torch.float32).contiguous()
                if muon:
                    scales[i] = 1.0  # already scaled
        finally:
            self._batched = None
    def _orthogonalize(self, stack: Stack, x: torch.Tensor, in_place: bool = False,
                       loads: dict | None = None) -> list[torch.Tensor]:
        """Newton–Schulz of one stack: (k, m, n) fp32 NS inputs -> k fp32 (m, n) updates.

        Plain matrices come back raw (scaled later, in foreach_update_). QKV parts come back scaled
        for Muon (the split op fuses it) and raw for AdaptiveMuon (scaled after normalization).
        ``in_place``: ``x`` is the step's own buffer, which plain matrices' results may overwrite.
        ``loads``: the layer-sharded homes' loads (see :meth:`_orthogonalize_phase`).
        """
        if stack.home is not None:  # layer_sharded over GTP x TP, or TP-replicated: once per matrix, on a home
            load = ({} if loads is None else loads).setdefault(stack.home.key, [0.0] * stack.home.size)
            return home_orthogonalize(x, stack.home, stack.home.route(), stack.split, stack.config,
                                      stack.config.moment2_method is None, load)
        if stack.gtp is not None:  # the tensor-parallel mode's work on the gathered, unpadded rows
            return gtp_orthogonalize(x, stack.gtp, lambda rows: self._orthogonalize_tensor_parallel(stack, rows,
                                                                                                   loads=loads))
        return self._orthogonalize_tensor_parallel(stack, x, in_place, loads)

    def _orthogonalize_tensor_parallel(self, stack: Stack, x: torch.Tensor, in_place: bool = False,
                                       loads: dict | None = None):
        """:meth:`_orthogonalize` of the tensor-parallel local matrices (k, m, n) of a stack."""
        cfg = stack.config
        scale_parts = cfg.moment2_method is None
        tp = stack.tp
        if tp is not None and tp.mode == "distributed":
            out = distributed_orthogonalize(x, tp, stack.split, stack.global_shape, cfg, scaled=scale_parts)
            return list(out.unbind(0))
        if tp is not None and tp.mode == "layer_sharded":
            # homes balanced over the step's stacks of this group, from the plan's loads (step.balance)
            load = ({} if loads is None else loads).setdefault(tp.key, [0.0] * tp.size)
            return layer_sharded_orthogonalize(x, tp, stack.split, cfg, scale_parts, load)
        if tp is not None:  # duplicated: orthogonalize the global matrices on every rank
            x = gather_shards(x, tp)
        if stack.split is None:
            if tp is None:  # indexed like a list of its k matrices
                return cfg.newton_schulz_(x) if in_place else cfg.newton_schulz(x)
            outs = list(cfg.newton_schulz(x).unbind(0))
        else:  # every part of every projection of the stack: one batched NS per part size
            out = split_newton_schulz(cfg, x, stack.split, scale_parts)
            if tp is None:  # a tensor: an expert batch of a rank holding none of its experts is an empty slice
                return out
            outs = list(out.unbind(0))
        return [local_chunk(o, tp) for o in outs]

    def _normalize(self, group, members, updates, grads, states, ns_inputs, hyper, grad_scale, found_inf) -> None:
        """Second-moment normalization of the raw NS output of one bucket, then per-part QKV scales."""
        cfg = self._config
        entries = self._plan.entries
        beta2, eps = hyper["beta2"], hyper["eps"]
        method = cfg.moment2_method
        if method == "adamuon" and self._low_memory_state:  # elementwise: whole local tensors
            lms.adamuon_normalize_quantized_(
                updates, [entries[i].view(s["moment2_buffer"]) for i, s in zip(members, states)],
                [local(s["moment2_buffer_scales"]) for s in states if "moment2_buffer_scales" in s],
                beta2=beta2, eps=eps, block_size=self.state_block_size, seed=self._state_seeds[updates[0].device],
                found_inf=found_inf, draws=[entries[i].draws for i in members])
            for j, i in enumerate(members):
                if entries[i].split is not None:
                    _scale_parts_(updates[j], entries[i].split, entries[i].part_scales, _first_row(entries[i]))
            return
        moment2 = []
        for j, i in enumerate(members):
            v = local(states[j]["moment2_buffer"])
            moment2.append(entries[i].view(v) if method == "adamuon" else moment2_view(v, method, len(entries[i].local_shape)))
        # Statistics over a whole matrix: TP shards and sharded DTensors reduce them across ranks;
        # everything else goes to the fused op, nd_mode "batch" entries as their 2-D slices.
        subsets: dict[Any, list[int]] = {}
        fused: list[tuple] = []
        spanning: list[int] = []
        for j, i in enumerate(members):
            e = entries[i]
            if method != "adamuon" and e.tp is not None:
                subsets.setdefault(e.tp.key, []).append(j)
            elif method != "adamuon" and e.sharding is not None and e.sharding.kind != "local":
                spanning.append(j)
            elif len(e.local_shape) == 2:
                fused.append((updates[j], moment2[j], grads[j], ns_inputs[j]))
            else:
                x = ns_inputs[j]
                for k in range(e.batch):
                    fused.append((updates[j][k], moment2[j][k], grads[j][k], None if x is None else x[k]))
        if fused:
            u, v, g, x = (list(t) for t in zip(*fused))
            if method == "adamuon":
                ops.adamuon_normalize_(u, v, beta2=beta2, eps=eps, found_inf=found_inf)
            elif method == "normuon":
                ops.normuon_normalize_(u, v, beta2=beta2, eps=eps, found_inf=found_inf)
            else:
                ops.namo_normalize_(u, v, g, x, beta2=beta2, eps=eps, grad_scale=grad_scale, found_inf=found_inf)
        if spanning:
            as3 = lambda t: t if t.ndim == 3 else t.unsqueeze(0)  # noqa: E731
            lays = [entries[members[j]].sharding for j in spanning]
            u = [as3(updates[j]) for j in spanning]
            if method == "normuon":
                sharded_normuon_(u, [as3(moment2[j]) for j in spanning], lays,
                                 [entries[members[j]].normuon_dim for j in spanning], beta2=beta2, eps=eps,
                                 found_inf=found_inf)
            else:
                sharded_namo_(u, [moment2[j].view(-1) for j in spanning], [as3(grads[j]) for j in spanning],
                              [as3(ns_inputs[j]) for j in spanning], lays, beta2=beta2, eps=eps,
                              grad_scale=grad_scale, found_inf=found_inf)
        for key, js in subsets.items():
            u = [updates[j] for j in js]
            v = [moment2[j] for j in js]
            sub_entries = [entries[members[j]] for j in js]
            if method == "normuon":
                tp_normuon_normalize_(u, v, sub_entries, beta2=beta2, eps=eps, found_inf=found_inf)
            else:
                tp_namo_normalize_(
                    u, v, [grads[j] for j in js], [ns_inputs[j] for j in js], sub_entries, beta2=beta2, eps=eps,
                    grad_scale=grad_scale, found_inf=found_inf,
                )
        for j, i in enumerate(members):
            entry = entries[i]
            if entry.split is not None:
                _scale_parts_(updates[j], entry.split, entry.part_scales, _first_row(entry))


def _first_row(entry) -> int:
    """The projection row (a stored column for ``matrix_layout="in_out"``) of a sharded entry's first
    local one (0 where the rows are whole): a DTensor's, or a tensor-parallel row shard's (with GTP,
    its shard of the tensor-parallel rows)."""
    sharding = entry.sharding
    if sharding is not None and sharding.kind != "local":
        return sharding.local_box[0][-1 if entry.split.columns else -2]
    row = 0
    if entry.gtp is not None and not entry.gtp.blockwise:
        row += entry.gtp.rank * entry.local_shape[-2]
    if entry.tp is not None and entry.tp.partition_dim == 0:
        row += entry.tp.rank * (entry.global_shape[0] // entry.tp.size)
    return row


def _host_value(value) -> float | None:
    """The value of a per-step hyper-parameter held on the host (a Python number or a CPU tensor,
    read without touching any device), or None for a tensor on a device."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" else None
    return float(value)


def _write_scalar(buf: torch.Tensor, value) -> None:
    # ``buf`` has one element (see _rebuild_plan). Compiled writes go through a 1-element view:
    # torch 2.13's inductor drops in-place writes to a 0-dim float64 tensor (the step would run
    # with lr = 0).
    host_tensor = isinstance(value, torch.Tensor) and value.device.type == "cpu" and buf.device.type != "cpu"
    if isinstance(value, torch.Tensor) and (not host_tensor or torch.compiler.is_compiling()):
        buf.view(1).copy_(value.reshape(1))  # a device tensor keeps the step capturable in a CUDA graph
    elif torch.compiler.is_compiling():
        buf.view(1).zero_().add_(value)  # keeps the float a graph input (fill_ would specialize on it)
    else:
        # A Python number, or a CPU tensor for a device buffer: read on the host and written by a
        # fill kernel (a copy_ from pageable host memory would synchronize with the device).
        buf.fill_(_host_value(value))


def _scale_parts_(update: torch.Tensor, split: MatrixSplit, part_scales, first_row: int = 0) -> None:
    """Multiplies each QKV part of a (rows, cols) update (or an (E, rows, cols) batch of them) by its
    own Muon scale, in place. The update may be a shard of the projection's rows starting at matrix
    row ``first_row`` (a DTensor's local rows need not start or end on a query group). A projection
    stored (in, out) is split along its columns."""
    if split.columns:
        update = update.mT
    rows = update.shape[-2]
    if first_row == 0 and rows % split.total == 0:
        view = update.unflatten(-2, (rows // split.total, split.total))
        for offset, size, scale in part_scales:
            view[..., offset : offset + size, :].mul_(scale)
        return
    per_row = torch.empty(split.total, dtype=update.dtype)
    for offset, size, scale in part_scales:
        per_row[offset : offset + size] = scale
    index = (torch.arange(rows) + first_row) % split.total
    update.mul_(per_row[index].to(update.device).unsqueeze(1))
