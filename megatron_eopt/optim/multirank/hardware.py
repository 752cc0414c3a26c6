"""Hardware profiles of the cost model (``multirank.cost_model``): Newton–Schulz throughput and link
bandwidths per device. ``replica_work="auto"``, tp_mode "auto" and the planner (``megatron_eopt.plan``)
price a step on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hardware:
    """A device profile. ``tflops``: sustained dense TFLOP/s of Newton–Schulz per precision on large
    matrices; ``half_gflop``: the per-matrix GFLOP at which half of it is reached; bandwidths in GB/s
    per device and direction (``nvlink_gbps`` within a node, ``network_gbps`` across nodes);
    ``latency_us`` per collective."""

    name: str
    tflops: dict
    half_gflop: float
    nvlink_gbps: float
    network_gbps: float
    latency_us: float
    gpus_per_node: int = 8


# H100: 685 TFLOP/s measured for Newton–Schulz in "medium" on 4096² and 8192² matrices and 177 at
# 1024² (benchmarks/RESULTS.md), which fits 700 TFLOP/s with half efficiency at 95 GFLOP; "high"
# and "highest" scaled by the data sheet's TF32 / FP32 over BF16. H200: the same compute. B200:
# the data sheet's ratio to H100 (not measured). Links: NVLink 4 (450 GB/s a direction), NVLink 5
# (900), one 400 / 800 Gb/s NIC per GPU.
# CPU: one core per rank over gloo on one host (TCP loopback), as the suite and the CPU benchmarks
# run it; measured on a 2-core Xeon (AVX-512, AMX-BF16), one thread: Newton–Schulz of square
# matrices 192² to 1536² at 0.34 to 1.23 TFLOP/s in "medium", 0.15 to 0.21 in fp32 (CPU "high" is
# fp32), fitted as 1.3 / 0.21 with half efficiency at 0.5 GFLOP; an all-to-all between two ranks:
# 0.5 ms for a few bytes, 0.73 GB/s for 4 MiB.
HARDWARE = {
    "H100": Hardware("H100 SXM", {"medium": 700.0, "high": 350.0, "highest": 47.0}, 95.0, 450.0, 50.0, 20.0),
    "H200": Hardware("H200 SXM", {"medium": 700.0, "high": 350.0, "highest": 47.0}, 95.0, 450.0, 50.0, 20.0),
    "B200": Hardware("B200", {"medium": 1590.0, "high": 780.0, "highest": 57.0}, 95.0, 900.0, 100.0, 20.0),
    "CPU": Hardware("CPU core, gloo", {"medium": 1.3, "high": 0.21, "highest": 0.21}, 0.5, 0.73, 0.73, 500.0, 1 << 30),
}


def hardware_of(device: torch.device) -> Hardware:
    """The profile of ``device``: its GPU's by name (an unknown GPU as the H100), the CPU's for the CPU."""
    if device.type != "cuda":
        return HARDWARE["CPU"]
    name = torch.cuda.get_device_name(device).upper()
    for key in ("B200", "H200", "H100"):
        if key in name:
            return HARDWARE[key]
    return HARDWARE["H100"]
