"""``torch.optim.Muon`` by one import: ``from megatron_eopt.torch_optim import Muon``.

The class is :class:`megatron_eopt.compat.torch_optim.Muon`: torch's constructor, defaults,
param-group keys, state layout, ``step(closure)``, errors and checkpoints, on the fused step.
"""

from .compat.torch_optim import Muon

__all__ = ["Muon"]
