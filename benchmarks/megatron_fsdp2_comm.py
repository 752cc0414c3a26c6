#!/usr/bin/env python3
"""Communication of one optimizer step under megatron-core's FSDP2 wrapper: ours against Megatron's own Muon.

    python benchmarks/megatron_fsdp2_comm.py [--ranks 2 4] [--steps 3] [--optimizer muon] [--no-split-qkv]
                                             [--out FILE.json]

A GPT (tests/python/support/megatron_cpu.build_gpt: 2 layers, hidden 64, GQA; 9 Muon matrices) in
megatron-core's ``TorchFullyShardedDataParallel`` (every parameter a ``Shard(0)`` DTensor over all
ranks), its optimizer from ``get_megatron_optimizer(OptimizerConfig(optimizer=...))``: once with
megatron-eopt's ``install()`` ("ours"), once without ("stock": Megatron's own TensorParallelMuon,
built on Emerging-Optimizers), same seed and batches, N gloo processes on the CPU.

Every collective the optimizer step (``optimizer.step()``, nothing of forward / backward) issues is
recorded by a torch dispatch mode that sees both the c10d ops (``dist.all_reduce``, ...) and
DTensor's functional collectives (``full_tensor``, redistributions): its kind, the bytes this rank
puts in (the input tensor), and an estimate of the bytes this rank sends on the wire with ring
algorithms (all-gather: (P-1) x input; reduce-scatter: (P-1)/P x input; all-reduce: 2(P-1)/P x
input; all-to-all: the input less the piece kept; broadcast: the input). Each collective is
attributed to the member of Megatron's ChainedOptimizer that issued it (the Muon member, Adam), or to
the chain itself (its gradient norm). Reported per step and rank (the steps after the first; the
first is shown when it differs), averaged over ranks, with the most any rank sent.

"Muon matrices" in the table: the fp32 bytes of the full Muon matrices (the owner mode's bound: each
matrix travels at most once to its owner and once back, so the bytes all ranks send together per
step are at most twice that). The final parameters of ours and stock are compared too (same
numerics up to fp32 rounding: a sanity check that both measured the same training).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
TESTS = os.path.join(REPO_ROOT, "tests", "python", "support")  # megatron_cpu: megatron-core's GPT and wrappers on CPUs
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

if not hasattr(typing, "override"):  # Megatron / Emerging-Optimizers import it (Python >= 3.12)
    import typing_extensions

    typing.override = typing_extensions.override

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SEED = 1234
IMPLS = ("ours", "stock")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "other")


def _collective_ops():
    """{op overload packet: (kind, index of its input argument)} for c10d and functional collectives."""
    c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
    table = {
        c10d._allgather_base_: ("all_gather", 1),
        c10d.allgather_: ("all_gather", 1),
        c10d.allgather_coalesced_: ("all_gather", 1),
        c10d.allgather_into_tensor_coalesced_: ("all_gather", 1),
        c10d._reduce_scatter_base_: ("reduce_scatter", 1),
        c10d.reduce_scatter_: ("reduce_scatter", 1),
        c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1),
        c10d.allreduce_: ("all_reduce", 0),
        c10d.allreduce_coalesced_: ("all_reduce", 0),
        c10d.alltoall_base_: ("all_to_all", 1),
        c10d.alltoall_: ("all_to_all", 1),
        c10d.broadcast_: ("broadcast", 0),
        c10d.gather_: ("other", 1),
        c10d.scatter_: ("other", 1),
        c10d.reduce_: ("other", 0),
        funcol.all_gather_into_tensor: ("all_gather", 0),
        funcol.all_gather_into_tensor_coalesced: ("all_gather", 0),
        funcol.reduce_scatter_tensor: ("reduce_scatter", 0),
        funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", 0),
        funcol.all_reduce: ("all_reduce", 0),
        funcol.all_reduce_coalesced: ("all_reduce", 0),
        funcol.all_to_all_single: ("all_to_all", 0),
        funcol.broadcast: ("broadcast", 0),
    }
    autograd = getattr(torch.ops, "_c10d_functional_autograd", None)
    if autograd is not None and hasattr(autograd, "all_to_all_single"):
        table[autograd.all_to_all_single] = ("all_to_all", 0)
    return table


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_size(args) -> int:
    """The size of the collective's group: a ProcessGroup argument (c10d ops) or a group name (funcol)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a.size()
    for a in args:
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()
            except (KeyError, RuntimeError, ValueError):
                pass
    return dist.get_world_size()


def _kept(kind, args, size, nbytes) -> float:
    """Bytes of an all-to-all input this rank keeps (its own piece): the input split at its group rank."""
    splits = [a for a in args if isinstance(a, (list, tuple)) and all(isinstance(s, int) for s in a) and a]
    element = nbytes / max(1, sum(t.numel() for t in _tensors(args[1 if kind == "all_to_all" else 0])))
    if len(splits) == 2 and len(splits[-1]) == size:
        pg = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        me = dist.get_rank(pg) if pg is not None else dist.get_rank()
        return splits[-1][me] * element if 0 <= me < size else 0.0
    return nbytes / size


class CollectiveLog(TorchDispatchMode):
    """Records every collective issued inside it: (phase, kind, input bytes, estimated bytes sent).

    DTensor ops are left to DTensor first (NotImplemented), so the collectives they turn into are
    seen; ``phase`` names who issues them (set by the caller)."""

    def __init__(self):
        super().__init__()
        self.ops = _collective_ops()
        self.calls = []
        self.phase = "chain"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if packet in self.ops:
            kind, index = self.ops[packet]
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(args[index]))
            size = _group_size(args)
            if kind == "all_gather":
                sent = (size - 1) * nbytes
            elif kind == "reduce_scatter":
                sent = (size - 1) / size * nbytes
            elif kind == "all_reduce":
                sent = 2 * (size - 1) / size * nbytes
            elif kind == "all_to_all":
                sent = nbytes - _kept(kind, args, size, nbytes)
            else:
                sent = nbytes
            self.calls.append((self.phase, kind, nbytes, sent))
        return out


def _label(optimizer) -> str:
    name = type(optimizer).__name__
    return "muon" if "Muon" in name else ("adam" if "Adam" in name else name)


def _attribute_phases(log, chained):
    """Makes each chained member's torch optimizer set log.phase while it steps."""
    for member in chained.chained_optimizers:
        inner = member.optimizer
        step = inner.step

        def stepping(*args, _step=step, _label=_label(inner), **kwargs):
            saved, log.phase = log.phase, _label
            try:
                return _step(*args, **kwargs)
            finally:
                log.phase = saved

        inner.step = stepping


def _summarize(calls):
    """{phase: {kind: [count, input bytes, sent bytes]}} of one step's calls, with phase "total"."""
    out = {}
    for phase, kind, nbytes, sent in calls:
        for p in (phase, "total"):
            row = out.setdefault(p, {}).setdefault(kind, [0, 0, 0.0])
            row[0] += 1
            row[1] += nbytes
            row[2] += sent
    return out


def _run_impl(impl, name, steps, rank, world, split_qkv):
    """Builds and trains one implementation; returns per-step summaries, Muon matrix bytes and params."""
    import megatron.core.optimizer as mcore_optimizer

    import megatron_cpu
    from megatron_eopt.integrations import megatron as integration

    integration.install() if impl == "ours" else integration.uninstall()
    wrapped = megatron_cpu.wrap_in_torch_fsdp2(megatron_cpu.build_gpt(SEED))
    config = mcore_optimizer.OptimizerConfig(
        optimizer=name,
        lr=0.02,
        min_lr=0.0,
        weight_decay=0.1,
        clip_grad=0.0,
        bf16=False,
        fp16=False,
        muon_fp32_matmul_prec="highest",
        muon_split_qkv=split_qkv,
    )
    with megatron_cpu.megatron_optimizer_on_cpu():
        optimizer = mcore_optimizer.get_megatron_optimizer(config, [wrapped])
    muon = [m.optimizer for m in optimizer.chained_optimizers if _label(m.optimizer) == "muon"]
    assert len(muon) == 1, [type(m.optimizer).__name__ for m in optimizer.chained_optimizers]
    ours = type(muon[0]).__module__.startswith("megatron_eopt")
    assert ours == (impl == "ours"), (impl, type(muon[0]))
    matrices = [p for group in muon[0].param_groups for p in group["params"]]
    matrix_bytes = sum(p.numel() * 4 for p in matrices)
    log = CollectiveLog()
    _attribute_phases(log, optimizer)
    per_step = []
    for step in range(steps):
        with megatron_cpu.megatron_optimizer_on_cpu():
            wrapped.zero_grad_buffer()
            optimizer.zero_grad()
            (tokens, position_ids, mask), labels = _batch(SEED * 100 + step * world + rank)
            wrapped(tokens, position_ids, mask, labels=labels).float().mean().backward()
            wrapped.finish_grad_sync()
            log.calls = []
            with log:
                assert optimizer.step()[0]
        per_step.append(_summarize(log.calls))
    owner_bytes = getattr(getattr(muon[0], "_sharded", None), "bytes_sent", None)
    params = {n: p.full_tensor() for n, p in wrapped.module.named_parameters()}
    muon_ids = {id(p) for p in matrices}
    muon_names = [n for n, p in wrapped.module.named_parameters() if id(p) in muon_ids]
    return {
        "steps": per_step,
        "muon_matrices": len(matrices),
        "muon_matrix_bytes": matrix_bytes,
        "owner_bytes_sent": owner_bytes,
        "muon_names": muon_names,
        "class": f"{type(muon[0]).__module__}.{type(muon[0]).__name__}",
    }, params


def _batch(seed):
    import megatron_cpu

    g = torch.Generator().manual_seed(seed)
    shape = (megatron_cpu.BATCH, megatron_cpu.SEQ)
    tokens = torch.randint(0, megatron_cpu.VOCAB, shape, generator=g)
    labels = torch.randint(0, megatron_cpu.VOCAB, shape, generator=g)
    position_ids = torch.arange(megatron_cpu.SEQ).unsqueeze(0).expand(*shape)
    mask = torch.triu(torch.ones(megatron_cpu.SEQ, megatron_cpu.SEQ, dtype=torch.bool), diagonal=1)
    return (tokens, position_ids, mask.view(1, 1, megatron_cpu.SEQ, megatron_cpu.SEQ)), labels


def _worker(rank, world, init_file, out, name, steps, split_qkv):
    import warnings

    import megatron_cpu
    from worker_exit import exit_without_teardown

    warnings.filterwarnings("ignore")
    with megatron_cpu.megatron_world(rank, world, init_file):
        torch.manual_seed(SEED)
        results, params = {}, {}
        for impl in IMPLS:
            try:
                results[impl], params[impl] = _run_impl(impl, name, steps, rank, world, split_qkv)
            except Exception as exc:  # noqa: BLE001 - reported in the table (every rank fails alike)
                results[impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if len(params) < len(IMPLS):
            if rank == 0:
                with open(out, "w") as f:
                    json.dump({"ranks": gathered, "ours_vs_stock": None}, f)
            exit_without_teardown()
        init = {n: p for n, p in megatron_cpu.build_gpt(SEED).named_parameters()}
        diff = {
            n: float((params["ours"][n] - params["stock"][n]).norm() / (params["stock"][n] - init[n]).norm())
            for n in init
        }
        muon_names = set(results["ours"].pop("muon_names"))
        results["stock"].pop("muon_names")
        worst = {
            "muon": max(d for n, d in diff.items() if n in muon_names),
            "other": max(d for n, d in diff.items() if n not in muon_names),
        }
        worst["other_param"] = max((d, n) for n, d in diff.items() if n not in muon_names)[1]
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"ranks": gathered, "ours_vs_stock": worst}, f)
    exit_without_teardown()


def run(world, name, steps, split_qkv):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker, args=(world, os.path.join(tmp, "rendezvous"), out, name, steps, split_qkv), nprocs=world, join=True
        )
        with open(out) as f:
            raw = json.load(f)
    return _aggregate(world, raw, steps)


def _aggregate(world, raw, steps):
    """Per implementation: the per-rank mean (and the most a rank sent) per step of steps 2..N."""
    report = {"ranks": world, "ours_vs_stock_max_rel_diff": raw["ours_vs_stock"], "impls": {}}
    for impl in IMPLS:
        ranks = [r[impl] for r in raw["ranks"]]
        if any("error" in r for r in ranks):
            report["impls"][impl] = {"error": next(r["error"] for r in ranks if "error" in r)}
            continue
        later = list(range(1, steps)) or [0]

        def mean_of(step_ids, phase):
            rows = {}
            for kind in KINDS:
                per_rank = [[r["steps"][s].get(phase, {}).get(kind, [0, 0, 0.0]) for s in step_ids] for r in ranks]
                count = sum(x[0] for rank in per_rank for x in rank) / (len(ranks) * len(step_ids))
                if count:
                    rows[kind] = {
                        "count": count,
                        "input_bytes": sum(x[1] for rank in per_rank for x in rank) / (len(ranks) * len(step_ids)),
                        "sent_bytes": sum(x[2] for rank in per_rank for x in rank) / (len(ranks) * len(step_ids)),
                        "max_rank_sent_bytes": max(sum(x[2] for x in rank) / len(step_ids) for rank in per_rank),
                    }
            return rows

        phases = sorted({p for r in ranks for s in r["steps"] for p in s})
        entry = {
            "class": ranks[0]["class"],
            "muon_matrices": ranks[0]["muon_matrices"],
            "muon_matrix_bytes": ranks[0]["muon_matrix_bytes"],
            "per_step": {phase: mean_of(later, phase) for phase in phases},
        }
        first = {phase: mean_of([0], phase) for phase in phases}
        if first != entry["per_step"]:
            entry["first_step"] = first
        if ranks[0]["owner_bytes_sent"] is not None:
            entry["owner_bytes_sent_per_step"] = sum(r["owner_bytes_sent"] for r in ranks) / (len(ranks) * steps)
        report["impls"][impl] = entry
    return report


def _kib(x):
    return f"{x / 1024:.1f}"


def table(reports) -> str:
    lines = [
        "| ranks | impl | phase | all-gather | all-reduce | reduce-scatter | all-to-all | other | collectives "
        "| KiB in / rank | KiB sent / rank (max) | sent, all ranks / Muon matrices |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rep in reports:
        for impl, entry in rep["impls"].items():
            if "error" in entry:
                lines.append(f"| {rep['ranks']} | {impl} | failed: {entry['error'][:100]} |" + " |" * 9)
                continue
            for phase in ("muon", "adam", "chain", "total"):
                rows = entry["per_step"].get(phase)
                if not rows:
                    continue

                def count(kind, rows=rows):
                    return f"{rows[kind]['count']:g}" if kind in rows else "0"

                total = sum(r["count"] for r in rows.values())
                other = sum(rows[k]["count"] for k in ("broadcast", "other") if k in rows)
                inb = sum(r["input_bytes"] for r in rows.values())
                sent = sum(r["sent_bytes"] for r in rows.values())
                most = sum(r["max_rank_sent_bytes"] for r in rows.values())
                ratio = sent * rep["ranks"] / entry["muon_matrix_bytes"]
                lines.append(
                    f"| {rep['ranks']} | {impl} | {phase} | {count('all_gather')} | {count('all_reduce')} "
                    f"| {count('reduce_scatter')} | {count('all_to_all')} | {other:g} | {total:g} | {_kib(inb)} "
                    f"| {_kib(sent)} ({_kib(most)}) | {ratio:.2f} |"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", default="muon", help="Megatron's optimizer name (muon)")
    parser.add_argument(
        "--split-qkv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="muon_split_qkv (Megatron's default: on)",
    )
    parser.add_argument("--out", metavar="FILE.json")
    args = parser.parse_args(argv)
    if args.steps < 1 or any(r < 1 for r in args.ranks):
        parser.error("--steps and --ranks must be at least 1")
    reports = [run(world, args.optimizer, args.steps, args.split_qkv) for world in args.ranks]
    print(
        f"Collectives per optimizer step ({args.optimizer}, muon_split_qkv={args.split_qkv}, FSDP2 Shard(0), "
        f"gloo; steps 2..{args.steps}, mean over ranks)"
    )
    print(table(reports))
    for rep in reports:
        for impl, entry in rep["impls"].items():
            if "error" in entry:
                print(f"{rep['ranks']} ranks {impl}: failed: {entry['error']}")
                continue
            extra = ""
            if "owner_bytes_sent_per_step" in entry:
                extra = f"; owner exchange counted by the optimizer: {_kib(entry['owner_bytes_sent_per_step'])} KiB"
            print(
                f"{rep['ranks']} ranks {impl} ({entry['class']}): {entry['muon_matrices']} Muon matrices, "
                f"{_kib(entry['muon_matrix_bytes'])} KiB fp32{extra}"
                + ("; first step differs: " + json.dumps(entry["first_step"]) if "first_step" in entry else "")
            )
        worst = rep["ours_vs_stock_max_rel_diff"]
        if worst is None:
            continue
        print(
            f"{rep['ranks']} ranks: ours vs stock after {args.steps} steps, largest difference of a parameter, in "
            f"norms of its update: Muon matrices {worst['muon']:.1e}; the others (Adam) {worst['other']:.1e} "
            f"({worst['other_param']}: Adam's step normalizes the rounding noise of near-zero gradients)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"optimizer": args.optimizer, "steps": args.steps, "split_qkv": args.split_qkv, "results": reports},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
