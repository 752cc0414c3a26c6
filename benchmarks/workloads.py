"""The catalogue of workloads: what each measures, where it is feasible, and its quick (tiny) form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import hyper
import param_sets
import workloads_memory
import workloads_ns
import workloads_family
import workloads_step
from timing import Case

QUICK_SHRINK = 32  # --quick divides every matrix dimension by this (keeps every code path, little work)


@dataclass
class Workload:
    name: str
    kind: str
    build: Callable[[torch.device, bool], Case]
    in_quick: bool = False  # part of the default --quick set
    cpu_skip: str | None = None  # why a full CPU run leaves it out (None: it runs on the CPU)
    ops: tuple[str, ...] = ()  # the megatron_eopt ops it times directly


def _shrink(shapes: list[tuple[int, int]], quick: bool) -> list[tuple[int, int]]:
    if not quick:
        return shapes
    return [(max(4, m // QUICK_SHRINK), max(4, n // QUICK_SHRINK)) for m, n in shapes]


def _tflop(shapes) -> str:
    return f"{sum(hyper.ns_flops(m, n) for m, n in shapes) / 1e12:.1f} TFLOP per call"


def _ns_single(m: int, n: int, *, in_quick=False, cpu_skip=None) -> Workload:
    name = f"ns_{m}x{n}"

    def build(device, quick):
        shapes = _shrink([(m, n)], quick)
        return workloads_ns.build_ns_case(name, f"NS on one {shapes[0][0]}x{shapes[0][1]} matrix", shapes, "single", device)

    return Workload(name, "ns", build, in_quick, cpu_skip, ("newton_schulz",))


def _ns_batch(batch: int, m: int, n: int, *, in_quick=False, cpu_skip=None, what="") -> Workload:
    name = f"ns_batch_{batch}x{m}x{n}"

    def build(device, quick):
        (sm, sn), = _shrink([(m, n)], quick)
        desc = f"NS on a batch of {batch} {sm}x{sn} matrices{what}"
        return workloads_ns.build_ns_case(name, desc, [(sm, sn)] * batch, "batch", device)

    return Workload(name, "ns", build, in_quick, cpu_skip, ("newton_schulz",))


def _ns_list(label: str, shapes_fn, *, in_quick=False, cpu_skip=None) -> Workload:
    name = f"ns_list_{label}"

    def build(device, quick):
        shapes = _shrink(shapes_fn(), quick)
        desc = f"NS over {label}'s {len(shapes)} hidden matrices (mixed shapes, list op)"
        return workloads_ns.build_ns_case(name, desc, shapes, "list", device)

    return Workload(name, "ns", build, in_quick, cpu_skip, ("newton_schulz_list",))


def _ns_split(label: str, sizes: list[int], groups: int, n: int, what: str, *, in_quick=False, cpu_skip=None):
    name = f"ns_split_{label}"

    def build(device, quick):
        part_sizes = [max(1, s // QUICK_SHRINK) for s in sizes] if quick else sizes
        cols = max(4, n // QUICK_SHRINK) if quick else n
        rows = groups * sum(part_sizes)
        desc = f"split NS of a fused {rows}x{cols} {what}: {groups} groups of {part_sizes}"
        return workloads_ns.build_ns_case(name, desc, [(rows, cols)], "split", device, split=(part_sizes, groups))

    return Workload(name, "ns", build, in_quick, cpu_skip, ("newton_schulz_split",))


def _step(label: str, shapes_fn, description: str, *, in_quick=False, cpu_skip=None, adaptive=None) -> Workload:
    name = f"step_{label}"

    def build(device, quick):
        shapes = _shrink(shapes_fn(), quick)
        return workloads_step.build_step_case(name, description, shapes, device, adaptive)

    # The fused step orthogonalizes in place (newton_schulz_; on CUDA once switched on).
    return Workload(name, "step", build, in_quick, cpu_skip, ("newton_schulz_",))


FAMILY = ("Scion", "PolarGrad", "Spel", "MuonHyperball", "Muown", "MOP")


def _family_step(cls_name: str) -> Workload:
    """One step of an EO 0.4 family class on two GPT-2 layers (8 matrices, 14 M params)."""
    name = f"step_{cls_name.lower()}_gpt2_2layers"

    def build(device, quick):
        shapes = _shrink(param_sets.gpt2_124m()[:8], quick)
        return workloads_family.build_family_case(
            name, f"{cls_name} step (EO 0.4 family), two GPT-2 124M layers' hidden matrices", shapes, device, cls_name)

    return Workload(name, "step", build, False, None)


def _has_op(name: str) -> bool:
    import megatron_eopt

    return hasattr(megatron_eopt, name)


def _memory(label: str, op: str, build_case, *, in_quick=False) -> Workload:
    """A memory-bound op over a model's matrices: Llama-1B's on a GPU, GPT-2's on a CPU."""
    name = f"mem_{label}"

    def build(device, quick):
        if device.type == "cuda" and not quick:
            shapes = param_sets.llama_1b()
        else:
            shapes = _shrink(param_sets.gpt2_124m(), quick)
        return build_case(name, shapes, device)

    return Workload(name, "memory", build, in_quick, None, (op,))


def memory_workloads() -> list[Workload]:
    """One workload per memory-bound op this build has (ops still being written are absent)."""
    out = []
    if _has_op("foreach_momentum_"):
        out.append(_memory("foreach_momentum", "foreach_momentum_",
                           lambda n, s, d: workloads_memory.build_momentum_case(n, s, torch.float32, d), in_quick=True))
        out.append(_memory("foreach_momentum_bf16_ns", "foreach_momentum_",
                           lambda n, s, d: workloads_memory.build_momentum_case(n, s, torch.bfloat16, d)))
    if _has_op("foreach_update_"):
        out.append(_memory("foreach_update", "foreach_update_", workloads_memory.build_update_case, in_quick=True))
    for method in ("adamuon", "normuon", "namo"):
        op = f"{method}_normalize_"
        if _has_op(op):
            out.append(_memory(f"{method}_normalize", op,
                               lambda n, s, d, m=method: workloads_memory.build_moment2_case(n, m, s, d), in_quick=True))
    return out


_TOO_SLOW = "too slow for a 2-core CPU"


def catalogue() -> list[Workload]:
    single = [
        # GPT-2 / the demo model's widths, where CPU classes differ most (bf16 GEMMs on AMX tiles,
        # AVX512-BF16 dot products or a scalar fallback).
        _ns_single(256, 768),
        _ns_single(768, 768),
        _ns_single(768, 3072),
        _ns_single(2048, 2048),
        _ns_single(1024, 1024),
        _ns_single(1024, 4096),
        _ns_single(4096, 1024, in_quick=True),
        _ns_single(4096, 4096, cpu_skip=f"{_TOO_SLOW} ({_tflop([(4096, 4096)])})"),
        _ns_single(8192, 8192, cpu_skip=f"{_TOO_SLOW} ({_tflop([(8192, 8192)])})"),
        _ns_single(4096, 11008, cpu_skip=f"{_TOO_SLOW} ({_tflop([(4096, 11008)])})"),
    ]
    batches = [
        _ns_batch(16, 1024, 1024, in_quick=True),
        _ns_batch(8, 1024, 4096),
        _ns_batch(4, 4096, 4096, cpu_skip=f"{_TOO_SLOW} ({_tflop([(4096, 4096)] * 4)})"),
        _ns_batch(128, 768, 2048, what=" (Qwen3-30B-A3B expert gate/up)",
                  cpu_skip=f"{_TOO_SLOW} ({_tflop([(768, 2048)] * 128)})"),
    ]
    lists = [
        _ns_list("gpt2_124m", param_sets.gpt2_124m, in_quick=True,
                 cpu_skip=f"{_TOO_SLOW} ({_tflop(param_sets.gpt2_124m())}); its step_ workload covers it"),
    ]
    splits = []
    if _has_op("newton_schulz_split"):
        splits = [
            _ns_split("qkv_gpt2", [64, 64, 64], 12, 768, "GPT-2 QKV (12 heads)", in_quick=True),
            _ns_split("qkv_llama8b", [512, 128, 128], 8, 4096, "Llama-3-8B QKV (8 query groups)",
                      cpu_skip=f"{_TOO_SLOW} ({_tflop([(4096, 4096), (1024, 4096), (1024, 4096)])})"),
        ]
    steps = [
        _step("gpt2_124m", param_sets.gpt2_124m, "Muon step, GPT-2 124M hidden matrices (85 M params)", in_quick=True),
        _step("demo_gpt", param_sets.demo_gpt, "Muon step, the demo model's 16 hidden matrices (4 layers, d_model 256)"),
        _step("gpt2_layer", param_sets.gpt2_layer, "Muon step, one GPT-2 small decoder layer (7 M params)"),
        _step("llama_1b_layer", param_sets.llama_1b_layer,
              "Muon step, one Llama-3.2-1B decoder layer (61 M params; FFN 8192 x 2048)"),
        _step("qwen3_moe_8experts", param_sets.qwen3_moe_experts,
              "Muon step, Qwen3-30B-A3B MoE layer with 8 of its 128 experts, real shapes (experts 768 x 2048 / "
              "2048 x 768; 64 M params)"),
        _step("llama_1b", param_sets.llama_1b, "Muon step, Llama-3.2-1B hidden matrices (0.97 B params)",
              cpu_skip=f"{_TOO_SLOW} ({_tflop(param_sets.llama_1b())})"),
        _step("llama_8b_4layers", param_sets.llama_8b_layers,
              "Muon step, 4 Llama-3-8B decoder layers (0.87 B params)",
              cpu_skip=f"{_TOO_SLOW} ({_tflop(param_sets.llama_8b_layers())})"),
        _step("qwen3_moe_layer", param_sets.qwen3_moe_layer,
              "Muon step, Qwen3-30B-A3B MoE layer, docs/benchmarks.md shapes: 384 expert matrices 2048x2048 (1.6 B params)",
              cpu_skip=f"{_TOO_SLOW} ({_tflop(param_sets.qwen3_moe_layer())})"),
        _step("qwen3_moe_layer_real", lambda: param_sets.qwen3_moe_layer(expert_rows=768, q_rows=4096),
              "Muon step, Qwen3-30B-A3B MoE layer, real shapes: experts 768x2048 / 2048x768 (0.62 B params)",
              cpu_skip=f"{_TOO_SLOW} ({_tflop(param_sets.qwen3_moe_layer(768, 4096))})"),
    ]
    for method in ("adamuon", "normuon", "namo"):
        steps.append(_step(f"{method}_gpt2_124m", param_sets.gpt2_124m,
                           f"AdaptiveMuon ({method}) step, GPT-2 124M hidden matrices", adaptive=method,
                           in_quick=method == "normuon",
                           cpu_skip=f"{_TOO_SLOW} in addition to step_gpt2_124m (the same NS work; "
                                    f"the {method} normalization alone is mem_{method}_normalize)"))
    family = [_family_step(cls_name) for cls_name in FAMILY]
    return single + batches + lists + splits + memory_workloads() + steps + family


def by_name() -> dict[str, Workload]:
    return {w.name: w for w in catalogue()}
