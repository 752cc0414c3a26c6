"""torch's float32 matmul precision for a block of plain-PyTorch products."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def fp32_matmul_precision(precision: str):
    """torch's float32 matmul precision set to ``precision`` for the block, restored after it
    (Emerging-Optimizers' context manager of the same name)."""
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
