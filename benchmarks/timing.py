"""How a workload is timed.

Every implementation of a workload is built first, called once untimed (compilation, lazy
optimizer state), warmed up, then timed call by call; the reported figure is the median call.

- CUDA: each call is bracketed by CUDA events on the current stream (one sync per block), so a
  host-bound implementation pays for its launch gaps and a device-bound one is timed on the GPU.
  Inputs rotate over enough copies to exceed twice the L2 cache, so small shapes are not
  flattered by a warm cache. Memory: torch.cuda.max_memory_allocated() around each call.
- CPU: wall clock (perf_counter) per call, implementations interleaved call by call so that load
  from other processes on a shared machine hits them all alike. Every implementation runs the same
  number of rounds (the most any one's time target asks for), so that all medians come from the
  same stretch of time: with fewer rounds for the slower ones, the faster ones' last calls would
  meet load the others never saw. Memory is not measured on the CPU (tracemalloc does not see
  tensor storage and RSS deltas depend on the allocator's caching).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CPU_CACHE_BYTES = 64 * 2**20  # a generous last-level cache for the rotation rule on CPUs


@dataclass
class Impl:
    """One implementation of a workload: ``make()`` builds a callable that runs one call on an input."""

    name: str
    make: Callable[[], Callable[[Any], Any]]
    is_ours: bool = False
    flops: float | None = None  # per call, by this implementation's algorithm (default: the case's)


@dataclass
class Case:
    """A built workload: its inputs (rotated between calls), implementations and amount of work."""

    name: str
    kind: str  # "ns" | "memory" | "step"
    description: str
    inputs: list[Any]
    impls: list[Impl]
    prepare: Callable[[Any], None] | None = None  # untimed, before each call (e.g. installs grads)
    flops: float | None = None  # per call, for TFLOP/s
    bytes_moved: float | None = None  # per call, for GB/s
    skipped: dict[str, str] = field(default_factory=dict)  # impl name -> why it is not measured
    parity: Callable[[], dict[str, float]] | None = None  # rel. difference of each peer vs ours
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    warmup: int
    min_repeats: int
    max_repeats: int
    target_s: float  # timed seconds per implementation, which sets the repeat count


def plan_for(device: torch.device, quick: bool) -> Plan:
    if quick:
        return Plan(warmup=1, min_repeats=2, max_repeats=3, target_s=0.05)
    if device.type == "cuda":
        return Plan(warmup=3, min_repeats=10, max_repeats=200, target_s=1.0)
    return Plan(warmup=1, min_repeats=3, max_repeats=15, target_s=4.0)


def rotation_count(set_bytes: int, device: torch.device, free_bytes_budget: int | None = None) -> int:
    """Copies of an input set so that one pass over them exceeds twice the (L2 / LLC) cache."""
    if device.type == "cuda":
        cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    else:
        cache = CPU_CACHE_BYTES
    copies = max(1, math.ceil(2 * cache / max(set_bytes, 1)))
    copies = min(copies, 16)
    if free_bytes_budget is not None:
        copies = max(1, min(copies, free_bytes_budget // max(set_bytes, 1)))
    return copies


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(case: Case, plan: Plan, device: torch.device) -> dict[str, dict]:
    """Times every implementation of ``case``; returns name -> result (or error) dicts."""
    results: dict[str, dict] = {}
    fns: dict[str, Callable[[Any], Any]] = {}
    inputs = case.inputs
    prepare = case.prepare or (lambda _inp: None)

    def call(fn, i):
        inp = inputs[i % len(inputs)]
        prepare(inp)
        fn(inp)

    estimates: dict[str, float] = {}
    impl_flops = {impl.name: impl.flops if impl.flops is not None else case.flops for impl in case.impls}
    for impl in case.impls:
        try:
            # Earlier implementations' garbage is freed first, so it cannot be counted against
            # this one (a collection during its first call made the difference negative).
            _release(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            fn = impl.make()
            call(fn, 0)  # compilation, lazy state: never timed
            _sync(device)
            # What the first call left allocated: the implementation's state. A first call that
            # frees memory allocated before it (an input it replaces) keeps nothing: 0.
            state_bytes = max(0, torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else None
            start = time.perf_counter()
            for w in range(plan.warmup):
                call(fn, w + 1)
            _sync(device)
            estimates[impl.name] = (time.perf_counter() - start) / max(plan.warmup, 1)
            fns[impl.name] = fn
            results[impl.name] = {"state_mib": None if state_bytes is None else state_bytes / 2**20}
        except Exception as exc:  # an implementation failing must not stop the others
            results[impl.name] = {"error": _short_error(exc), "traceback": traceback.format_exc(limit=4)}
            _release(device)

    repeats = {
        name: int(min(plan.max_repeats, max(plan.min_repeats, plan.target_s / max(est, 1e-9))))
        for name, est in estimates.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in fns}
    workspace: dict[str, float] = {}

    if device.type == "cuda":
        for name, fn in fns.items():
            try:
                peak_extra = 0
                events = []
                for r in range(repeats[name]):
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    inp = inputs[r % len(inputs)]
                    prepare(inp)
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    fn(inp)
                    end.record()
                    events.append((begin, end))
                    peak_extra = max(peak_extra, torch.cuda.max_memory_allocated(device) - base)
                torch.cuda.synchronize(device)
                samples[name] = [b.elapsed_time(e) / 1e3 for b, e in events]
                workspace[name] = peak_extra / 2**20
            except Exception as exc:
                results[name] = {"error": _short_error(exc), "traceback": traceback.format_exc(limit=4)}
                _release(device)
    else:
        for r in range(max(repeats.values(), default=0)):
            for name, fn in fns.items():
                if "error" in results[name]:
                    continue
                try:
                    inp = inputs[r % len(inputs)]
                    prepare(inp)
                    start = time.perf_counter()
                    fn(inp)
                    samples[name].append(time.perf_counter() - start)
                except Exception as exc:
                    results[name] = {"error": _short_error(exc), "traceback": traceback.format_exc(limit=4)}

    for name in fns:
        if "error" in results[name] or not samples[name]:
            continue
        ts = sorted(samples[name])
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0], ts[0], ts[0]]
        entry = results[name]
        entry.update(
            median_ms=statistics.median(ts) * 1e3,
            p25_ms=q[0] * 1e3,
            p75_ms=q[2] * 1e3,
            repeats=len(ts),
            samples_ms=[round(t * 1e3, 4) for t in samples[name]],
        )
        if device.type == "cuda":
            entry["peak_mib"] = (entry.get("state_mib") or 0.0) + workspace.get(name, 0.0)
        seconds = entry["median_ms"] / 1e3
        if impl_flops.get(name):
            entry["flops"] = impl_flops[name]
            entry["tflops"] = impl_flops[name] / seconds / 1e12
        if case.bytes_moved:
            entry["gbps"] = case.bytes_moved / seconds / 1e9
    fns.clear()
    _release(device)
    return results
