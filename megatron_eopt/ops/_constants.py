"""Names and dtypes the ops accept, defined once for the wrappers, the fake kernels and the optimizers.

The scale modes (``SCALE_MODES``) and the second-moment methods (``MOMENT2_METHODS``) are defined
beside their rules, in :mod:`megatron_eopt.coefficients` and :mod:`megatron_eopt.second_moment`:
those plain-Python modules (no compiled code) sit below this package.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

WeightDecayT = Literal["decoupled", "independent", "l2", "palm", "cautious"]
WEIGHT_DECAY_METHODS: tuple[str, ...] = get_args(WeightDecayT)

# Low-memory optimizer state (see megatron_eopt.low_memory_state): the state_dtype names and block sizes.
STATE_DTYPES = ("fp32", "bf16", "int8", "fp8")
DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 16

_FLOATS = (torch.float32, torch.bfloat16)
_PARAM_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
