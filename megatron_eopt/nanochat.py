"""nanochat's optimizers since January 2026, on megatron-eopt's fused ops: one import away.

- ``Muon``, ``DistMuon``: ``nanochat/muon.py`` at commit 22a71aa (January to July 2026: Polar
  Express with a 1.02 divisor, NorMuon-style variance reduction ``beta2``, cautious weight decay,
  state stacked per shape group);
- ``MuonAdamW``: ``nanochat/optim.py`` as of commit a9d0a86 (MuonEq, Polar Express, Muon+,
  variance reduction, cautious weight decay, AdamW; ZeRO-2 style sharding when a process group is
  initialized; compute dtype chosen by ``compute_dtype()`` as nanochat's ``COMPUTE_DTYPE``).

nanochat up to January 2026 (``nanochat/muon.py`` at 4ddc803) is ``megatron_eopt.muon``.
Checkpoints load in both directions with nanochat's own classes of the same commit.
"""

from .compat.nanochat import DistMuon, Muon, MuonAdamW, compute_dtype

__all__ = ["DistMuon", "Muon", "MuonAdamW", "compute_dtype"]
