"""Optimizers of the Muon family built on the fused ops of ``megatron_eopt``.

The classes live here; the fused step they share in :mod:`.step`, the work across ranks (DTensor
shards, tensor parallelism, rank agreement) in :mod:`.multirank`, and which matrices a parameter
holds (``nd_mode``, ``matrix_layout``, ``split_shapes``) in :mod:`.matrix_view`.
"""

from .adaptive_muon import AdaptiveMuon
from .hybrid import HybridMuon
from .mop import MOP
from .muon import Muon
from .muon_hyperball import MuonHyperball
from .muon_ht import TensorParallelMuonHT
from .muown import Muown
from .orthogonalized import OrthogonalizedOptimizer
from .polargrad import PolarGrad
from .scion import Scion
from .spel import Spel
from .step.state_dtype import dequantize_state_dict, state_bytes
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
    "TensorParallelMuonHT",
    "dequantize_state_dict",
    "state_bytes",
]
