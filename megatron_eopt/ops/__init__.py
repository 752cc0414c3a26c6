"""Typed Python wrappers over ``torch.ops.megatron_eopt`` and the fake kernel of every op.

The wrappers validate arguments with Python exceptions (TypeError / ValueError naming the
argument) before anything runs; the ops check again in C++ for direct callers (whose errors the
wrappers re-raise with the same Python types, see :mod:`megatron_eopt._errors`).

One module per op family, each with its wrappers, checks and fake kernels; a module imports only
from the ones listed above it:

* ``_constants``: the names and dtypes the ops accept (weight-decay methods, state dtypes, block sizes);
* ``_checks``: argument checks shared by the families (loads the op library);
* ``_distributed``: the distributed Newton–Schulz iteration over a tensor-parallel group;
* ``_newton_schulz``: Newton–Schulz of matrices, lists and split (QKV) projections, and the
  tensor-parallel entry;
* ``_foreach``: momentum and update over lists of tensors;
* ``_second_moment``: the AdaMuon / NorMuon / NAMO normalizations;
* ``_quantized_state``: the low-memory state formats and their ops (:mod:`megatron_eopt.low_memory_state`);
* ``_qk_clip``: QK-clip.
"""

# ruff: noqa: F401  (a module of re-exports)

from __future__ import annotations

from ._constants import WEIGHT_DECAY_METHODS
from ._checks import ScalarArg
from ._newton_schulz import newton_schulz, newton_schulz_list, newton_schulz_split, newton_schulz_tp
from ._foreach import foreach_momentum_, foreach_update_
from ._second_moment import adamuon_normalize_, namo_normalize_, new_moment2_buffer, normuon_normalize_
from ._quantized_state import adamuon_normalize_quantized_, foreach_momentum_quantized_
from ._qk_clip import qk_clip_

# The names this module offered beside its ops, from the modules that define them.
from .._errors import call_op
from ..coefficients import MuonScaleT, NSAlgorithmT, NSCoeffT, PrecisionT, NS_ALGORITHMS, NS_EPS
from ..coefficients import check_steps, coefficient_table, resolve_precision, validate_algorithm, validate_precision
from ..second_moment import Moment2MethodT, moment2_shape, validate_moment2_method

