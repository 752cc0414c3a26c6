"""One module per legacy lineage, each a thin layer over the fused optimizers and ops.

- :mod:`.snippet` — Keller Jordan's Muon snippet and nanochat's ``muon.py`` up to January 2026;
- :mod:`.motif` — Motif's parallel Muon (hybrid Muon + AdamW, CPU offload, its routing and
  checkpoint layout), with :mod:`.motif_qk_clip` for Motif's QK-clip rule;
- :mod:`.aux_adam` — Keller Jordan's ``MuonWithAuxAdam``;
- :mod:`.nanochat` — nanochat's ``Muon`` / ``DistMuon`` of 22a71aa and its ``MuonAdamW`` (since 2026);
- :mod:`.torch_optim` — ``torch.optim.Muon`` (PyTorch >= 2.9).

``megatron_eopt.muon`` re-exports the first three and Megatron-LM's older ``muon.py`` factory
(:mod:`megatron_eopt.integrations.megatron_legacy`), ``megatron_eopt.nanochat`` and
``megatron_eopt.torch_optim`` one each (the one-import drop-ins).
"""
