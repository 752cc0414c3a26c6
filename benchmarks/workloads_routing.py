"""What routing a large model costs: the ``routing_cost`` workload of run.py.

Llama-3 70B and DeepSeek-V3 (671B) as transformers 5 builds them from their configs, every layer at
full width, on the meta device (``from_config`` under ``torch.device("meta")``, bf16): no parameter
memory exists. Each model is routed in a fresh process with the public API, as a user would:
``megatron_eopt.route_parameters(model)`` (the forward traced on the model's dummy inputs, on meta
tensors, then the tables) and ``build_muon_adamw(model)`` (the same routing, then the optimizers).
Reported per model: the first routing call and the median of the next ones (wall clock); the growth
of the resident set over the routing calls (the kernel's peak, VmHWM, reset to the resident size
before them, against the resident size then) and tracemalloc's peak of one call (Python objects);
both against the bytes the parameters would take. ``--quick``: two tiny configs of the same
architectures (a smoke run, seconds).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20

# (name, configuration class, full-size keyword arguments, quick keyword arguments)
MODELS = {
    "Llama-3 70B": ("LlamaConfig", dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ), dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)),
    # DeepseekV3Config's defaults are DeepSeek-V3's (61 layers, 3 dense, 256 routed experts, MLA).
    "DeepSeek-V3": ("DeepseekV3Config", dict(), dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        vocab_size=128, max_position_embeddings=64)),
}

WORKLOADS = {
    "routing_cost": ("route_parameters / build_muon_adamw on Llama-3 70B and DeepSeek-V3 built on the meta device",
                     None),
}
RANKED = False  # one run, not one per --ranks count


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """The kernel's resident peak (VmHWM) set back to the resident size; False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


def measure_child(model_name: str, quick: bool) -> dict:
    """In this (fresh) process: build ``model_name`` on meta, route it, report time and memory."""
    import gc
    import tracemalloc
    import warnings

    import torch
    import transformers

    import megatron_eopt
    from megatron_eopt.integrations.transformers import build_muon_adamw

    torch.set_num_threads(1)
    config_class, full, tiny = MODELS[model_name]
    config = getattr(transformers, config_class)(**(tiny if quick else full))
    started = time.perf_counter()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    build_s = time.perf_counter() - started
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    gc.collect()
    rss_before = _status_kib("VmRSS") * 1024
    peak_method = "VmHWM" if _reset_peak() else "ru_maxrss (not reset: includes the imports and the build)"
    caught = []
    times = []
    repeats = 2 if quick else 4
    for _ in range(1 + repeats):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            started = time.perf_counter()
            table, _ = megatron_eopt.route_parameters(model)
            times.append(time.perf_counter() - started)
        caught = [str(w.message) for w in seen]
    rss_peak = _status_kib("VmHWM") * 1024
    tracemalloc.start()
    megatron_eopt.route_parameters(model)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = build_muon_adamw(model)
    build_optimizer_s = time.perf_counter() - started
    summary = table.summary()
    return {
        "model": model_name,
        "transformers": transformers.__version__,
        "layers": config.num_hidden_layers,
        "params": sum(p.numel() for p in params),
        "param_tensors": len(params),
        "param_bytes": param_bytes,
        "muon_tensors": summary.get("muon", (0, 0))[0],
        "muon_params": summary.get("muon", (0, 0))[1],
        "traced": sum(1 for r in table if r.source.startswith("use")),
        "optimizer_groups": len(optimizer.param_groups),
        "build_model_s": build_s,
        "first_s": times[0],
        "median_s": statistics.median(times[1:]),
        "build_muon_adamw_s": build_optimizer_s,
        "rss_before_mib": rss_before / MIB,
        "rss_growth_mib": (rss_peak - rss_before) / MIB,
        "peak_method": peak_method,
        "tracemalloc_peak_mib": traced_peak / MIB,
        "warnings": caught,
    }


def run(name: str, ranks, quick: bool) -> dict:
    """Each model in a fresh process (a clean resident baseline); the workload's entry."""
    results = {}
    for model_name in MODELS:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), model_name, "quick" if quick else "full"],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"routing {model_name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["median_ms"] = r["median_s"] * 1e3  # what run.py prints per result
        results[model_name] = r
    return {"name": name, "description": WORKLOADS[name][0], "quick": quick, "results": results}


def _g(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def markdown(entries: list[dict], environment: dict) -> str:
    """The RESULTS.md section of a routing-cost run."""
    cpu = environment["device_name"].split(",")[0]
    first = next(iter(entries[0]["results"].values()))
    shapes = ("tiny configs of the same architectures (--quick)" if entries[0]["quick"] else
              "every layer at full width")
    load = environment.get("load_average_1_5_15")
    lines = [
        f"## Routing cost on the meta device, {cpu} (cpu)",
        "",
        f"Measured by `python benchmarks/run.py --workload routing_cost`: commit `{environment['git_commit']}`; "
        f"torch {environment['torch']}; transformers {first['transformers']}; date {environment['date_utc']}; one torch "
        f"thread{f'; load average {load[0]} at the start' if load else ''}. Each model built by "
        f"`AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)` under `torch.device(\"meta\")`, {shapes}, "
        "then routed in a fresh "
        "process: **route s**: `megatron_eopt.route_parameters(model)` (the forward traced on its dummy inputs on "
        "meta tensors, then the tables), first call / median of the next; **build s**: `build_muon_adamw(model)` "
        "(routing and both optimizers); **RSS growth**: the resident peak over the routing calls (VmHWM, reset "
        "before them) minus the resident size before them; **tracemalloc**: the Python heap's peak of one call; "
        "**param GiB**: what the parameters would take in bf16.",
        "",
        "| model | layers | params | param GiB | Muon tensors | traced | route s (first / median) | build s | "
        "RSS growth MiB | tracemalloc MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        for r in e["results"].values():
            lines.append(
                f"| {r['model']} | {r['layers']} | {_g(r['params'] / 1e9)} B | {_g(r['param_bytes'] / (1 << 30))} | "
                f"{r['muon_tensors']} of {r['param_tensors']} | {r['traced']} | {r['first_s']:.2f} / "
                f"{r['median_s']:.2f} | {r['build_muon_adamw_s']:.2f} | {r['rss_growth_mib']:.1f} | "
                f"{r['tracemalloc_peak_mib']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # The checkout's routing (pure Python) is measured, whichever copy run.py imported: its
    # compiled library is found as the checkout's tests find it (megatron_eopt/_library.py).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(measure_child(sys.argv[1], sys.argv[2] == "quick")))
