"""The fused step of the orthogonalized optimizers, one module per concern.

``grouping`` groups an optimizer's parameters once (stacks, buckets, chunks); ``layout`` places each
chunk's Newton–Schulz inputs in one flat buffer; ``fused`` holds the step's phases (momentum,
Newton–Schulz, second moment, update), ``engine`` runs them, chunk by chunk, for the plain step and
for ``overlap`` (the step overlapped with backward) alike, with each chunk's owners balanced from
the plan (``balance``); ``state`` creates, loads and saves the state, with
``state_check`` (a loaded state's checks), ``state_dtype`` (low-memory state) and ``offload`` (state
kept on the host). The classes of :mod:`megatron_eopt.optim` mix in ``fused.FusedStep`` and
``state.FusedState``. Work that spans ranks is :mod:`megatron_eopt.optim.multirank`'s.
"""
