"""Names and dtypes the ops accept, defined once for the wrappers, the fake kernels and the optimizers."""

from __future__ import annotations

import torch

WEIGHT_DECAY_METHODS = ("decoupled", "independent", "l2", "palm", "cautious")

# Low-memory optimizer state (see megatron_eopt.low_memory_state): the state_dtype names and block sizes.
STATE_DTYPES = ("fp32", "bf16", "int8", "fp8")
DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 16

_FLOATS = (torch.float32, torch.bfloat16)
_PARAM_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
