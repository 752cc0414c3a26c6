"""One module per legacy lineage, each a thin layer over the fused optimizers and ops.

- :mod:`.snippet` — Keller Jordan's Muon snippet and nanochat's ``muon.py`` up to January 2026;
- :mod:`.motif` — Motif's parallel Muon (hybrid Muon + AdamW, CPU offload, its routing and
  checkpoint layout), with :mod:`.motif_qk_clip` for Motif's QK-clip rule;
- :mod:`.aux_adam` — Keller Jordan's ``MuonWithAuxAdam``;
- :mod:`.megatron_legacy` — Megatron-LM's older ``muon.py`` names.

``megatron_eopt.muon`` re-exports them (the one-import drop-in).
"""
