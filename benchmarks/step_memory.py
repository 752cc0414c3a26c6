#!/usr/bin/env python3
"""Memory of one optimizer step, measured: optimizer state, peak above the parameters and gradients,
the transient part of that peak, and the step time, per parameter set and implementation.

    python benchmarks/step_memory.py [--device cpu|cuda] [--sets NAME ...] [--impls KEY ...]
                                     [--steps N] [--precision P] [--workspace-mib V ...]
                                     [--out FILE.json] [--results-md FILE] [--list]
    python benchmarks/step_memory.py --render A.json [B.json ...] [--results-md FILE] [--remarks TEXT]

Every (parameter set, implementation) runs in a fresh process (this file with ``--child``), so no
allocator cache or lazily built structure of one implementation is seen by another. The child
allocates the fp32 parameters and random fp32 gradients, builds the optimizer and reads its
baseline; then:

- CPU: resident memory from /proc/self/status. Before each step the kernel's peak (VmHWM) is reset
  to the current resident size by writing "5" to /proc/self/clear_refs, and read after the step;
  a step's peak is VmHWM minus the baseline (VmRSS with the parameters and gradients allocated,
  before the optimizer is built). Where the reset does not work (not Linux, or an old kernel) the
  child falls back to ru_maxrss, which cannot be reset: the first step's peak only.
- CUDA: torch.cuda.memory_allocated() as the baseline, reset_peak_memory_stats() before and
  max_memory_allocated() after each step; steps timed with CUDA events.

Reported per row: the optimizer state (bytes of every tensor in ``optimizer.state``: momentum,
low-memory codes and block scales), the peak above parameters + gradients of step 1 (which also
creates the state) and of the later steps, the transient memory (later peak minus state: what a
step needs beyond what it keeps), what is still held after the last step, the median time of steps
2..N, and ratios to Emerging-Optimizers' Muon in the same run. Each optimizer runs at its own
defaults (megatron-eopt and Emerging-Optimizers: bf16 Newton–Schulz products, "medium"; torch: bf16)
with the same lr, momentum, weight decay and Nesterov (benchmarks/hyper.py); ``--precision``
sets ``fp32_matmul_prec`` of the two that take it.

``--workspace-mib``: when megatron-eopt's fused optimizers take a ``workspace_mib`` budget
(constructor argument or attribute), one more megatron-eopt row per value ("none": unbounded).

``--render`` measures nothing: it prints (and writes into --results-md) the table of saved --out
files, their rows joined in order (runs of the same device and settings, e.g. one per set).

Parameter sets (``--list``): named sets of nn.Linear shapes, or ``KxMxN`` for K matrices of M x N.
"""

from __future__ import annotations

import argparse
import gc
import glob
import inspect
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
# A developer build puts _C.so into the checkout: measure that one rather than an installed copy.
if glob.glob(os.path.join(REPO_ROOT, "megatron_eopt", "_C*.so")):
    sys.path.insert(0, REPO_ROOT)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import hyper  # noqa: E402
import param_sets  # noqa: E402
import peers  # noqa: E402

SCHEMA = "megatron-eopt-benchmarks/step-memory/1"
OURS = "megatron-eopt"
RESULT_PREFIX = "STEP_MEMORY_RESULT "
MIB = 2**20

# name -> (description, shapes)
SETS = {
    "gpt2_layer": ("GPT-2 small, 1 layer", param_sets.gpt2_layer),
    "llama_1b_1l": ("Llama-3.2-1B, 1 layer", param_sets.llama_1b_layer),
    "llama_1b_4l": ("Llama-3.2-1B, 4 layers", lambda: param_sets.llama_1b_layer() * 4),
    "llama_1b_8l": ("Llama-3.2-1B, 8 layers", lambda: param_sets.llama_1b_layer() * 8),
    "qwen3_moe_8e": ("Qwen3-30B-A3B layer, 8 experts", lambda: param_sets.qwen3_moe_experts(8)),
    "llama_8b_4l": ("Llama-3-8B, 4 layers", lambda: param_sets.llama_8b_layers(4)),
}
DEFAULT_SETS = {
    "cpu": ["llama_1b_1l", "llama_1b_4l", "llama_1b_8l", "qwen3_moe_8e"],
    "cuda": ["llama_1b_1l", "llama_1b_4l", "llama_1b_8l", "qwen3_moe_8e", "llama_8b_4l"],
}

# key -> (label, state_dtype for ours or None for a peer)
IMPLS = {
    "ours": (OURS, "fp32"),
    "ours-bf16": (f"{OURS}, state bf16", "bf16"),
    "ours-int8": (f"{OURS}, state int8", "int8"),
    "ours-fp8": (f"{OURS}, state fp8", "fp8"),
    # Newton–Schulz in place on CUDA too (megatron_eopt.set_in_place_newton_schulz; the CPU always is)
    "ours-inplace": (f"{OURS}, in-place Newton–Schulz", "fp32"),
    "eo": (peers.EO_MUON, None),
    "torch": (peers.TORCH_MUON, None),
}
DEFAULT_WORKSPACES = ["64", "256", "1024", "none"]
ONLY_WHEN_NAMED = {"ours-inplace"}  # a switch for CUDA only: the CPU's default row already is it


# ------------------------------------------------------------------ parameter sets
def shapes_of(spec: str) -> tuple[str, list[tuple[int, int]]]:
    """(description, shapes) of a named set or of ``KxMxN`` (K matrices of M x N)."""
    if spec in SETS:
        description, make = SETS[spec]
        return description, make()
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", spec)
    if match:
        k, m, n = (int(v) for v in match.groups())
        return f"{k} matrices {m}x{n}", [(m, n)] * k
    raise SystemExit(f"unknown parameter set {spec!r}; known: {sorted(SETS)} or KxMxN")


# ------------------------------------------------------------------ the optimizers
def workspace_support() -> str | None:
    """How megatron-eopt's Muon takes a workspace budget: "argument", "attribute", or None."""
    from megatron_eopt.optim import Muon

    if "workspace_mib" in inspect.signature(Muon.__init__).parameters:
        return "argument"
    probe = Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=hyper.LR)
    return "attribute" if hasattr(probe, "workspace_mib") else None


def parse_workspace(value: str) -> float | str | None:
    """A --workspace-mib value as the optimizers take it: MiB, "auto" or None ("none")."""
    if value.lower() in ("none", "auto"):
        return None if value.lower() == "none" else "auto"
    return float(value) if "." in value else int(value)


def impl_label(key: str, workspace: str | None) -> str:
    label = IMPLS[key][0]
    if workspace is not None:
        mib = parse_workspace(workspace)
        label += ", workspace " + ("unbounded" if mib is None else "auto" if mib == "auto" else f"{mib} MiB")
    return label


def unavailable(key: str, precision: str | None) -> str | None:
    """Why an implementation cannot run here, or None."""
    if key.startswith("ours"):
        return None
    if key == "eo":
        return peers.emerging_optimizers()[3]
    return peers.torch_muon_available(precision)


def build_optimizer(key: str, params, precision: str | None, workspace: str | None):
    """The optimizer of ``key`` at its defaults with the run's shared hyper-parameters."""
    shared = hyper.step_settings()
    prec = {} if precision is None else {"fp32_matmul_prec": precision}
    if key.startswith("ours"):
        from megatron_eopt.optim import Muon

        kwargs = dict(shared, state_dtype=IMPLS[key][1], **prec)
        how = None if workspace is None else workspace_support()
        if workspace is not None and how is None:
            raise RuntimeError("this build's Muon has no workspace_mib")
        if how == "argument":
            kwargs["workspace_mib"] = parse_workspace(workspace)
        if key == "ours-inplace":
            import megatron_eopt as me

            me.set_in_place_newton_schulz(cuda=True)
        opt = Muon(params, **kwargs)
        if how == "attribute":
            opt.workspace_mib = parse_workspace(workspace)
        return opt
    if key == "eo":
        eo = peers.emerging_optimizers()[0]
        return eo.Muon(params, **shared, **prec)
    if key == "torch":
        return torch.optim.Muon(params, **shared)
    raise ValueError(key)


def state_nbytes(optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (each storage once)."""
    seen, total = set(), 0

    def visit(value):
        nonlocal total
        if isinstance(value, torch.Tensor):
            key = (value.device, value.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for per_param in optimizer.state.values():
        visit(per_param)
    return total


# ------------------------------------------------------------------ resident memory (CPU)
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Resets the kernel's resident-set peak (VmHWM) to the current size; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_reset_works() -> bool:
    """Whether reset_peak_rss() really lowers VmHWM: touches 64 MiB, frees it, resets."""
    try:
        scratch = torch.ones(64 * MIB // 4)
        del scratch
        gc.collect()
        if not reset_peak_rss():
            return False
        return hwm_bytes() < rss_bytes() + 32 * MIB
    except OSError:
        return False


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ------------------------------------------------------------------ the child: one measured process
def measure_child(spec: str, key: str, device: torch.device, steps: int, precision: str | None,
                  workspace: str | None, threads: int | None, seed: int = 0) -> dict:
    """Steps one optimizer ``steps`` times on a fresh set; memory and time per step."""
    if threads is not None:
        torch.set_num_threads(threads)
    cuda = device.type == "cuda"
    method = "cuda" if cuda else ("VmHWM" if peak_reset_works() else "ru_maxrss")
    _, shapes = shapes_of(spec)
    # One step on a tiny matrix first: the optimizer's modules imported and the libraries its step
    # calls initialized before the baseline, so that this is not counted as the step's memory.
    tiny = torch.nn.Parameter(torch.zeros(8, 16, device=device))
    tiny.grad = torch.ones_like(tiny)
    build_optimizer(key, [tiny], precision, workspace).step()
    del tiny
    gen = torch.Generator(device=device).manual_seed(seed)
    # Filled in place: no temporaries raise the resident peak before the baseline (ru_maxrss).
    params = [torch.nn.Parameter(torch.empty(m, n, device=device).normal_(0.0, 0.02, generator=gen))
              for m, n in shapes]
    for p in params:
        p.grad = torch.empty_like(p).normal_(generator=gen)
    gc.collect()

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def current() -> int:
        return torch.cuda.memory_allocated(device) if cuda else rss_bytes()

    sync()
    baseline = current()  # parameters and gradients
    opt = build_optimizer(key, params, precision, workspace)
    built = current()

    peaks, times = [], []
    for i in range(steps):
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            opt.step()
            end.record()
            sync()
            times.append(begin.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated(device) - baseline)
        else:
            if method == "VmHWM":
                reset_peak_rss()
            start = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - start) * 1e3)
            if method == "VmHWM":
                peaks.append(hwm_bytes() - baseline)
            elif i == 0:
                peaks.append(_maxrss_bytes() - baseline)
            else:
                peaks.append(None)  # ru_maxrss is the peak of the whole process: step 1's or higher
    sync()
    gc.collect()
    held = current() - baseline
    state = state_nbytes(opt)
    later = [p for p in peaks[1:] if p is not None]
    return dict(
        set=spec,
        impl=key,
        workspace=workspace,
        params=sum(m * n for m, n in shapes),
        matrices=len(shapes),
        method=method,
        threads=torch.get_num_threads(),
        baseline_mib=baseline / MIB,
        construction_mib=(built - baseline) / MIB,
        state_mib=state / MIB,
        step_peaks_mib=[None if p is None else p / MIB for p in peaks],
        first_peak_mib=peaks[0] / MIB,
        peak_mib=max(later) / MIB if later else None,
        transient_mib=(max(later) - state) / MIB if later else None,
        first_transient_mib=(peaks[0] - state) / MIB,
        held_mib=held / MIB,
        samples_ms=[round(t, 4) for t in times],
        median_ms=statistics.median(times[1:]) if len(times) > 1 else None,
    )


def run_child(spec: str, key: str, device: str = "cpu", steps: int = 4, precision: str | None = None,
              workspace: str | int | None = None, threads: int | None = None, timeout: float = 3600) -> dict:
    """measure_child() in a fresh Python process; an ``error`` entry when it failed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", device, "--sets", spec,
           "--impls", key, "--steps", str(steps)]
    if precision:
        cmd += ["--precision", precision]
    if workspace is not None:
        cmd += ["--workspace-mib", str(workspace)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(set=spec, impl=key, workspace=workspace, error=f"timed out after {timeout:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return dict(set=spec, impl=key, workspace=workspace, error=tail[0][:300],
                stderr_tail=(proc.stderr or "")[-3000:])


# ------------------------------------------------------------------ the report
def add_ratios(rows: list[dict]) -> None:
    """Peak and time of each row relative to Emerging-Optimizers' Muon on the same set."""
    eo = {r["set"]: r for r in rows if r["impl"] == "eo" and "error" not in r}
    for r in rows:
        ref = eo.get(r["set"])
        if ref is None or "error" in r:
            continue
        if r.get("peak_mib") and ref.get("peak_mib"):
            r["peak_vs_eo"] = r["peak_mib"] / ref["peak_mib"]
        if r.get("median_ms") and ref.get("median_ms"):
            r["eo_time_over_this"] = ref["median_ms"] / r["median_ms"]


def _f(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


COLUMNS = ["parameter set", "implementation", "state MiB", "step-1 peak MiB", "peak MiB", "transient MiB",
           "held MiB", "median step ms", "peak / EO", "EO time / this"]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * len(COLUMNS)) + "|"]
    last_set = None
    for r in rows:
        label = ""
        if r["set"] != last_set:
            description, _ = shapes_of(r["set"])
            label = f"{description} ({r['params'] / 1e6:.0f} M)" if "params" in r else description
            last_set = r["set"]
        name = impl_label(r["impl"], r.get("workspace"))
        if "error" in r:
            lines.append(f"| {label} | {name} | error: {r['error']} |" + " |" * (len(COLUMNS) - 3))
            continue
        cells = [label, name, _f(r["state_mib"]), _f(r["first_peak_mib"]), _f(r["peak_mib"]),
                 _f(r["transient_mib"]), _f(r["held_mib"]), _f(r["median_ms"], ".0f"),
                 _f(r.get("peak_vs_eo"), ".2f"), _f(r.get("eo_time_over_this"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _without_out(argv: list[str]) -> list[str]:
    """A run's arguments less its output files (local paths)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--results-md"):
            skip = True
        elif not arg.startswith(("--out=", "--results-md=")):
            out.append(arg)
    return out


def section_markdown(doc: dict) -> str:
    env = doc["environment"]
    methods = sorted({r["method"] for r in doc["rows"] if "method" in r})
    how = {
        "VmHWM": "resident memory (VmHWM, its peak reset before each step through /proc/self/clear_refs)",
        "ru_maxrss": "ru_maxrss (no peak reset here: the first step's peak only)",
        "cuda": "torch.cuda.max_memory_allocated()",
    }
    lines = [
        f"## Optimizer-step memory: {env['device_name']}",
        "",
        f"commit `{env['git_commit']}`, torch {env['torch']}, Emerging-Optimizers "
        f"{env.get('emerging_optimizers') or 'not installed'}, {env['date_utc']}; "
        + "; ".join(f"`python benchmarks/step_memory.py {' '.join(_without_out(argv))}`"
                    for argv in doc.get("commands", [env["argv"]])) + ".",
        "",
        "Every (set, implementation) ran in a fresh process on fp32 parameters and random fp32 gradients, "
        f"{doc['steps']} steps; memory measured as {', '.join(how.get(m, m) for m in methods)}, above the "
        "parameters and gradients. Precision: "
        + ("each optimizer's default (megatron-eopt and Emerging-Optimizers \"medium\": bf16 "
           "Newton–Schulz products; torch.optim.Muon bf16)" if doc["precision"] is None
           else f"fp32_matmul_prec \"{doc['precision']}\"")
        + f"; {doc['hyper_parameters']}.",
        "",
        "- **state MiB**: bytes of the tensors in `optimizer.state` after the last step (codes and scales "
        "of a low-memory state counted).",
        "- **step-1 peak MiB**: peak above parameters + gradients during the first step (which also creates "
        "the state); **peak MiB**: the same, the largest of steps 2..N.",
        "- **transient MiB**: peak minus state, what a step needs beyond what it keeps; **held MiB**: still "
        "allocated (resident) after the last step, state included.",
        "- **median step ms**: median of steps 2..N (" + ("CUDA events" if env["device"] == "cuda"
                                                          else "wall clock, a shared machine") + ").",
        "- **peak / EO**: this row's peak over Emerging-Optimizers' Muon's (below 1: less memory); "
        "**EO time / this**: above 1 means faster than Emerging-Optimizers.",
        "",
        markdown_table(doc["rows"]),
        "",
    ]
    if doc.get("not_run"):
        lines += ["Not measured:", ""] + [f"- {name}: {why}" for name, why in doc["not_run"].items()] + [""]
    if doc.get("remarks"):
        lines += [doc["remarks"].strip(), ""]
    return "\n".join(lines)


def section_key(device_name: str, precision: str | None, impls=()) -> str:
    key = f"step memory: {device_name.split(',')[0]}"
    key += f", precision {precision}" if precision else ""
    # A run comparing the in-place switch is a table of its own, beside the published one.
    return key + (", in-place Newton–Schulz" if "ours-inplace" in impls else "")


def publish(doc: dict, results_md: str | None) -> None:
    """The section on stdout and, with ``results_md``, in that file (replacing this device's)."""
    import report

    body = section_markdown(doc)
    impls = {row["impl"] for row in doc["rows"]}
    report.publish(body, results_md, section_key(doc["environment"]["device_name"], doc["precision"], impls))


def render(args) -> int:
    docs = []
    for path in args.render:
        with open(path) as f:
            docs.append(json.load(f))
    doc = dict(docs[0])
    for other in docs[1:]:
        for key in ("steps", "precision"):
            if other[key] != doc[key]:
                raise SystemExit(f"{path}: {key} {other[key]!r} differs from {doc[key]!r} of {args.render[0]}")
        doc["not_run"] = {**doc["not_run"], **other["not_run"]}
    doc["rows"] = [r for d in docs for r in d["rows"]]
    doc["commands"] = [c for d in docs for c in d.get("commands", [d["environment"]["argv"]])]
    add_ratios(doc["rows"])
    if args.remarks:
        doc["remarks"] = args.remarks
    publish(doc, args.results_md)
    return 0


# ------------------------------------------------------------------ the parent
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--sets", nargs="+", metavar="NAME", help="parameter sets (see --list) or KxMxN")
    parser.add_argument("--impls", nargs="+", metavar="KEY", choices=list(IMPLS), help="default: all but ours-inplace")
    parser.add_argument("--steps", type=int, default=None, help="steps per process (default: CPU 4, CUDA 20)")
    parser.add_argument("--precision", choices=["medium", "high", "highest"], default=None,
                        help="fp32_matmul_prec of megatron-eopt and Emerging-Optimizers (default: theirs)")
    parser.add_argument("--workspace-mib", nargs="*", metavar="V", default=None,
                        help=f"workspace budgets of extra megatron-eopt rows, MiB or none "
                             f"(default: {' '.join(DEFAULT_WORKSPACES)}; only where the option exists; "
                             "none given: no budget rows)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of each child (default: torch's)")
    parser.add_argument("--out", metavar="FILE.json", help="write every row and sample as JSON")
    parser.add_argument("--results-md", metavar="FILE", help="update this device's step-memory section")
    parser.add_argument("--remarks", default="", help="a paragraph added under the table in --results-md")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--list", action="store_true", help="list the parameter sets and exit")
    parser.add_argument("--render", nargs="+", metavar="FILE.json",
                        help="measure nothing: the table of saved --out files, their rows joined")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, (description, make) in SETS.items():
            shapes = make()
            print(f"{name:14s} {description}: {len(shapes)} matrices, {param_sets.numel(shapes) / 1e6:.1f} M params")
        return 0
    if args.render:
        return render(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    steps = args.steps or (20 if device.type == "cuda" else 4)
    if steps < 2:
        raise SystemExit("--steps must be at least 2 (step 1 is measured apart)")

    if args.child:
        workspace = args.workspace_mib[0] if args.workspace_mib else None
        result = measure_child(args.sets[0], args.impls[0], device, steps, args.precision, workspace, args.threads)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    import env_info

    sets = args.sets or DEFAULT_SETS[device.type]
    for spec in sets:
        shapes_of(spec)  # unknown names fail before anything runs
    keys = args.impls or [k for k in IMPLS if k not in ONLY_WHEN_NAMED]
    not_run = {}
    runs = []  # (key, workspace)
    for key in keys:
        why = unavailable(key, args.precision)
        if why:
            not_run[IMPLS[key][0]] = why
        else:
            runs.append((key, None))
    support = workspace_support()
    budgets = args.workspace_mib if args.workspace_mib is not None else DEFAULT_WORKSPACES
    if support and budgets:
        runs += [("ours", b) for b in budgets]
    elif budgets:
        not_run[f"{OURS}, workspace budgets"] = "this build's Muon has no workspace_mib option"

    environment = env_info.collect(device)
    print(f"# {environment['device_name']} | torch {environment['torch']} | commit {environment['git_commit']} | "
          f"{len(sets)} sets x {len(runs)} implementations, {steps} steps each", file=sys.stderr, flush=True)
    rows = []
    for spec in sets:
        for key, workspace in runs:
            started = time.perf_counter()
            row = run_child(spec, key, device.type, steps, args.precision, workspace, args.threads, args.timeout)
            rows.append(row)
            what = (f"error: {row['error']}" if "error" in row else
                    f"state {row['state_mib']:.1f} MiB, peak {_f(row['first_peak_mib'])} / {_f(row['peak_mib'])} MiB, "
                    f"{_f(row['median_ms'], '.0f')} ms")
            print(f"  {spec} / {impl_label(key, workspace)}: {what} ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    add_ratios(rows)
    if device.type == "cpu":
        environment["load_average_end_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
    doc = dict(schema=SCHEMA, environment=environment, steps=steps, precision=args.precision,
               hyper_parameters=(f"lr {hyper.LR}, momentum {hyper.MOMENTUM}, Nesterov {hyper.NESTEROV}, "
                                 f"weight decay {hyper.WEIGHT_DECAY}"),
               workspace_option=support, rows=rows, not_run=not_run, remarks=args.remarks)
    publish(doc, args.results_md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
