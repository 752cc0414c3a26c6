"""The collectives the package's steps call, counted for ``step_stats()``.

Each wrapper calls its ``torch.distributed`` namesake with the same arguments and counts the call
and the bytes this rank sends by the conventions of :mod:`megatron_eopt.step_stats` (nothing is
counted outside a recorded step). Every collective an optimizer issues goes through here, so the
figures and the planner's model cannot drift apart by a call someone forgot to count.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from .step_stats import count_collective, recording


def _size(group) -> int:
    return dist.get_world_size(group)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    if recording():
        p = _size(group)
        count_collective(2 * (p - 1) * _bytes(tensor) // p)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    if recording():
        count_collective((_size(group) - 1) * _bytes(tensor))
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=dist.ReduceOp.SUM, group=None,
                   async_op: bool = False):
    if recording():
        count_collective((_size(group) - 1) * _bytes(output))
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    if recording():
        p = _size(group)
        if input_split_sizes is None:
            sent = _bytes(input) * (p - 1) // p
        else:
            own = input_split_sizes[dist.get_rank(group)]
            sent = (input.numel() - own) * input.element_size()
        count_collective(sent)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def all_gather_object(object_list: list, obj, group=None) -> None:
    if recording():
        count_collective((_size(group) - 1) * len(pickle.dumps(obj)))
    dist.all_gather_object(object_list, obj, group=group)


def count_dtensor_gather(local: torch.Tensor, mesh_dim_sizes) -> None:
    """Counts DTensor's ``full_tensor()`` of a tensor whose local part is ``local``: one all-gather
    per mesh dim of size > 1 that shards it, innermost first, each of what the ranks hold by then."""
    if not recording():
        return
    held = _bytes(local)
    for p in mesh_dim_sizes:
        if p > 1:
            count_collective((p - 1) * held)
            held *= p


__all__ = ["all_gather", "all_gather_object", "all_reduce", "all_to_all_single", "count_dtensor_gather",
           "reduce_scatter"]
