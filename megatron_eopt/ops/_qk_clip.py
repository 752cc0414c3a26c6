"""QK-clip: the row-block scaling of attention weights, its wrapper and fake kernel."""

from __future__ import annotations

from typing import Sequence

import torch

from .._errors import call_op
from ._checks import _fake_list_dtype, _ops, _tensor_list
from ._constants import _PARAM_FLOATS


def qk_clip_(weights: Sequence[torch.Tensor], factors: Sequence[torch.Tensor], block_rows: Sequence[int]) -> None:
    """Scales row blocks of attention weights in place, every weight in one pass (QK-clip).

    ``weights[i]`` (``(rows, cols)``, float32 / bfloat16 / float16, rows contiguous; one dtype and one
    device for all) is cut into blocks of ``block_rows[i]`` rows (one attention head each); block
    ``b`` is multiplied by ``factors[i][b]`` (a float32 vector of ``rows // block_rows[i]`` values on
    the weight's device), in fp32 and stored in the weight's dtype. See ``megatron_eopt.optim.qk_clip``
    for the factors.
    """
    weights = _tensor_list("weights", weights)
    factors = _tensor_list("factors", factors)
    if isinstance(block_rows, (int, torch.Tensor)) or not isinstance(block_rows, Sequence):
        raise TypeError(f"block_rows must be a list of ints, got {type(block_rows).__name__}")
    rows = []
    for i, b in enumerate(block_rows):
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"block_rows[{i}] must be an int, got {type(b).__name__}")
        rows.append(b)
    if weights or factors or rows:
        call_op(_ops.qk_clip_, weights, factors, rows)


@torch.library.register_fake("megatron_eopt::qk_clip_")
def _qk_clip_fake(weights, factors, block_rows):
    op = "qk_clip_"
    torch._check_value(len(factors) == len(weights) and len(block_rows) == len(weights),
                       lambda: f"{op}: weights, factors and block_rows differ in length")
    _fake_list_dtype(op, "weights", weights, _PARAM_FLOATS)
    for i, (w, f, b) in enumerate(zip(weights, factors, block_rows)):
        torch._check_value(w.dim() == 2, lambda: f"{op}: weights[{i}] must be 2-D")
        torch._check_value(b >= 1 and w.shape[0] % b == 0, lambda: f"{op}: block_rows[{i}] must divide the rows")
        torch._check_type(f.dtype == torch.float32, lambda: f"{op}: factors[{i}] must be float32")
        torch._check_value(f.dim() == 1 and f.shape[0] == w.shape[0] // b,
                           lambda: f"{op}: factors[{i}] must have one value per block of rows")
    return None
