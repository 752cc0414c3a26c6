"""One rank of the distributed Gram test (spawned by test_distributed_gram.py, gloo on CPU).

tp_mode "distributed" runs Newton–Schulz in plain PyTorch around its all-reduces; where the
fused op takes the Gram iteration for the global matrix it does too, and the shards it returns
must equal the fused op's result on the unsharded matrices.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import megatron_eopt as me  # noqa: E402
from megatron_eopt.optim._config import make_config  # noqa: E402
from megatron_eopt.optim.multirank.tp_modes import _gram_restarts, distributed_newton_schulz  # noqa: E402
from megatron_eopt.optim.multirank.tp_modes import TPLayout  # noqa: E402
from reference import TOLERANCE, rel_err  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402


def _config(precision, algorithm):
    return make_config(nesterov=True, weight_decay_method="decoupled", fp32_matmul_prec=precision,
                       coefficient_type="quintic", custom_coefficient_sets=None, num_ns_steps=5,
                       scale_mode="spectral", extra_scale_factor=1.0, ns_algorithm=algorithm)


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        gen = torch.Generator().manual_seed(seed)
        # (global batch shape, partition_dim, algorithm): columns sharded of a wide matrix (the
        # Gram side unsharded), rows sharded of a tall one (iterated transposed), and "auto" on a
        # shape where the CPU rule takes the Gram iteration (in fp32: in "medium" the standard
        # iteration's bf16 GEMMs win there).
        cases = [((2, 24, 96), 1, "gram"), ((2, 96, 24), 0, "gram"), ((1, 128, 512), 1, "auto")]
        for shape, partition_dim, algorithm in cases:
            for precision in ("highest",) if algorithm == "auto" else ("highest", "medium"):
                full = torch.randn(shape, generator=gen)
                dim = 1 + partition_dim
                local = full.chunk(world_size, dim=dim)[rank].contiguous()
                tp = TPLayout(dist.group.WORLD, world_size, rank, partition_dim, "distributed")
                config = _config(precision, algorithm)
                transpose = partition_dim == 0
                m, n = shape[1], shape[2]
                assert _gram_restarts(config, m, n, transpose, "cpu") is not None, (shape, algorithm)
                out = distributed_newton_schulz(local, tp, config, 1e-7)
                expected = me.newton_schulz(full, precision=precision, transpose=transpose, algorithm=algorithm)
                expected = expected.chunk(world_size, dim=dim)[rank]
                # Same rounding points, different summation order of the sharded products.
                tol = 1e-5 if precision == "highest" else TOLERANCE["medium"] / 4
                err = rel_err(out, expected)
                assert err <= tol, f"rank {rank} {shape} pd {partition_dim} {precision} {algorithm}: {err:.2e}"
        # "standard" keeps the per-iteration all-reduce path.
        assert _gram_restarts(_config("highest", "standard"), 128, 512, False, "cpu") is None
        # The public op in Emerging-Optimizers' positional order with tp_group: a wide matrix with
        # its columns sharded, and a tall one with its rows sharded (iterated transposed, the
        # default for the tall local shard); 2-D and batched inputs.
        for shape, dim in (((24, 96), 1), ((96, 24), 0), ((3, 20, 64), 2)):
            full = torch.randn(shape, generator=gen)
            local = full.chunk(world_size, dim=dim)[rank].contiguous()
            transpose = dim == full.ndim - 2
            out = me.newton_schulz(local, 5, "quintic", None, 1e-7, transpose, dist.group.WORLD, False,
                                   precision="highest")
            expected = me.newton_schulz(full, 5, "quintic", None, 1e-7, transpose, precision="highest")
            err = rel_err(out, expected.chunk(world_size, dim=dim)[rank])
            assert out.shape == local.shape and err <= 1e-5, f"rank {rank} tp_group {shape}: {err:.2e}"
