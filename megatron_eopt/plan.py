"""What a Muon step costs on each rank of a mesh, before it runs: the planner.

    python -m megatron_eopt.plan --preset llama3-8b --mesh dp_replicate=4,dp_shard=8,tp=1 --hardware H100
    python -m megatron_eopt.plan --preset moe-64e --gpus 8 64 256 1024 --hardware B200

Given the matrices Muon orthogonalizes (:class:`Matrix`: a preset, a model's Muon parameters, or a
list), a mesh (:class:`Mesh`: ``dp_replicate`` x ``dp_shard`` x ``ep`` x ``tp``, in that order,
``tp`` innermost) and a hardware profile (:data:`HARDWARE`), :func:`estimate` predicts per rank, for
each layout: the Newton–Schulz FLOPs (max and mean over the ranks), the bytes sent and the
collectives called, and a modelled time; :func:`choose` picks the fastest.

Our layouts (DTensor parameters as FSDP2 / HSDP lays them out: dense weights ``Shard(fsdp_dim)``
over ``dp_shard``, ``Shard(tp_dim)`` over ``tp``, replicated over ``dp_replicate`` and ``ep``; MoE
experts ``(E, m, n)`` sharded on the expert dim over ``ep``):

- ``owner``: ``Muon(..., sharded_mode="owner", replica_work="repeat")``, each matrix once per replica;
- ``split``: ``replica_work="split"``, each matrix once in the mesh;
- ``gather``: ``sharded_mode="gather"``, every rank every matrix it holds a shard of.

``replica_work="auto"`` (the optimizers' default) picks between ``owner`` and ``split`` by this
time model on the optimizer's own matrices, mesh and device (``optim.multirank.replica_work``).

Their FLOPs, matrices, bytes and collectives are not estimates: the planner runs the step's own
rules (DTensor's chunking of the shards, the owner assignment, the pipelining chunks) and counts
by the conventions of :mod:`megatron_eopt.step_stats`, so its counts equal ``step_stats()`` of the
same layout (plain Muon, one workspace chunk; the suite checks it on gloo ranks). The peers are
modelled by the same rules as their algorithms are described (``megatron_layer_wise``: Megatron-LM's
layer-wise distributed optimizer, whole matrices owned by data-parallel ranks, tensor-parallel
shards gathered on every TP rank, updated parameters all-gathered over data parallelism in bf16;
``torchtitan_dist_muon``: owners within each shard group of replica 0 only, results broadcast to the
other replicas, no tensor parallelism).

Time model (stated, not measured here): the cost model of ``optim.multirank.cost_model``, the one
``replica_work="auto"`` and tp_mode "auto" decide by, on its hardware profiles
(``optim.multirank.hardware``; ``CPU`` one core per rank over gloo as the suite runs it):
Newton–Schulz at the profile's TFLOP/s, reduced for small matrices by a half-efficiency size fitted
to our H100 measurements (benchmarks/RESULTS.md); each collective costs its latency plus its bytes
over NVLink when the ranks it spans (by the mesh's strides) share a node, else over the network;
compute and communication are added (no overlap assumed). Our owner layouts are the model's owner
step (``cost_model.owner_step``) over the step's workspace chunks.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from .optim.multirank.agreement import AGREEMENT_BYTES
from .optim.multirank.cost_model import (
    COST_FIELDS, MeshShape, Placed, RankCost, add_costs, charge_collective, charge_newton_schulz, owner_step,
)
from .optim.multirank.dtensor_layout import chunk_extent
from .optim.multirank.hardware import HARDWARE, Hardware
from .optim.multirank.owner_exchange import assign_owners, ns_flops
from .optim.step.grouping import chunk_entries

NS_STEPS = 5
LAYOUTS = ("owner", "split", "gather", "megatron_layer_wise", "torchtitan_dist_muon")
OURS = ("owner", "split", "gather")


@dataclass(frozen=True)
class Matrix:
    """``count`` same-shape matrices Muon orthogonalizes. ``fsdp_dim``: the dim FSDP2 shards (0);
    ``tp_dim``: the dim tensor parallelism shards (0: column-parallel, 1: row-parallel, None: not
    sharded); ``experts`` > 0: each is an MoE expert batch ``(experts, m, n)`` sharded over ``ep``."""

    shape: tuple[int, int]
    count: int = 1
    fsdp_dim: int = 0
    tp_dim: int | None = None
    experts: int = 0


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.ep, self.tp)

    @property
    def world(self) -> int:
        return math.prod(self.dims)

    @property
    def shape(self) -> MeshShape:
        """The cost model's mesh: these dims row-major over consecutive ranks, ``tp`` innermost."""
        return MeshShape(self.dims)


REPLICATE, SHARD, EP, TP = range(4)  # mesh dims, outermost first


def llama(layers: int, d: int, ffn: int, heads: int, kv_heads: int) -> list[Matrix]:
    kv = d // heads * kv_heads
    return [Matrix((d, d), layers, tp_dim=0), Matrix((kv, d), 2 * layers, tp_dim=0), Matrix((d, d), layers, tp_dim=1),
            Matrix((ffn, d), 2 * layers, tp_dim=0), Matrix((d, ffn), layers, tp_dim=1)]


def moe(layers: int, d: int, heads: int, experts: int, expert_ffn: int) -> list[Matrix]:
    return [Matrix((d, d), 3 * layers, tp_dim=0), Matrix((d, d), layers, tp_dim=1),
            Matrix((expert_ffn, d), 2 * layers, tp_dim=0, experts=experts),
            Matrix((d, expert_ffn), layers, tp_dim=1, experts=experts)]


PRESETS = {
    "llama3-8b": ("Llama-3 8B (32 layers, d 4096, ffn 14336, GQA 32/8)", lambda: llama(32, 4096, 14336, 32, 8)),
    "llama3-70b": ("Llama-3 70B (80 layers, d 8192, ffn 28672, GQA 64/8)", lambda: llama(80, 8192, 28672, 64, 8)),
    "moe-64e": ("64-expert MoE (28 layers, d 2048, 64 routed experts of ffn 1408, as DeepSeek-MoE 16B)",
                lambda: moe(28, 2048, 16, 64, 1408)),
}


# ------------------------------------------------------------------ the counts of our layouts
RankCounts = RankCost  # a rank's step as step_stats() counts it, and its modelled seconds


def _sharding(m: Matrix, mesh: Mesh) -> dict[int, int]:
    """Mesh dim -> view dim it shards (dims of size 1 left out); the expert dim over ep is not a matrix dim."""
    out = {}
    nd = 3 if m.experts else 2
    if mesh.dp_shard > 1:
        out[SHARD] = nd - 2 + m.fsdp_dim
    if mesh.tp > 1 and m.tp_dim is not None:
        out[TP] = nd - 2 + m.tp_dim
    return out


def _local_view(m: Matrix, mesh: Mesh) -> tuple[int, ...]:
    """The view of one expert slice: the experts on one ep rank (the first, the largest)."""
    return (chunk_extent(m.experts, mesh.ep, 0)[1], *m.shape) if m.experts else tuple(m.shape)


def _cost(rank: RankCounts, nbytes: int, mesh: Mesh, dims: tuple[int, ...], hw: Hardware) -> None:
    """One collective over the mesh ``dims`` (the cost model's: latency, bytes over the link they span)."""
    charge_collective(rank, nbytes, mesh.shape.span(dims), hw)


def _compute(rank: RankCounts, view: tuple[int, ...], hw: Hardware, precision: str) -> None:
    charge_newton_schulz(rank, view, NS_STEPS, hw, precision)


def _step_chunks(entries: list[tuple[Matrix, tuple[int, ...], bool]], mesh: Mesh, workspace_mib) -> list[list[int]]:
    """The step's chunks of entries (param order) under the workspace budget, by the plan's own rule
    (``chunk_entries``): the local matrices' stacks (by shape) first, then the sharded matrices."""
    fake = []
    stacks: dict[tuple, list[int]] = {}
    sharded = []
    for i, (m, view, spans) in enumerate(entries):
        largest = list(view)
        for d, vd in _sharding(m, mesh).items():
            largest[vd] = chunk_extent(largest[vd], mesh.dims[d], 0)[1]
        fake.append(SimpleNamespace(local_shape=tuple(largest),
                                    sharding=SimpleNamespace(largest_view=tuple(largest)) if spans else None,
                                    global_shape=tuple(view[-2:])))
        if spans:
            sharded.append(i)
        else:
            stacks.setdefault(tuple(largest[-2:]), []).append(i)
    plan = SimpleNamespace(entries=fake, stacks=[SimpleNamespace(members=ms) for ms in stacks.values()],
                           sharded=sharded)
    budget = None if workspace_mib is None else workspace_mib * 2**20
    return [list(c) for c in chunk_entries(plan, budget)]


def _placed(m: Matrix, mesh: Mesh) -> Placed:
    """The cost model's view of one matrix: the mesh dims that shard its matrix dims, and those that
    replicate it (dp_replicate, ep for a dense weight, tp where it does not shard it)."""
    sharded = _sharding(m, mesh)
    replicas = tuple(d for d in (REPLICATE, EP, TP)
                     if mesh.dims[d] > 1 and d not in sharded and not (d == EP and m.experts))
    return Placed(_local_view(m, mesh), tuple(sorted(sharded.items())), replicas)


def _owner_counts(matrices: list[Matrix], mesh: Mesh, split: bool, hw: Hardware, precision: str,
                  workspace_mib=256) -> list[RankCounts]:
    """Owner mode (repeat or split), every rank of the mesh: the cost model's owner step
    (``cost_model.owner_step``) over the step's chunks."""
    entries = [(m, _local_view(m, mesh), bool(_sharding(m, mesh))) for m in matrices for _ in range(m.count)]
    placed = [_placed(m, mesh) for m in matrices for _ in range(m.count)]
    return owner_step(placed, mesh.shape, split, hw, precision, NS_STEPS, _step_chunks(entries, mesh, workspace_mib),
                      RankCounts)


def _add(into: RankCounts, other: RankCounts) -> None:
    add_costs(into, other, COST_FIELDS + ("agreements", "agreement_bytes"))


def _gather_counts(matrices: list[Matrix], mesh: Mesh, hw: Hardware, precision: str) -> list[RankCounts]:
    """Gather mode: every rank all-gathers each matrix it holds a shard of (DTensor's gather: one
    all-gather per sharding mesh dim, innermost first, an expert batch's EP dim included) and
    orthogonalizes it; the first shard's rank is the busiest."""
    rank = RankCounts()
    for m in matrices:
        sharded = _sharding(m, mesh)
        if not sharded:  # replicated matrices, experts whose matrix dims are whole: where they live
            for _ in range(m.count):
                _compute(rank, _local_view(m, mesh), hw, precision)
            continue
        view = (m.experts, *m.shape) if m.experts else tuple(m.shape)
        if m.experts and mesh.ep > 1:
            sharded[EP] = 0
        local = list(view)
        for d, vd in sharded.items():
            local[vd] = chunk_extent(local[vd], mesh.dims[d], 0)[1]
        for _ in range(m.count):
            held = math.prod(local) * 4
            for d in sorted(sharded, reverse=True):
                _cost(rank, (mesh.dims[d] - 1) * held, mesh, (d,), hw)
                held *= mesh.dims[d]
            _compute(rank, view, hw, precision)
    return [rank]


# ------------------------------------------------------------------ the peers, modelled
def _megatron_layer_wise(matrices: list[Matrix], mesh: Mesh, hw: Hardware, precision: str) -> list[RankCounts]:
    """Megatron-LM's layer-wise distributed optimizer: whole matrices owned by data-parallel ranks
    (LPT by FLOPs; dense over dp_replicate x dp_shard x ep, experts over dp_replicate x dp_shard), the
    owner's TP group all-gathers the shards and each TP rank orthogonalizes the whole matrix
    (duplicated), then the updated bf16 parameters (this TP rank's shards) are all-gathered over data
    parallelism: a ring all-gather of the flat buffer, (p - 1) / p of it sent by every rank."""
    groups = {False: mesh.dp_replicate * mesh.dp_shard * mesh.ep, True: mesh.dp_replicate * mesh.dp_shard}
    ranks = {e: [RankCounts() for _ in range(g)] for e, g in groups.items()}
    total_bytes = {e: 0 for e in groups}
    for expert in (False, True):
        items = [(_local_view(m, mesh), m) for m in matrices if bool(m.experts) == expert for _ in range(m.count)]
        if not items:
            continue
        size = groups[expert]
        _, owners = assign_owners([ns_flops(v) for v, _ in items], size, max(1, len(items)))
        for (view, m), o in zip(items, owners):
            r = ranks[expert][o]
            tp = mesh.tp if m.tp_dim is not None else 1
            shard = math.prod(view) // tp
            if tp > 1:
                _cost(r, (tp - 1) * shard * 4, mesh, (TP,), hw)
            _compute(r, view, hw, precision)
            total_bytes[expert] += shard * 2
        dims = (REPLICATE, SHARD) + (() if expert else (EP,))
        for r in ranks[expert]:
            if size > 1:
                _cost(r, (size - 1) * total_bytes[expert] // size, mesh, dims, hw)
    return _merged(ranks[False], ranks[True])


def _torchtitan_dist_muon(matrices: list[Matrix], mesh: Mesh, hw: Hardware, precision: str,
                          workspace_mib=256) -> list[RankCounts]:
    """torchtitan's DistMuon: owners within the shard group as in our owner mode, on replica 0 only;
    each updated shard is then broadcast to the other replicas. No tensor parallelism."""
    if mesh.tp > 1:
        raise ValueError("torchtitan's DistMuon does not run with tensor parallelism (tp > 1)")
    one_replica = Mesh(1, mesh.dp_shard, mesh.ep, 1)
    ranks = _owner_counts(matrices, one_replica, False, hw, precision, workspace_mib)
    if mesh.dp_replicate > 1:
        shard_bytes = sum(math.prod(_local_view(m, mesh)) * 4 // mesh.dp_shard * m.count for m in matrices)
        for r in ranks:
            _cost(r, shard_bytes, mesh, (REPLICATE,), hw)
    return ranks


def _merged(a: list[RankCounts], b: list[RankCounts]) -> list[RankCounts]:
    """Per rank, the counts of two groupings of the same ranks (dense and expert owners), paired in order."""
    out = []
    for i in range(max(len(a), len(b))):
        r = RankCounts()
        for src in (a[i % len(a)] if a else None, b[i % len(b)] if b else None):
            if src is not None:
                _add(r, src)
        out.append(r)
    return out


def _with_rank_agreement(ranks: list[RankCounts], matrices: list[Matrix], mesh: Mesh, hw: Hardware):
    """Our step's agreement between the ranks (multirank.agreement): where a matrix spans ranks, one
    all-reduce of a few integers per mesh dim of size > 1, before anything else."""
    if any(_sharding(m, mesh) for m in matrices):
        for r in ranks:
            for d, size in enumerate(mesh.dims):
                if size > 1:
                    nbytes = 2 * (size - 1) * AGREEMENT_BYTES // size
                    _cost(r, nbytes, mesh, (d,), hw)
                    r.agreements += 1
                    r.agreement_bytes += nbytes
    return ranks


_COUNTERS = {
    "owner": lambda ms, mesh, hw, p, ws: _with_rank_agreement(_owner_counts(ms, mesh, False, hw, p, ws), ms, mesh, hw),
    "split": lambda ms, mesh, hw, p, ws: _with_rank_agreement(_owner_counts(ms, mesh, True, hw, p, ws), ms, mesh, hw),
    "gather": lambda ms, mesh, hw, p, ws: _with_rank_agreement(_gather_counts(ms, mesh, hw, p), ms, mesh, hw),
    "megatron_layer_wise": lambda ms, mesh, hw, p, ws: _megatron_layer_wise(ms, mesh, hw, p),
    "torchtitan_dist_muon": lambda ms, mesh, hw, p, ws: _torchtitan_dist_muon(ms, mesh, hw, p, ws),
}


@dataclass
class Estimate:
    """One layout's step on the mesh: per-rank figures (max and mean over the ranks)."""

    layout: str
    ns_gflops_max: float
    ns_gflops_mean: float
    ns_matrices_max: int
    bytes_max: int
    collectives_max: int
    seconds: float
    ranks: list[RankCounts] = field(default_factory=list, repr=False)


def rank_counts(matrices: list[Matrix], mesh: Mesh, layout: str, hardware: str | Hardware = "H100",
                precision: str = "medium", workspace_mib: float | None = 256) -> list[RankCounts]:
    """The counts of ``layout`` per rank, in the world's rank order for our layouts (the mesh's dims
    row-major, ``tp`` innermost); ``workspace_mib`` as the optimizers take it (256: the GPU's "auto")."""
    if layout not in _COUNTERS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    for m in matrices:
        if m.experts and m.experts % mesh.ep:
            raise ValueError(f"{m}: {m.experts} experts do not divide over ep={mesh.ep}")
    return _COUNTERS[layout](list(matrices), mesh, hw, precision, workspace_mib)


def estimate(matrices: list[Matrix], mesh: Mesh, hardware: str | Hardware = "H100", precision: str = "medium",
             layouts=LAYOUTS) -> list[Estimate]:
    """Every layout that runs on the mesh (torchtitan's needs tp = 1), fastest first."""
    out = []
    for layout in layouts:
        try:
            ranks = rank_counts(matrices, mesh, layout, hardware, precision)
        except ValueError:
            if layout == "torchtitan_dist_muon":
                continue
            raise
        flops = [r.ns_flops for r in ranks]
        out.append(Estimate(layout, max(flops) / 1e9, sum(flops) / len(flops) / 1e9, max(r.ns_matrices for r in ranks),
                            max(r.bytes_sent for r in ranks), max(r.collectives for r in ranks),
                            max(r.compute_s + r.comm_s for r in ranks), ranks))
    return sorted(out, key=lambda e: e.seconds)


def choose(matrices: list[Matrix], mesh: Mesh, hardware: str | Hardware = "H100", precision: str = "medium") -> str:
    """The fastest of our layouts by the model: "owner", "split" or "gather"."""
    return estimate(matrices, mesh, hardware, precision, OURS)[0].layout


def default_mesh(preset: str, gpus: int) -> Mesh:
    """The mesh the documentation's table uses: TP 8 for 70B, EP 8 for the MoE, FSDP over 8 GPUs, the rest replicas."""
    tp = 8 if preset == "llama3-70b" else 1
    ep = 8 if preset == "moe-64e" and gpus >= 64 else 1
    shard = min(8, gpus // (tp * ep)) if gpus >= tp * ep else 1
    replicate = max(1, gpus // (tp * ep * shard))
    return Mesh(replicate, shard, ep, tp)


def table(presets, gpus, hardware: str = "H100", precision: str = "medium") -> str:
    """A markdown table of every layout per preset and GPU count."""
    lines = [f"| model | GPUs | mesh (R x S x EP x TP) | layout | NS GFLOP / rank (max / mean) | NS matrices / rank | "
             f"MiB sent / rank | collectives / rank | modelled ms ({hardware}, {precision}) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for preset in presets:
        matrices = PRESETS[preset][1]()
        for n in gpus:
            mesh = default_mesh(preset, n)
            for e in estimate(matrices, mesh, hardware, precision):
                lines.append(
                    f"| {preset} | {mesh.world} | {' x '.join(str(d) for d in mesh.dims)} | {e.layout} | "
                    f"{e.ns_gflops_max:.0f} / {e.ns_gflops_mean:.0f} | {e.ns_matrices_max} | "
                    f"{e.bytes_max / 2**20:.0f} | {e.collectives_max} | {e.seconds * 1e3:.1f} |")
    return "\n".join(lines)


def _parse_mesh(text: str) -> Mesh:
    values = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("dp_replicate", "dp_shard", "ep", "tp") or not value.strip().isdigit():
            raise SystemExit(f"--mesh: expected dp_replicate=N,dp_shard=N,ep=N,tp=N; got {part!r}")
        values[key.strip()] = int(value)
    return Mesh(**values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_eopt.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="model (repeatable; default all)")
    parser.add_argument("--mesh", help="dp_replicate=N,dp_shard=N,ep=N,tp=N (default: the table's mesh per GPU count)")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="H100")
    parser.add_argument("--precision", choices=("medium", "high", "highest"), default="medium")
    args = parser.parse_args(argv)
    presets = args.preset or list(PRESETS)
    if args.mesh:
        mesh = _parse_mesh(args.mesh)
        for preset in presets:
            print(f"{preset}: {PRESETS[preset][0]}; mesh {mesh}")
            for e in estimate(PRESETS[preset][1](), mesh, args.hardware, args.precision):
                print(f"  {e.layout:22s} NS {e.ns_gflops_max:9.0f} GFLOP/rank max ({e.ns_gflops_mean:.0f} mean)  "
                      f"{e.bytes_max / 2**20:9.1f} MiB  {e.collectives_max:5d} collectives  {e.seconds * 1e3:8.1f} ms")
            print(f"  chosen: {choose(PRESETS[preset][1](), mesh, args.hardware, args.precision)}")
        return 0
    print(table(presets, args.gpus, args.hardware, args.precision))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["HARDWARE", "LAYOUTS", "PRESETS", "Estimate", "Hardware", "Matrix", "Mesh", "RankCounts", "choose",
           "default_mesh", "estimate", "rank_counts", "table"]
