"""``overlap_backward`` under Megatron-LM's DistributedDataParallel: Newton–Schulz starts as DDP's
bucket groups finish reducing.

Megatron's DDP accumulates every gradient into a flat ``main_grad`` buffer and reduces it per bucket
group (all-reduce, or reduce-scatter for the distributed and layer-wise optimizers); with
``overlap_grad_reduce`` a group's reduction is dispatched during backward, as soon as its last
gradient is accumulated, and waited for at the end (``finish_grad_sync``). The optimizer reads
``main_grad`` only in ``step()``, where Megatron's wrappers hand it over as ``.grad`` (the fp32
main parameter's ``grad`` is the fp32 ``main_grad`` itself).

:func:`attach` wraps each bucket group's ``start_grad_sync`` and ``finish_grad_sync``. When a group
dispatches its reduction, the groups dispatched before it are finished: their reduction is waited
for (on the CPU gloo's wait blocks; on CUDA, NCCL's wait is issued on the optimizer's side stream,
so backward's stream does not wait), their parameters' ``.grad`` is set to what Megatron's wrapper
would set in ``step()`` (the same tensor: ``main_grad``), and the overlapped optimizers start each
chunk whose gradients are then all final (``step.overlap.grads_final``). The last groups are
finished in ``finish_grad_sync``, which Megatron calls for every group at the end of backward. So
every rank finishes the groups in dispatch order (backward's order, the same on every rank), on the
thread that runs backward, and a chunk with collectives (tensor-parallel stacks) runs there, in that
order. Without ``overlap_grad_reduce`` (or in the first batch, where Megatron dispatches in
``finish_grad_sync``), the groups finish at the end of backward: correct, with nothing to overlap.

The step is bitwise the step without overlap (the one engine's, ``step.engine``). A parameter
whose ``main_grad`` is not of its main parameter's dtype (bf16 gradients without fp32 accumulation:
Megatron copies them in ``step()``), or is a tensor of its own beside the buffer (higher-precision
local accumulation: Megatron copies the reduced values back in ``finish_grad_sync``), is left to
``step()``. Clipping must leave Muon's gradients
alone (the default ``clip_policy="adamw"`` of :func:`megatron_eopt.integrations.megatron.install`
does); a clip that scales them is refused at ``step()``.
"""

from __future__ import annotations

from typing import Any

from ..optim.step import overlap as step_overlap

_WRAPPED = "_megatron_eopt_overlap_order"  # on a bucket group: the _GroupOrder it reports to


class _GroupOrder:
    """One DDP module's bucket groups, finished in the order their reductions were dispatched."""

    def __init__(self) -> None:
        self.pending: list[Any] = []  # dispatched, not finished yet

    def dispatched(self, group: Any) -> None:
        """``group`` dispatched its reduction: the groups dispatched before it are finished."""
        earlier = [g for g in self.pending if g is not group]
        self.pending = [group]
        for g in earlier:
            _finish(g)

    def finished(self, group: Any) -> None:
        """Megatron finished ``group``'s reduction (it waited for it): it and the groups dispatched
        before it are final."""
        if group not in self.pending:
            return
        k = self.pending.index(group)
        done, self.pending = self.pending[: k + 1], self.pending[k + 1:]
        for g in done:
            _finish(g)


def _finish(group: Any) -> None:
    """``group``'s gradients are final: their optimizer parameters get them as ``.grad`` and the
    overlapped optimizers holding them are told."""
    params = []
    for bucket in group.buckets:
        # A parameter accumulating into a main_grad of its own (higher precision than the buffer) gets
        # the reduced values copied back only in Megatron's finish_grad_sync: left to step().
        apart = {id(p) for p in getattr(bucket, "params_with_extra_main_grads", ())}
        for p in bucket.params_list:
            if id(p) in apart:
                continue
            q = getattr(p, "main_param", None)
            q = p if q is None else q
            g = getattr(p, "main_grad", None)
            if g is None or not step_overlap.overlapping(q) or g.dtype != q.dtype or g.shape != q.shape:
                continue  # (not an overlapped optimizer's, or Megatron copies its gradient in step())
            q.grad = g  # what Megatron's optimizer wrappers set in step(): main_grad itself
            params.append(q)
    if params:
        handle = group.grad_reduce_handle
        step_overlap.grads_final(params, wait=None if handle is None else handle.wait)


def _bucket_groups(module: Any) -> list[Any]:
    return list(getattr(module, "bucket_groups", ())) + list(getattr(module, "expert_parallel_bucket_groups", ()))


def is_megatron_ddp(module: Any) -> bool:
    """Whether ``module`` reduces its gradients in Megatron-LM DDP bucket groups."""
    return hasattr(module, "bucket_groups")


def attach(model_chunks: Any) -> int:
    """Makes the bucket groups of the Megatron DDP modules among ``model_chunks`` report their reduced
    gradients to the overlapped optimizers (see the module docstring). Idempotent; returns the number
    of bucket groups newly wrapped. A chunk that is not Megatron DDP (torch FSDP2's wrapper: its
    gradients are final when FSDP2's hooks run, which the optimizer sees itself) is left alone."""
    wrapped = 0
    for chunk in model_chunks:
        if not is_megatron_ddp(chunk):
            continue
        groups = _bucket_groups(chunk)
        order = next((getattr(g, _WRAPPED) for g in groups if hasattr(g, _WRAPPED)), None) or _GroupOrder()
        for group in groups:
            if hasattr(group, _WRAPPED):
                continue
            _wrap(group, order)
            step_overlap.announced_by_wrapper(p for bucket in group.buckets for p in bucket.params_list)
            wrapped += 1
    return wrapped


def _wrap(group: Any, order: _GroupOrder) -> None:
    start, finish = group.start_grad_sync, group.finish_grad_sync

    def start_grad_sync(*args: Any, **kwargs: Any) -> None:
        before = group.grad_reduce_handle
        start(*args, **kwargs)
        # (Megatron makes a second dispatch in the first batch a no-op: the handle is then unchanged)
        if group.grad_reduce_handle is not before or group.grad_reduce_handle is None:
            order.dispatched(group)

    def finish_grad_sync(*args: Any, **kwargs: Any) -> None:
        finish(*args, **kwargs)
        order.finished(group)

    group.start_grad_sync = start_grad_sync
    group.finish_grad_sync = finish_grad_sync
    setattr(group, _WRAPPED, order)
