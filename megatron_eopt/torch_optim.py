"""``torch.optim.Muon`` by one import: ``from megatron_eopt.torch_optim import Muon``.

The class is :class:`megatron_eopt.compat.torch_optim.Muon`: torch's constructor, defaults,
param-group keys, state layout, ``step(closure)``, errors and checkpoints, on the fused step, plus
the opt-in group keys ``nd_mode``, ``algorithm`` and ``split_heads``.
:func:`muon_param_groups` splits a model's parameters into Muon's and AdamW's (with the rules of
:func:`megatron_eopt.build_optimizers`), for this class or torch's own.
"""

from .compat.torch_optim import Muon
from .param_routing import muon_param_groups

__all__ = ["Muon", "muon_param_groups"]
