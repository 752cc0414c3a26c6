"""megatron-eopt: fused C++/CUDA kernels and optimizers for the Muon family.

Ops live in ``torch.ops.megatron_eopt``; this package adds typed wrappers, the coefficient
tables, and the optimizer classes built on them.
"""

from ._library import LIBRARY_PATH, cuda_kernels_built
from .newton_schulz import (
    COEFFICIENT_SETS,
    get_coefficients,
    get_muon_scale_factor,
    get_supported_coefficient_types,
    validate_coefficient_type,
)
from .ops import foreach_momentum_, foreach_update_, newton_schulz, newton_schulz_list

__version__ = "0.1.0"

__all__ = [
    "COEFFICIENT_SETS",
    "LIBRARY_PATH",
    "cuda_kernels_built",
    "foreach_momentum_",
    "foreach_update_",
    "get_coefficients",
    "get_muon_scale_factor",
    "get_supported_coefficient_types",
    "newton_schulz",
    "newton_schulz_list",
    "validate_coefficient_type",
]
