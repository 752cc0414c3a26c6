"""torch's float32 matmul precision for a block of plain-PyTorch products."""

from __future__ import annotations

import contextlib

import torch

# The precision of the innermost fp32_matmul_precision block while torch.compile traces it (None
# outside any block). Only the trace reads and writes it: a compiled graph cannot switch torch's
# setting (inductor drops the setter), so the block's precision travels as a Python value instead.
_traced_block_precision: str | None = None


def _torch_precision_when_traced() -> str:
    # A constant of the graph, read when it is traced (dynamo guards on no such string).
    return torch.get_float32_matmul_precision()


# What torch._dynamo.assume_constant_result(fn) sets (it reads the string when tracing instead of
# breaking the graph), set here because importing torch._dynamo with this module costs about 2 s
# of every import. A torch that no longer reads it breaks the graph there, as before.
_torch_precision_when_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def current_fp32_matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``; inside a graph torch.compile traces, the innermost
    :func:`fp32_matmul_precision` block's precision. Outside a block, torch's "highest" is a constant
    of the graph (a change to "high" or "medium" turns TF32 on, which retraces); "high" and "medium"
    are read when the graph runs, a graph break: a change between them would not retrace."""
    if not torch.compiler.is_compiling():
        return torch.get_float32_matmul_precision()
    if _traced_block_precision is not None:
        return _traced_block_precision
    if _torch_precision_when_traced() == "highest":
        return "highest"
    return torch.get_float32_matmul_precision()


def fp32_matmul_precision(precision: str):
    """torch's float32 matmul precision set to ``precision`` for the block, restored after it
    (Emerging-Optimizers' context manager of the same name).

    Inside a graph torch.compile traces, torch's setting cannot change: the block's precision
    reaches what reads :func:`current_fp32_matmul_precision` (the Newton–Schulz functions with
    ``precision=None``), while plain PyTorch products in the block run at torch's setting around
    the compiled call."""
    if torch.compiler.is_compiling():
        return _traced_block(precision)
    return _switched_precision(precision)


@contextlib.contextmanager
def _traced_block(precision: str):
    global _traced_block_precision
    outer = _traced_block_precision
    _traced_block_precision = precision
    try:
        yield
    finally:
        _traced_block_precision = outer


@contextlib.contextmanager
def _switched_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def products_precision(precision: str):
    """The block's fp32 products as the ops compute a Newton–Schulz ``precision``: TF32 for "high",
    fp32 otherwise ("medium" runs bf16 operands, whatever this setting says)."""
    return fp32_matmul_precision("high" if precision == "high" else "highest")
