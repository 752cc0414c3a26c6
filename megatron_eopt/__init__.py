"""megatron-eopt: fused C++/CUDA kernels and optimizers for the Muon family.

Ops live in ``torch.ops.megatron_eopt``; this package adds typed wrappers, the coefficient
tables, and the optimizer classes built on them.
"""

from ._library import (
    LIBRARY_PATH,
    cpu_bf16_products,
    cpu_product_plan,
    cpu_symmetric_products,
    cuda_kernels_built,
    cuda_symmetric_products,
    set_cpu_bf16_products,
    set_cpu_symmetric_products,
    set_cuda_symmetric_products,
)
from .coefficients import (
    COEFFICIENT_SETS,
    NS_ALGORITHMS,
    get_coefficient_iterator,
    get_coefficients,
    get_muon_scale_factor,
    get_supported_coefficient_types,
    validate_coefficient_type,
)
# The coefficients' old module name (megatron_eopt/newton_schulz.py says why they moved), imported here
# first: the function imported next then takes the package attribute `newton_schulz` over.
from . import newton_schulz
from .ops import (
    adamuon_normalize_,
    adamuon_normalize_quantized_,
    foreach_momentum_,
    foreach_momentum_quantized_,
    foreach_update_,
    namo_normalize_,
    new_moment2_buffer,
    newton_schulz,  # noqa: F811  (the function, over the alias module above)
    newton_schulz_list,
    newton_schulz_split,
    newton_schulz_tp,
    normuon_normalize_,
    qk_clip_,
)
from .second_moment import MOMENT2_METHODS, moment2_shape
from . import low_memory_state  # noqa: E402
from . import optim  # noqa: E402  (after the ops it is built on)
from .optim.step.fused import in_place_newton_schulz, set_in_place_newton_schulz
from . import registry
from .clipping import CLIP_POLICIES, GradNorms, clip_grad_norm_
from .model_views import MatrixView, model_matrix_views
from .param_routing import RoutingTable, build_optimizers, muon_param_groups, route_parameters
from .schedulers import build_schedulers

__version__ = "0.1.0"

__all__ = [
    "CLIP_POLICIES",
    "GradNorms",
    "clip_grad_norm_",
    "adamuon_normalize_quantized_",
    "foreach_momentum_quantized_",
    "COEFFICIENT_SETS",
    "LIBRARY_PATH",
    "MOMENT2_METHODS",
    "NS_ALGORITHMS",
    "MatrixView",
    "RoutingTable",
    "adamuon_normalize_",
    "build_optimizers",
    "build_schedulers",
    "cuda_kernels_built",
    "cuda_symmetric_products",
    "foreach_momentum_",
    "foreach_update_",
    "get_coefficient_iterator",
    "get_coefficients",
    "get_muon_scale_factor",
    "get_supported_coefficient_types",
    "in_place_newton_schulz",
    "model_matrix_views",
    "moment2_shape",
    "muon_param_groups",
    "namo_normalize_",
    "set_cuda_symmetric_products",
    "set_cpu_bf16_products",
    "cpu_bf16_products",
    "cpu_product_plan",
    "cpu_symmetric_products",
    "set_cpu_symmetric_products",
    "set_in_place_newton_schulz",
    "new_moment2_buffer",
    "newton_schulz",
    "newton_schulz_list",
    "newton_schulz_split",
    "newton_schulz_tp",
    "normuon_normalize_",
    "optim",
    "qk_clip_",
    "registry",
    "route_parameters",
    "validate_coefficient_type",
]
