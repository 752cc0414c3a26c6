"""Low-memory optimizer state: the formats, the fused ops that step them, and conversions.

``state_dtype`` of the optimizers (see the table in docs/optimizers.md):

* ``"fp32"``: today's state, in the parameter's dtype (fp32 for fp32 params); bit for bit the default.
* ``"bf16"``: momentum stored in bf16 with stochastic rounding (2 bytes per value).
* ``"int8"``: blocks of ``block_size`` (256) values along a row (the last dimension); per block an
  fp32 scale ``absmax / 127``; values ``round(x / scale)`` in [-127, 127], rounded stochastically
  (unbiased). 1 + 4/256 bytes per value.
* ``"fp8"``: the same blocks, codes in float8 e4m3 (``torch.float8_e4m3fn``) holding the square of
  the scaled magnitude: per block an fp32 scale ``absmax / sqrt(448)``, value ``sign * sqrt(code) *
  scale``, rounded stochastically (unbiased in the value) between the two neighbouring grid values.
  Plain e4m3 spaces its values up to 12.5% apart over 17 binades, more range than a block needs
  and a grid whose noise the momentum carries from step to step (it cost measurable loss on the
  demo); squared codes space them at most 6.25% apart from 1/128 of the block's max up, and reach
  down to 1/479 of it (9 binades). 1 + 4/256 bytes per value.

The second moment of AdaMuon (elementwise, ``moment2_method="adamuon"``) follows the option: bf16 for
``"bf16"``; for ``"int8"`` and ``"fp8"`` the square root ``sqrt(v)`` in linear e4m3 codes (scale
``absmax / 448``, value ``code * scale``) with block scales (v is
non-negative and spans many binades: int8's linear grid would flush a block's small values to zero,
and the update divides by them; ``sqrt(v)`` halves the range an e4m3 block must hold). NorMuon's
per-row and NAMO's per-matrix statistics stay fp32: they are a vector per matrix.

State keys: ``momentum_buffer`` (codes, shaped like the parameter) and ``momentum_buffer_scales``
(fp32, ``param.shape[:-1] + (ceil(param.shape[-1] / block_size),)``); ``moment2_buffer`` /
``moment2_buffer_scales`` likewise. Blocks never span two rows, so row shards (FSDP2's ``Shard(0)``)
carry their own blocks.

The fused ops read the state, step in fp32 registers and store the state back in the same pass;
the Newton–Schulz input (and AdaMuon's normalized update) come from the fp32 values of the step,
only what is carried to the next step is rounded. The stochastic rounding draws from a hash of
``(seed, tensor index, element index)``: CPU and CUDA store the same bits, and the optimizers
advance ``seed`` every step.
"""

# ruff: noqa: F401  (a module of re-exports)
from .ops._constants import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, STATE_DTYPES
from .ops._quantized_state import (  # _blocks, _squared_grid: the block layout, for checks of it
    _blocks,
    _squared_grid,
    adamuon_normalize_quantized_,
    dequantize,
    draw_layout,
    foreach_momentum_quantized_,
    has_scales,
    is_low_memory,
    moment2_dtype,
    momentum_dtype,
    quantize,
    scales_shape,
    validate_block_size,
    validate_state_dtype,
)
