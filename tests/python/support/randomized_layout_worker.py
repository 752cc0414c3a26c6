"""One rank of the randomized sharded-layout test (spawned by test_sharded_randomized.py, gloo on CPU).

Every case is drawn from ``random.Random(seed, case)``, the same on every rank: a mesh (the 4-rank
world, a 2 x 2 mesh, or one row of it: 2 ranks), parameters of awkward shapes (1 x n, n x 1, primes,
fewer rows than ranks: empty shards, MoE experts (E, m, n), 4-D batches and convolutions) with
placements drawn per mesh dim (uneven shards included), an nd_mode, a sharded mode (owner mode with
its replicas repeating or splitting the work), a workspace
budget (one chunk, "auto", or budgets that cut every few matrices), a state dtype (fp32, or the
low-memory bf16 / int8 / fp8 with blocks of 1 or 256) and an optimizer with its options. The sharded
optimizer steps twice and must equal the unsharded optimizer on the full tensors (params within
fp32 rounding, every state tensor: fp32 values likewise, low-memory codes bitwise; sharded_worker.check). A failure names the seed and the
case; ``MEGATRON_EOPT_TEST_SEED=SEED`` replays the run.
"""

from __future__ import annotations

import os
import random
import sys

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, Muon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from sharded_worker import check  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

SIDES = (1, 2, 3, 5, 7, 9, 12, 16)
OPTIMIZERS = [
    (Muon, {}),
    (AdaptiveMuon, dict(moment2_method="adamuon")),
    (AdaptiveMuon, dict(moment2_method="normuon")),
    (AdaptiveMuon, dict(moment2_method="namo")),
]
# One chunk, the default, and budgets that cut a chunk every one to a few of these small matrices.
BUDGETS = (None, "auto", 0.0002, 0.001, 0.004)


STATE_DTYPES = ("fp32", "fp32", "bf16", "int8", "fp8")


def _placement(rng: random.Random, ndim: int, dims: tuple[int, ...], whole_rows: bool):
    # whole_rows: the state keeps int8 / fp8 blocks of 256 values along the last dim, whose shards
    # of these small rows would not hold whole blocks (refused): the last dim stays unsharded
    choice = rng.choice(("replicate",) + tuple(d for d in dims if not (whole_rows and d == ndim - 1)))
    return Replicate() if choice == "replicate" else Shard(choice % ndim)


def draw_case(seed: int, case: int) -> dict:
    """The case's description (plain values, printed on failure)."""
    rng = random.Random(f"{seed}/{case}")
    mesh = rng.choice(("world", "grid", "row"))
    mesh_dims = 2 if mesh == "grid" else 1
    nd_mode = rng.choice(("error", "error", "batch", "flatten"))
    state_dtype = rng.choice(STATE_DTYPES)
    block = rng.choice((1, 256)) if state_dtype in ("int8", "fp8") else 256
    params = []
    for _ in range(rng.randint(1, 4)):
        m, n = rng.choice(SIDES), rng.choice(SIDES)
        kind = "matrix" if nd_mode == "error" else rng.choice(("matrix", "lead3", "lead4"))
        if kind == "matrix":
            shape, dims = (m, n), (0, 1)
        elif kind == "lead3":
            shape = (rng.choice((1, 2, 3, 5)), m, n)
            # "flatten" views (size(0), -1), so only dim 0 may be sharded
            dims = (0,) if nd_mode == "flatten" else (0, 1, 2)
        else:  # a 4-D batch of matrices or a convolution: sharded on dim 0 only
            shape, dims = (rng.choice((2, 3, 5)), rng.choice((1, 2, 3)), m, n), (0,)
        params.append((shape, [_placement(rng, len(shape), dims, block > 1) for _ in range(mesh_dims)]))
    cls_index = rng.randrange(len(OPTIMIZERS))
    extra = dict(OPTIMIZERS[cls_index][1])
    extra["workspace_mib"] = rng.choice(BUDGETS)
    # l2 decay reads the parameter into the momentum: with low-memory state, a last-place difference
    # of a parameter (cross-shard statistics sum in another order) could then reach the codes'
    # rounding, so there the codes are compared bitwise without it (docs/sharded.md).
    l2 = extra.get("moment2_method") != "namo" and state_dtype == "fp32"
    extra["weight_decay_method"] = rng.choice(("decoupled", "independent") + (("l2",) if l2 else ()))
    extra["state_dtype"] = state_dtype
    if state_dtype != "fp32":
        extra["state_block_size"] = block
    sharded_mode = rng.choice(("owner", "owner", "gather"))
    if sharded_mode == "owner":  # the replicas of a matrix (a Replicate mesh dim) share its owner or repeat it
        extra["replica_work"] = rng.choice(("repeat", "split"))
        # Megatron-FSDP's uneven row shards (1-D meshes, Muon and AdaMuon with fp32 state): the rows
        # of a Shard(0) matrix cut anywhere, a rank's share possibly empty
        if mesh != "grid" and state_dtype == "fp32" and extra.get("moment2_method") in (None, "adamuon"):
            ranks = 4 if mesh == "world" else 2
            for k, (shape, placements) in enumerate(params):
                if len(shape) == 2 and placements == [Shard(0)] and rng.random() < 0.8:
                    cuts = sorted(rng.randint(0, shape[0]) for _ in range(ranks - 1))
                    rows = tuple(b - a for a, b in zip([0] + cuts, cuts + [shape[0]]))
                    params[k] = (shape, placements, rows)
    return dict(mesh=mesh, params=params, cls=cls_index, extra=extra, nd_mode=nd_mode, sharded_mode=sharded_mode)


@exits_without_teardown
def worker(rank, world, init_file, seed, cases):
    with gloo_world(rank, world, init_file):
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        meshes = {"world": init_device_mesh("cpu", (world,)), "grid": grid, "row": grid["b"]}
        for case in range(cases):
            c = draw_case(seed, case)
            try:
                check(meshes[c["mesh"]], c["params"], OPTIMIZERS[c["cls"]][0], c["extra"], seed * 1000 + case,
                      nd_mode=c["nd_mode"], sharded_mode=c["sharded_mode"], label=f"case {case}")
            except Exception as exc:
                raise AssertionError(f"seed {seed} case {case} ({c}): {exc}") from exc
