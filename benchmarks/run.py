#!/usr/bin/env python3
"""Benchmarks megatron-eopt against its peers and prints one table.

    python benchmarks/run.py [--device cpu|cuda] [--quick] [--workload NAME ...] [--ranks N ...]
                             [--precision P] [--coefficients TYPE]
                             [--out FILE.json] [--results-md FILE] [--list] [--render FILE.json]

Peers, measured in the same run with the same hyper-parameters: Emerging-Optimizers 0.3.0
(`Muon`, `AdaptiveMuon`, `newton_schulz`), `torch.optim.Muon` (and its Newton–Schulz function), a
plain-PyTorch batched implementation compiled with torch.compile, gram-newton-schulz's torch
path (Newton–Schulz workloads), and for the memory-bound ops torch._foreach_* and per-tensor
loops. The Newton–Schulz schedule and precision default per device (see hyper.py: CUDA simple /
medium, CPU quintic / highest). Without --workload, a full CUDA run measures every workload,
a full CPU run those a 2-core CPU finishes (about 10 minutes), and --quick a tiny version of one
workload per code path (20-40 s on the 2-core development machine, the first run included while
torch.compile fills its cache). Workloads of ops or optimizers missing from the build are left out
and listed; exit status 1 when a measurement raised.

The ``dist_*`` workloads (workloads_dist.py) run only when named: they spawn --ranks CPU processes
(gloo) holding FSDP2-sharded DTensor parameters and compare the owner and gather modes of the
sharded step with per-rank redundant computation; their table is its own RESULTS.md section. So do
the ``tp_*`` workloads (workloads_tp.py): Megatron tensor-parallel shards, every ``tp_mode``, and
the ``overlap_*`` workloads (workloads_overlap.py): training steps with and without ``overlap_backward``
(``overlap_megatron_*``, workloads_overlap_megatron.py: under Megatron-LM's DDP through ``install()``),
and the ``agreement_*`` workloads (workloads_agreement.py): a sharded step with and without the ranks'
agreement before it (``rank_checks``). ``routing_cost`` (workloads_routing.py), also only when named
and in a table of its own, routes Llama-3 70B and DeepSeek-V3 built on the meta device: time and memory.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
# A developer build puts _C.so into the checkout: measure that one rather than an installed copy.
if glob.glob(os.path.join(REPO_ROOT, "megatron_eopt", "_C*.so")):
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

import env_info  # noqa: E402
import hyper  # noqa: E402
import report  # noqa: E402
import workloads as catalogue_module  # noqa: E402
import workloads_dist  # noqa: E402
import workloads_agreement  # noqa: E402
import workloads_overlap  # noqa: E402
import workloads_overlap_megatron  # noqa: E402
import workloads_routing  # noqa: E402
import workloads_tp  # noqa: E402
from timing import measure, plan_for  # noqa: E402

import megatron_eopt as me  # noqa: E402

SCHEMA = "megatron-eopt-benchmarks/1"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repeats: a smoke run")
    parser.add_argument("--workload", nargs="+", metavar="NAME", help="run only these (see --list)")
    parser.add_argument("--out", metavar="FILE.json", help="write every result and sample as JSON")
    parser.add_argument("--results-md", metavar="FILE", help="update this device's section of a RESULTS.md")
    parser.add_argument("--remarks", default="", help="a paragraph added under this run's table in --results-md")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's own; --quick: 1, since its tiny ops only "
                             "lose from threading, badly so on a loaded machine)")
    parser.add_argument("--precision", choices=["medium", "high", "highest"], default=None,
                        help="Newton–Schulz precision of every implementation (default: the device's, hyper.py)")
    parser.add_argument("--coefficients", default=None, metavar="TYPE",
                        help="Newton–Schulz coefficient type of every implementation (default: the device's)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], metavar="N",
                        help="process counts of the dist_* workloads (default: 2 4)")
    parser.add_argument("--symmetric-products", default=None, metavar="K[:P]",
                        help="CUDA: megatron-eopt computes symmetric products as at most K block columns of at "
                             "least P rows everywhere (default P 1024; megatron_eopt.set_cuda_symmetric_products; "
                             "without it, the measured default); the table's hyper-parameters say so")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument("--render", metavar="FILE.json",
                        help="measure nothing: print the table of a saved --out JSON and update --results-md "
                             "from it (with --remarks, replacing the saved remarks)")
    return parser.parse_args(argv)


def select(args, device: torch.device):
    """The workloads to run and, for those left out, why."""
    catalogue = catalogue_module.catalogue()
    names = {w.name: w for w in catalogue}
    if args.workload:
        unknown = [n for n in args.workload if n not in names and n not in _SPAWNED]
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}; known: {sorted(names)}")
        return [names[n] for n in args.workload if n in names], {}
    if args.quick:
        chosen = [w for w in catalogue if w.in_quick]
        return chosen, {}
    if device.type == "cpu":
        not_run = {w.name: w.cpu_skip for w in catalogue if w.cpu_skip}
        return [w for w in catalogue if not w.cpu_skip], not_run
    return catalogue, {}


def registered_ops() -> list[str]:
    prefix = "megatron_eopt::"
    return sorted(n[len(prefix):] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))


def run_workload(workload, device, quick, plan) -> dict:
    started = time.perf_counter()
    entry = {"name": workload.name, "kind": workload.kind, "results": {}, "skipped": {}, "parity_rel_diff": {}}
    try:
        case = workload.build(device, quick)
    except Exception as exc:
        entry["description"] = ""
        entry["results"]["megatron-eopt"] = {"error": f"building the workload failed: {type(exc).__name__}: {exc}",
                                             "traceback": traceback.format_exc(limit=6)}
        return entry
    entry.update(
        description=case.description,
        notes=case.notes,
        flops=case.flops,
        bytes_moved=case.bytes_moved,
        skipped=dict(case.skipped),
    )
    entry["results"] = measure(case, plan, device)
    if case.parity is not None:
        try:
            entry["parity_rel_diff"] = case.parity()
        except Exception as exc:
            entry["parity_error"] = f"{type(exc).__name__}: {exc}"
    ours = entry["results"].get("megatron-eopt", {}).get("median_ms")
    entry["ratios_peer_over_ours"] = {
        name: r["median_ms"] / ours for name, r in entry["results"].items() if ours and "median_ms" in r
        and name != "megatron-eopt"
    }
    entry["wall_s"] = round(time.perf_counter() - started, 2)
    del case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def publish(doc: dict, args) -> None:
    """The one table on stdout, and this device's section of --results-md."""
    print(report.markdown_table(doc["workloads"]))
    notes = report.footnotes(doc["workloads"], doc["not_run"])
    if notes:
        print("\n".join(["", "Not covered:"] + notes))
    if args.results_md:
        report.update_results_md(args.results_md, doc, doc["hyper_parameters"])


# The workloads that spawn ranks, by name: their module (run, markdown).
_SPAWNED = {**{n: workloads_dist for n in workloads_dist.WORKLOADS}, **{n: workloads_tp for n in workloads_tp.WORKLOADS},
            **{n: workloads_overlap for n in workloads_overlap.WORKLOADS},
            **{n: workloads_overlap_megatron for n in workloads_overlap_megatron.WORKLOADS},
            **{n: workloads_agreement for n in workloads_agreement.WORKLOADS},
            **{n: workloads_routing for n in workloads_routing.WORKLOADS}}


def run_dist(args, names, others) -> int:
    """The dist_* / tp_* workloads: one spawn per (workload, rank count), one table per module."""
    if others:
        raise SystemExit("run the dist_* / tp_* workloads on their own (they spawn processes and have their own table)")
    modules = {_SPAWNED[n] for n in names}
    if len(modules) > 1:
        raise SystemExit("run the dist_*, tp_*, overlap_*, overlap_megatron_*, agreement_* and routing_* workloads "
                         "apart (each has its own table)")
    module = modules.pop()
    environment = env_info.collect(torch.device("cpu"))
    entries = []
    for name in names:
        for ranks in args.ranks if getattr(module, "RANKED", True) else [None]:  # routing_cost: one process
            print(f"{name}{f' on {ranks} ranks' if ranks else ''} ...", file=sys.stderr, flush=True)
            entry = module.run(name, ranks, args.quick)
            print("    " + ", ".join(f"{m} {r['median_ms']:.3g} ms" for m, r in entry["results"].items()),
                  file=sys.stderr, flush=True)
            entries.append(entry)
    body = module.markdown(entries, environment)
    if args.remarks:
        body += "\n" + args.remarks + "\n"
    kind = {workloads_dist: "dist", workloads_tp: "tp", workloads_overlap: "overlap",
            workloads_overlap_megatron: "overlap_megatron",
            workloads_agreement: "agreement", workloads_routing: "routing"}[module]
    report.publish(body, args.results_md, f"{kind}: {environment['device_name'].split(',')[0]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema": SCHEMA, "environment": environment, "dist_workloads": entries}, f, indent=1)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for w in catalogue_module.catalogue():
            flags = ("quick " if w.in_quick else "") + ("" if not w.cpu_skip else "(not in full CPU runs)")
            print(f"{w.name:32s} {w.kind:7s} {flags}")
        for name, module in _SPAWNED.items():
            print(f"{name:32s} dist    (only when named) {module.WORKLOADS[name][0]}")
        return 0
    if args.render:
        with open(args.render) as f:
            doc = json.load(f)
        if args.remarks:
            doc["remarks"] = args.remarks
        publish(doc, args)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")

    hyper.configure(device.type, args.coefficients, args.precision)
    symmetric = None
    if args.symmetric_products:
        if device.type != "cuda":
            raise SystemExit("--symmetric-products applies to CUDA only")
        blocks, _, panel = args.symmetric_products.partition(":")
        symmetric = (int(blocks), int(panel or 1024))
        me.set_cuda_symmetric_products(*symmetric)
    threads = args.threads if args.threads is not None else (1 if args.quick else None)
    if threads is not None:
        torch.set_num_threads(threads)
    chosen, not_run = select(args, device)
    dist_names = [n for n in (args.workload or []) if n in _SPAWNED]
    if dist_names:
        return run_dist(args, dist_names, chosen)
    plan = plan_for(device, args.quick)
    environment = env_info.collect(device)
    environment["device_key"] = env_info.device_key(device)
    if device.type == "cpu":
        # A CPU table per precision: "medium" (bf16 products, the optimizers' default) and fp32.
        environment["precision"] = hyper.PRECISION
        environment["device_key"] += f", precision {hyper.PRECISION}"
    if symmetric:
        environment["device_key"] += f", symmetric products {symmetric[0]}:{symmetric[1]}"
    eo_version = environment.get("emerging_optimizers")
    if eo_version and not str(eo_version).startswith("0.3"):
        # A run against another Emerging-Optimizers release is a table of its own.
        environment["device_key"] += f", Emerging-Optimizers {eo_version}"
    print(f"# {environment['device_name']} | torch {environment['torch']} | commit {environment['git_commit']} | "
          f"{'quick' if args.quick else 'full'} run of {len(chosen)} workloads", file=sys.stderr)

    results = []
    for i, workload in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {workload.name} ...", file=sys.stderr, flush=True)
        entry = run_workload(workload, device, args.quick, plan)
        summary = ", ".join(
            f"{n} {r['median_ms']:.3g} ms" if "median_ms" in r else f"{n} {r.get('error', '?')}"
            for n, r in entry["results"].items()
        )
        print(f"    {summary} ({entry.get('wall_s', 0)} s)", file=sys.stderr, flush=True)
        results.append(entry)

    if device.type == "cpu":
        environment["load_average_end_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
    covered = {op for w in catalogue_module.catalogue() for op in w.ops}
    uncovered = [op for op in registered_ops() if op not in covered]
    if uncovered:
        not_run["(ops)"] = f"megatron_eopt ops with no benchmark workload yet: {', '.join(uncovered)}"
    doc = {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "environment": environment,
        "hyper_parameters": hyper.describe() + (
            f"; megatron-eopt symmetric products on every shape (at most {symmetric[0]} block columns of at "
            f"least {symmetric[1]} rows)" if symmetric else ""),
        "workloads": results,
        "not_run": not_run,
        "registered_ops": registered_ops(),
        "remarks": args.remarks,
    }

    publish(doc, args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    failed = any("error" in r for w in results for r in w["results"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
