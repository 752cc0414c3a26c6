"""Optimizers of the Muon family built on the fused ops of ``megatron_eopt``."""

from .adaptive_muon import AdaptiveMuon
from .hybrid import HybridMuon
from .muon import Muon
from .orthogonalized import OrthogonalizedOptimizer
from .tensor_parallel import TensorParallelAdaptiveMuon, TensorParallelMuon

__all__ = [
    "AdaptiveMuon",
    "HybridMuon",
    "Muon",
    "OrthogonalizedOptimizer",
    "TensorParallelAdaptiveMuon",
    "TensorParallelMuon",
]
