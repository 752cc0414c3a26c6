"""FLOPs each implementation performs per call, by the Newton–Schulz algorithm it runs.

megatron-eopt's "auto" picks the standard or the Gram iteration per matrix shape and device; the
choice and its restarts come from the library itself (megatron_eopt._library.ns_plan), so the
count follows what ran. Symmetric products are counted in full (the CPU computes some of them as
blocks above the diagonal: fewer FLOPs executed than counted).
"""

from __future__ import annotations

import functools

import hyper
import peers


@functools.lru_cache(maxsize=None)
def ours_matrix_flops(m: int, n: int, device_type: str, algorithm: str = "auto") -> float:
    from megatron_eopt._library import ns_plan
    from megatron_eopt.newton_schulz import coefficient_table

    table, repeat_last = coefficient_table(hyper.COEFFICIENT_TYPE)
    flat = tuple(float(v) for row in table for v in row)
    use_gram, restarts = ns_plan(flat, hyper.NS_STEPS, repeat_last, m, n, m > n, hyper.PRECISION, algorithm,
                                 device_type)
    return hyper.gram_ns_flops(m, n, restarts) if use_gram else hyper.ns_flops(m, n)


def ours_flops(shapes, device_type: str) -> float:
    return sum(ours_matrix_flops(m, n, device_type) for m, n in shapes)


def gram_peer_flops(shapes) -> float:
    """gram-newton-schulz: the Gram iteration with its restarts for rectangular matrices, the
    standard one for square ones (as its GramNewtonSchulz chooses)."""
    restarts = [k in peers.GRAM_NS_RESTARTS for k in range(hyper.NS_STEPS)]
    return sum(hyper.gram_ns_flops(m, n, restarts) if m != n else hyper.ns_flops(m, n) for m, n in shapes)
