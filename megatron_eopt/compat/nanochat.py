"""nanochat's optimizers since January 2026 (served by ``megatron_eopt.nanochat``), on the fused
:class:`megatron_eopt.optim.AdaptiveMuon` and torch's AdamW kernels, one module per era:

- :class:`Muon`, :class:`DistMuon`: ``nanochat/muon.py`` at 22a71aa (January–July 2026), in
  ``nanochat_muon``;
- :class:`MuonAdamW`: ``nanochat/optim.py`` as of a9d0a86 (July 2026), single process and
  distributed (ZeRO-2 style sharding when a multi-rank process group is initialized), in
  ``nanochat_muon_adamw`` with :func:`compute_dtype`.

Both run their Muon groups on ``nanochat_stacked`` (nanochat's stacked per-shape state, the step
of each era's recipe, the distributed chunk exchange). Each class keeps nanochat's param groups,
group keys and state layout, so checkpoints load in both directions. nanochat up to January 2026
(``nanochat/muon.py`` at 4ddc803) is ``megatron_eopt.muon`` (``compat/snippet.py``).
"""

from .nanochat_muon import DistMuon, Muon
from .nanochat_muon_adamw import MuonAdamW, compute_dtype
from .nanochat_stacked import NANOCHAT_POLAR_EXPRESS

__all__ = ["DistMuon", "Muon", "MuonAdamW", "NANOCHAT_POLAR_EXPRESS", "compute_dtype"]
