"""The orthogonalized optimizers' work across ranks.

DTensor parameters (FSDP2, HSDP, tensor-parallel meshes): ``dtensor_layout`` (where each rank's
shard of a matrix lies, and the placements of its statistics), ``owner_exchange`` (one owner rank
per matrix, balanced by FLOPs, the pieces moved by pipelined all-to-alls), ``sharded`` (the
orthogonalizer: owner mode over the owner exchange, gather mode over DTensor's all-gather) and
``sharded_statistics`` (NorMuon's and NAMO's statistics reduced over shards). ``tp_modes``:
Megatron's tensor-parallel modes ("duplicated": shards gathered; "distributed": Newton–Schulz on
the shards). ``agreement``: every rank of a mesh builds the same plan or raises the same error. ``cost_model``
(on the device profiles of ``hardware``): what Newton–Schulz and collectives cost, the one model by
which ``replica_work`` ("auto"), tp_mode "auto" and the planner decide. The fused step
(:mod:`megatron_eopt.optim.step`) calls these; they import nothing of it.
"""
