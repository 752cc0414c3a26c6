"""The result table (stdout and RESULTS.md) and the RESULTS.md file, one section per device."""

from __future__ import annotations

import os
import re

OURS = "megatron-eopt"

_HEADER = """# megatron-eopt benchmark results

Written by `python benchmarks/run.py --results-md benchmarks/RESULTS.md` (add `--device cuda` on a
GPU machine). Each device has its own section; a run replaces the section of the device it ran
on and keeps the others. The JSON written with `--out` holds every sample.

How to read a table:
- **median ms**: median time of one call (one Newton–Schulz, one memory-bound op, or one whole
  optimizer step) after a warm-up; the first call (compilation, lazy state) is never timed.
- **peer / ours**: the peer's median divided by megatron-eopt's; above 1 means megatron-eopt is faster.
- **GFLOP**: the FLOPs an implementation performs per call by the Newton–Schulz algorithm it runs,
  with full GEMMs: standard, per step 4·s²·l + 2·s³ for an s×l matrix, s ≤ l; Gram (docs/design.md §4.4),
  4·s²·l per (re)start and at the end plus 2 to 8·s³ per step (megatron-eopt counts what its
  `auto` chose per matrix; gram-newton-schulz its Gram iteration with one restart).
- **throughput**: TFLOP/s of those FLOPs, or GB/s (bytes each op must read and write, each tensor once).
- **peak MiB** (GPU only): memory an implementation holds at the peak of a call beyond the inputs
  all implementations share: its optimizer state plus transient workspace
  (torch.cuda.max_memory_allocated). The CPU tables show n/a: tracemalloc does not see tensor
  storage and RSS deltas depend on the allocator's caching. The "Optimizer-step memory" sections
  (`benchmarks/step_memory.py`) measure whole steps on CPUs too, one fresh process per
  implementation and the resident peak of each step.
- **rel. diff vs ours**: ‖peer − ours‖ / ‖ours‖ of the outputs (NS), or of the parameter change
  after two steps from the same start on a few of the set's matrices (optimizer steps). bf16
  Newton–Schulz makes 1e-3…3e-2 normal; it shows that every implementation ran the same math.

Methodology: GPU calls are timed with CUDA events, inputs rotate over enough copies to exceed twice
the L2 cache; CPU calls are timed with a wall clock, implementations interleaved call by call
(see `benchmarks/timing.py`). Hyper-parameters are the same for every implementation of a run and
listed in its section; the Newton–Schulz schedule and precision default per device
(`benchmarks/hyper.py`: GPU simple / medium; CPU quintic, one table per precision: "medium", the
optimizers' default with bf16 GEMMs (fast on CPUs with AVX512-BF16 or AMX, as here), and
"highest", fp32). Sections without that line ran {hyper}.
"""

# What every run used before sections listed their own hyper-parameters (the H100 table).
_LEGACY_HYPER = (
    "NS simple x5, precision medium (bf16 products); Muon lr 0.02, momentum 0.95, Nesterov True, "
    "decoupled weight decay 0.01, scale shape_scaling"
)

_SECTION_RE = re.compile(r"<!-- section: (?P<key>.*?) -->\n(?P<body>.*?)<!-- /section -->\n?", re.DOTALL)


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def _throughput(entry: dict) -> str:
    if "tflops" in entry:
        return f"{entry['tflops']:.3g} TFLOP/s"
    if "gbps" in entry:
        return f"{entry['gbps']:.3g} GB/s"
    return ""


def table_rows(workloads: list[dict]) -> list[list[str]]:
    rows = []
    for w in workloads:
        results = w["results"]
        ours = results.get(OURS, {})
        ours_ms = ours.get("median_ms")
        first = True
        names = list(results) + [n for n in w["skipped"] if n not in results]
        for name in names:
            label = w["name"] if first else ""
            first = False
            if name in w["skipped"]:
                rows.append([label, name, "not measured", "", "", "", "", ""])
                continue
            entry = results[name]
            if "error" in entry:
                rows.append([label, name, "error", "", "", "", "", ""])
                continue
            ms = entry["median_ms"]
            if name == OURS:
                ratio = "(ours)"
            elif ours_ms:
                ratio = f"{ms / ours_ms:.2f}x"
            else:
                ratio = "n/a"
            diff = w.get("parity_rel_diff", {}).get(name)
            rows.append(
                [
                    label,
                    name,
                    f"{ms:.4g}",
                    ratio,
                    _fmt(entry.get("flops") and entry["flops"] / 1e9, ".4g", ""),
                    _throughput(entry),
                    _fmt(entry.get("peak_mib"), ".1f"),
                    "" if name == OURS else _fmt(diff, ".1e", ""),
                ]
            )
    return rows


COLUMNS = ["workload", "implementation", "median ms", "peer / ours", "GFLOP", "throughput", "peak MiB",
           "rel. diff vs ours"]


def markdown_table(workloads: list[dict]) -> str:
    rows = table_rows(workloads)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * len(COLUMNS)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def footnotes(workloads: list[dict], not_run: dict[str, str]) -> list[str]:
    notes = []
    for w in workloads:
        for name, why in w["skipped"].items():
            notes.append(f"- `{w['name']}` / {name}: not measured: {why}")
        for name, entry in w["results"].items():
            if "error" in entry:
                notes.append(f"- `{w['name']}` / {name}: error: {entry['error']}")
    for name, why in not_run.items():
        notes.append(f"- `{name}`: not run here: {why}")
    return notes


def section_markdown(doc: dict) -> str:
    env = doc["environment"]
    precision = f", precision {env['precision']}" if env.get("precision") else ""
    lines = [f"## {env['device_name']} ({env['device']}{precision})", ""]
    facts = [
        f"date {env['date_utc']}",
        f"commit `{env['git_commit']}`",
        f"torch {env['torch']}" + (f" (CUDA {env['cuda_runtime']})" if env.get("cuda_runtime") else ""),
        f"Python {env['python']}",
        f"Emerging-Optimizers {env.get('emerging_optimizers') or 'not installed'}",
        f"mode {doc['mode']}",
    ]
    if "load_average_1_5_15" in env:
        load = f"load average (1, 5, 15 min) {env['load_average_1_5_15']} at the start"
        if "load_average_end_1_5_15" in env:
            load += f", {env['load_average_end_1_5_15']} at the end"
        facts.append(f"{load}, on {env['hostname_cpus']} cores shared with other work")
    if "gpu_memory_gib" in env:
        facts.append(f"{env['gpu_memory_gib']} GiB, L2 {env['gpu_l2_mib']} MiB, {env['gpu_sm_count']} SMs")
    lines.append("Measured: " + "; ".join(facts) + ".")
    if doc.get("hyper_parameters"):
        lines += ["", f"Hyper-parameters: {doc['hyper_parameters']}."]
    lines += ["", markdown_table(doc["workloads"]), ""]
    notes = footnotes(doc["workloads"], doc["not_run"])
    if notes:
        lines += ["Not covered in this table:", ""] + notes + [""]
    if doc.get("remarks"):
        lines += [doc["remarks"].strip(), ""]
    return "\n".join(lines)


def _status_paragraph(keys: list[str]) -> str:
    gpu = [k for k in keys if k.startswith("cuda:")]
    cpu = [k for k in keys if k.startswith("cpu:")]
    lines = ["Devices measured: " + (", ".join(k.split(": ", 1)[1] for k in gpu + cpu) or "none") + "."]
    if not gpu:
        lines.append(
            "**No GPU table has been measured yet.** The CUDA kernels compile for sm_90 but have not run "
            "on a GPU; every figure below is from a CPU, where megatron-eopt's Newton–Schulz makes the same "
            "ATen BLAS calls as its peers (only the batching differs) and its fused memory-bound ops are "
            "C++ loops. The GPU table will come from `scripts/gpu_verify.sh` on an H100/H200."
        )
    return "\n".join(lines)


def update_results_md(path: str, doc: dict, hyper_text: str) -> None:
    """Replaces (or adds) this device's section of ``path``; rewrites the header and status lines."""
    del hyper_text  # each section carries its own now
    write_section(path, doc["environment"]["device_key"], section_markdown(doc))


def publish(body: str, results_md: str | None, key: str) -> None:
    """Prints a benchmark's markdown and, when ``results_md`` is given, writes it there as the
    section ``key`` (see :func:`write_section`)."""
    print(body)
    if results_md:
        write_section(results_md, key, body)


def write_section(path: str, key: str, body: str) -> None:
    """Replaces (or adds) the section ``key`` of ``path``, keeping the others; rewrites the header
    and status lines. Device tables ("cuda: ...", "cpu: ...") come first, other sections after."""
    sections: dict[str, str] = {}
    if os.path.exists(path):
        with open(path) as f:
            for match in _SECTION_RE.finditer(f.read()):
                sections[match["key"]] = match["body"]
    sections[key] = body
    group = {"cuda:": 0, "cpu:": 1}
    ordered = sorted(sections, key=lambda k: (group.get(k.split(" ", 1)[0], 2), k))
    parts = [_HEADER.format(hyper=_LEGACY_HYPER), _status_paragraph(ordered), ""]
    for k in ordered:
        body = sections[k].rstrip("\n") + "\n"
        parts.append(f"<!-- section: {k} -->\n{body}<!-- /section -->\n")
    with open(path, "w") as f:
        f.write("\n".join(parts))
