"""Optimizers of the Muon family built on the fused ops of ``megatron_eopt``."""

from ._low_memory import dequantize_state_dict, state_bytes
from .adaptive_muon import AdaptiveMuon
from .hybrid import HybridMuon
from .mop import MOP
from .muon import Muon
from .muon_hyperball import MuonHyperball
from .muown import Muown
from .orthogonalized import OrthogonalizedOptimizer
from .polargrad import PolarGrad
from .scion import Scion
from .spel import Spel
from .tensor_parallel import TensorParallelAdaptiveMuon, TensorParallelMuon
from .weight_update_hooks import HyperballHook, NoOpWeightUpdateHook, RadialBrakeHook, RelativeUpdateHook

__all__ = [
    "AdaptiveMuon",
    "HybridMuon",
    "HyperballHook",
    "MOP",
    "Muon",
    "MuonHyperball",
    "Muown",
    "NoOpWeightUpdateHook",
    "OrthogonalizedOptimizer",
    "PolarGrad",
    "RadialBrakeHook",
    "RelativeUpdateHook",
    "Scion",
    "Spel",
    "TensorParallelAdaptiveMuon",
    "TensorParallelMuon",
    "dequantize_state_dict",
    "state_bytes",
]
