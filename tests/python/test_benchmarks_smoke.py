"""Smoke test of benchmarks/run.py: a --quick run of two tiny workloads writes the documented JSON
and a RESULTS.md section. No timing is asserted, only that every part of the report is there."""

import json
import math
import os
import subprocess
import sys

import pytest

RUN_PY = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "run.py")
WORKLOADS = ["ns_1024x4096", "step_gpt2_124m"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, md_path = out / "bench.json", out / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, RUN_PY, "--device", "cpu", "--quick", "--workload", *WORKLOADS,
         "--out", str(json_path), "--results-md", str(md_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(json_path) as f:
        doc = json.load(f)
    return doc, md_path.read_text(), proc.stdout


def test_json_has_environment_and_every_requested_workload(quick_run):
    doc, _, _ = quick_run
    assert doc["schema"] == "megatron-eopt-benchmarks/1"
    assert doc["mode"] == "quick"
    env = doc["environment"]
    for key in ("device", "device_name", "torch", "git_commit", "date_utc", "device_key"):
        assert env[key], key
    assert env["device"] == "cpu"
    assert [w["name"] for w in doc["workloads"]] == WORKLOADS
    assert "newton_schulz" in doc["registered_ops"]


def test_every_implementation_is_measured_or_says_why_not(quick_run):
    doc, _, _ = quick_run
    for w in doc["workloads"]:
        assert w["results"], w["name"]
        for name, r in w["results"].items():
            assert "error" not in r, (w["name"], name, r.get("error"))
            assert r["repeats"] >= 2 and len(r["samples_ms"]) == r["repeats"]
            assert r["p25_ms"] <= r["median_ms"] <= r["p75_ms"]
            assert r["tflops"] > 0
        for name, why in w["skipped"].items():
            assert name not in w["results"] and why
        assert "megatron-eopt" in w["results"] or "megatron-eopt" in w["skipped"]
        # The peers every run compares against (all importable in the test environment).
        assert "torch.compile batched" in w["results"]


def test_ratios_and_parity_refer_to_ours(quick_run):
    doc, _, _ = quick_run
    ns = doc["workloads"][0]
    ours = ns["results"]["megatron-eopt"]["median_ms"]
    for name, ratio in ns["ratios_peer_over_ours"].items():
        assert ratio == pytest.approx(ns["results"][name]["median_ms"] / ours)
    assert set(ns["parity_rel_diff"]) == set(ns["results"]) - {"megatron-eopt"}
    # Every implementation computes the same Newton–Schulz (bf16 on a GPU, fp32 on a CPU: hyper.py).
    assert all(d < 5e-2 for d in ns["parity_rel_diff"].values()), ns["parity_rel_diff"]


def test_table_and_results_section(quick_run):
    _, md, stdout = quick_run
    header = "| workload | implementation | median ms | peer / ours |"
    assert stdout.count(header) == 1  # one table
    assert "<!-- section: cpu: " in md and "<!-- /section -->" in md
    assert header in md
    for name in WORKLOADS:
        assert f"| {name} |" in md


def test_render_rebuilds_the_section_from_json(quick_run, tmp_path):
    doc, md, _ = quick_run
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(doc))
    rendered = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, RUN_PY, "--render", str(saved), "--results-md", str(rendered), "--remarks", "Re-rendered."],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = rendered.read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table and all(line in text for line in table)
    assert "Re-rendered." in text


@pytest.mark.gpu
def test_quick_cuda_run_times_with_events_and_reports_memory(tmp_path):
    json_path = tmp_path / "bench_cuda.json"
    proc = subprocess.run(
        [sys.executable, RUN_PY, "--device", "cuda", "--quick", "--workload", "ns_batch_16x1024x1024",
         "mem_foreach_momentum", "step_gpt2_124m", "--out", str(json_path)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(json_path.read_text())
    assert doc["environment"]["device"] == "cuda" and doc["environment"]["gpu_l2_mib"] > 0
    for w in doc["workloads"]:
        for name, r in w["results"].items():
            assert "error" not in r, (w["name"], name, r.get("error"))
            assert r["peak_mib"] is not None and r["peak_mib"] >= 0
        assert "megatron-eopt" in w["results"]


def test_state_dtype_benchmark_quick_run_writes_its_section(tmp_path):
    """benchmarks/state_dtypes.py --quick: one row per parameter set and state dtype, the bytes per
    parameter measured on the optimizer's state (int8 / fp8 at least 3.5x below fp32 at the real
    shapes is asserted in the optimizer tests; here only the report's shape)."""
    script = os.path.join(os.path.dirname(RUN_PY), "state_dtypes.py")
    md_path = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--quick", "--results-md", str(md_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = md_path.read_text()
    assert "<!-- section: state dtypes:" in text
    rows = [line for line in text.splitlines() if line.startswith("| GPT-2") or line.startswith("| Llama")]
    assert len(rows) == 8, rows
    assert [r.split("|")[2].strip() for r in rows[:4]] == ["fp32", "bf16", "int8", "fp8"]
    assert rows[0].split("|")[3].strip() == "4.000" and rows[1].split("|")[3].strip() == "2.000"


STEP_MEMORY_SET = "4x64x4096"  # four 1 MiB matrices: cheap steps, yet every state tensor a whole MiB


@pytest.fixture(scope="module")
def step_memory_run(tmp_path_factory):
    """benchmarks/step_memory.py on a tiny set, one fresh process per implementation (fp32 products:
    fast on every CPU, so torch.optim.Muon, bf16 only, is listed as not measured)."""
    script = os.path.join(os.path.dirname(RUN_PY), "step_memory.py")
    out = tmp_path_factory.mktemp("step_memory")
    json_path, md_path = out / "step_memory.json", out / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--sets", STEP_MEMORY_SET, "--steps", "2", "--precision",
         "highest", "--threads", "1", "--workspace-mib", "64", "--out", str(json_path), "--results-md", str(md_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return script, json.loads(json_path.read_text()), md_path.read_text()


def test_step_memory_rows_are_measured_and_positive(step_memory_run):
    _, doc, md = step_memory_run
    assert doc["schema"] == "megatron-eopt-benchmarks/step-memory/1" and doc["steps"] == 2
    rows = {(r["impl"], r["workspace"]): r for r in doc["rows"]}
    expected = [("ours", None), ("ours-bf16", None), ("ours-int8", None), ("ours-fp8", None), ("eo", None)]
    if doc["workspace_option"]:
        expected.append(("ours", "64"))
    else:
        assert any("workspace" in name for name in doc["not_run"])
    assert sorted(rows, key=repr) == sorted(expected, key=repr), sorted(rows, key=repr)
    assert "torch.optim.Muon" in doc["not_run"]
    for key, r in rows.items():
        assert "error" not in r, (key, r.get("stderr_tail") or r["error"])
        assert r["set"] == STEP_MEMORY_SET and r["params"] == 4 * 64 * 4096 and r["matrices"] == 4
        assert r["method"] in ("VmHWM", "ru_maxrss")
        assert r["state_mib"] > 0 and r["first_peak_mib"] > 0 and r["median_ms"] > 0, (key, r)
        assert len(r["samples_ms"]) == 2 and len(r["step_peaks_mib"]) == 2
        if r["method"] == "VmHWM":
            assert r["peak_mib"] > 0 and r["transient_mib"] == pytest.approx(r["peak_mib"] - r["state_mib"])
    assert rows[("ours", None)]["state_mib"] == pytest.approx(4.0)  # fp32 momentum: 4 x 256 Ki values x 4 bytes
    assert rows[("eo", None)]["state_mib"] == pytest.approx(4.0)
    assert rows[("ours-bf16", None)]["state_mib"] == pytest.approx(2.0)
    assert 1.0 <= rows[("ours-int8", None)]["state_mib"] < 1.1  # 1 byte per value plus block scales
    assert rows[("eo", None)]["peak_vs_eo"] == pytest.approx(1.0)
    assert "<!-- section: step memory: " in md and "| parameter set | implementation | state MiB |" in md


def test_step_memory_render_rebuilds_the_section(step_memory_run, tmp_path):
    script, doc, md = step_memory_run
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(doc))
    rendered = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, script, "--render", str(saved), "--results-md", str(rendered)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table and all(line in rendered.read_text() for line in table)


def test_op_overhead_reports_every_row_and_the_step_s_python_calls():
    script = os.path.join(os.path.dirname(RUN_PY), "op_overhead.py")
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--calls", "20"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "µs per call" not in line]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert "aten: torch.mm 8x8" in names and "Muon step, demo model (16 matrices)" in names
    assert all(float(row.rstrip(" |").rsplit("| ", 1)[1]) > 0 for row in rows)
    calls = proc.stdout.split("Python calls per demo-model step")[1]
    count = float(calls.split(":", 1)[1].strip().rstrip("."))
    assert 50 < count < 5000  # a count of Python-level calls, not a time


def test_ns_algorithms_times_the_cpu_products_modes_on_the_shapes_given(tmp_path):
    """benchmarks/ns_algorithms.py --shapes with the CPU's bf16-product variants: one row per shape,
    a time per variant and the ratios to the first; the products mode is back to "auto" after."""
    script = os.path.join(os.path.dirname(RUN_PY), "ns_algorithms.py")
    md_path = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--precision", "medium", "--target-s", "0.05",
         "--variants", "standard+fp32", "standard+bf16", "gram", "--shapes", "16x48", "40x24",
         "--results-md", str(md_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = md_path.read_text()
    assert "<!-- section: algorithms:" in text and "+bf16 / +fp32" in text
    rows = [line for line in text.splitlines() if line.startswith("| 16x48") or line.startswith("| 40x24")]
    assert len(rows) == 2, text
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[1:4]) and cells[4].endswith("x") and cells[5].endswith("x")
    bad = subprocess.run([sys.executable, script, "--device", "cpu", "--variants", "standard+fp16"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "bad variant" in bad.stderr


def test_clipping_study_quick_run_reports_every_policy_and_part(tmp_path):
    """benchmarks/clipping_study.py --quick: the three parts, each with the four policies (or widths),
    and what each policy must do to the gradients: under the scaled loss of (a) the global and
    "separate" clips bring the Muon matrices' gradients to norm <= 1 while "none" and "adamw" leave
    them at the scaled size; in (c) a clip of the gradient leaves Muon's step as it is, a clip of the
    update divides it by the update's norm (DeepSpeed's reported grad norm)."""
    script = os.path.join(os.path.dirname(RUN_PY), "clipping_study.py")
    json_path, png_path = tmp_path / "clipping.json", tmp_path / "clipping.png"
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--out-json", str(json_path), "--plot", str(png_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(json_path.read_text())
    assert doc["schema"] == "megatron-eopt-benchmarks/clipping-study/1" and doc["mode"] == "quick"
    assert png_path.stat().st_size > 10_000
    policies = ["none", "global", "adamw", "separate"]
    a, b, c = doc["a_huge_grad_norm"], doc["b_spike"], doc["c_deepspeed_table"]
    assert list(a["policies"]) == policies and list(b["policies"]) == policies
    for policy, s in a["policies"].items():
        assert math.isfinite(s["final_val_loss"]) and len(s["train_loss"]) == a["steps"], policy
        assert s["median_grad_norm"] > 1e3, (policy, s["median_grad_norm"])  # the loss scale took effect
        clipped = policy in ("global", "separate")
        assert (s["min_muon_matrix_grad_after_clip"] <= 1.0 + 1e-4) == clipped, (policy, s)
        assert s["median_muon_update_rms"] > 0 and s["ns_inputs_below_eps_total"] >= 0
    for policy, s in b["policies"].items():
        assert s["spike_grad_norm"] > 100 * s["grad_norm_before_spike"], (policy, s)
        assert len(s["muon_cos"]) == len(s["loss_excess"]) == b["steps"] - b["spike_step"]
        assert s["loss_excess"][0] == 0.0  # the spike step's own loss precedes any difference
    assert [r["width"] for r in c["rows"]] == [32, 64]
    for r in c["rows"]:
        assert r["attenuation_clip_gradient"] == pytest.approx(1.0, abs=1e-3), r
        assert r["attenuation_clip_update"] == pytest.approx(r["deepspeed_reported_grad_norm"], rel=1e-3), r
        assert r["grad_norm"] > 1.0


def _quick_dist_run(tmp_path, workload, *args):
    """run.py --quick --workload ``workload`` (one of the spawned-process workloads): its one JSON entry
    and the RESULTS.md text it wrote."""
    json_path, md_path = tmp_path / f"{workload}.json", tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, RUN_PY, "--quick", "--workload", workload, *args, "--out", str(json_path),
                           "--results-md", str(md_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry, = json.loads(json_path.read_text())["dist_workloads"]
    return entry, md_path.read_text()


def test_routing_cost_quick_run_routes_both_architectures_on_meta(tmp_path):
    """run.py --workload routing_cost --quick: tiny Llama and DeepSeek-V3 configs built on the meta
    device and routed in fresh processes; every figure is there and the routing read the uses.
    Neither time nor memory is asserted (the full-size figures are in RESULTS.md)."""
    entry, text = _quick_dist_run(tmp_path, "routing_cost")
    assert entry["name"] == "routing_cost" and entry["quick"]
    assert list(entry["results"]) == ["Llama-3 70B", "DeepSeek-V3"]
    for name, r in entry["results"].items():
        assert r["params"] > 0 and r["param_bytes"] >= 2 * r["params"], name  # bf16 and wider
        assert 0 < r["muon_tensors"] < r["param_tensors"] and r["traced"] > 0, (name, r)
        assert r["first_s"] > 0 and r["median_s"] > 0 and r["build_muon_adamw_s"] > 0, (name, r)
        assert r["tracemalloc_peak_mib"] > 0 and r["rss_before_mib"] > 0 and r["rss_growth_mib"] >= 0, (name, r)
        assert r["warnings"] == [], (name, r["warnings"])
    assert "<!-- section: routing: " in text and "| model | layers | params |" in text
    assert "| Llama-3 70B | 2 |" in text and "| DeepSeek-V3 | 3 |" in text


def test_overlap_under_megatron_quick_run_writes_its_section(tmp_path):
    """run.py --workload overlap_megatron_gpt --quick on 2 gloo ranks: both modes measured, the
    parameters with and without overlap bitwise equal, and the RESULTS.md section written."""
    pytest.importorskip("megatron.core")
    entry, text = _quick_dist_run(tmp_path, "overlap_megatron_gpt", "--ranks", "2")
    off, on = entry["results"]["megatron ddp, overlap off"], entry["results"]["megatron ddp, overlap on"]
    assert on["bitwise_equal"] and on["ms_before_step"] > 0 and on["held_mib"] > 0 and off["held_mib"] == 0
    assert on["ns_matrices_per_rank"] == off["ns_matrices_per_rank"] == entry["matrices"] > 0
    assert "<!-- section: overlap_megatron: " in text


def test_agreement_quick_run_writes_its_section(tmp_path):
    """run.py --workload agreement_gpt2_124m --quick on 2 gloo ranks: the step with and without the
    ranks' agreement and riding it, the comparison's own noise and the agreement's host part, and
    the section."""
    entry, text = _quick_dist_run(tmp_path, "agreement_gpt2_124m", "--ranks", "2")
    step = entry["results"]["step"]
    assert entry["ranks"] == 2 and entry["matrices"] == 48
    assert step["ratio"] == pytest.approx(step["median_ms"] / step["without_ms"])
    assert step["riding_ratio"] == pytest.approx(step["riding_ms"] / step["without_ms"])
    assert step["riding_agreements"] == 1 and step["riding_agreement_bytes"] == 64  # (it rode: one header sent)
    assert all(step[k] > 0 for k in ("noise_ratio", "agreement_ms", "host_ms", "host_ms_many", "first_chunk_copy_ms"))
    assert "<!-- section: agreement: " in text
