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
from .ops import newton_schulz, newton_schulz_list
from . import registry
from .param_routing import RoutingTable, build_optimizers
from .schedulers import build_schedulers

__version__ = "0.1.0"

__all__ = [
    "COEFFICIENT_SETS",
    "LIBRARY_PATH",
    "RoutingTable",
    "build_optimizers",
    "build_schedulers",
    "cuda_kernels_built",
    "get_coefficients",
    "get_muon_scale_factor",
    "get_supported_coefficient_types",
    "newton_schulz",
    "newton_schulz_list",
    "registry",
    "validate_coefficient_type",
]
