"""The orthogonalized optimizers' work across ranks.

``sharded``: DTensor parameters (FSDP2, HSDP, tensor-parallel meshes): each matrix's layout, the
owner mode (one rank orthogonalizes each matrix, its shards exchanged by all-to-all) and the gather
mode, and statistics reduced over shards. ``tp_modes``: Megatron's tensor-parallel modes
("duplicated": shards gathered; "distributed": Newton–Schulz on the shards). ``agreement``: every
rank of a mesh builds the same plan or raises the same error. The fused step
(:mod:`megatron_eopt.optim.step`) calls these; they import nothing of it.
"""
