"""Facts about the machine and the software a benchmark ran with (recorded in JSON and markdown)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """A human name of the device the workloads ran on (GPU model, or CPU model + threads)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} CPU, {torch.get_num_threads()} threads"


def device_key(device: torch.device) -> str:
    """The key of this device's section in RESULTS.md (one section per device model)."""
    return f"{device.type}: {device_name(device)}"


def git_commit() -> str:
    """HEAD of the checkout the benchmark ran from, with "+dirty" when files were modified.

    MEGATRON_EOPT_GIT_COMMIT overrides it (a copy of the tree without .git, e.g. on a GPU machine).
    """
    if os.environ.get("MEGATRON_EOPT_GIT_COMMIT"):
        return os.environ["MEGATRON_EOPT_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed (or installed as a plain path without metadata)
        return None


def collect(device: torch.device) -> dict:
    """Everything needed to reproduce or judge a result table."""
    import megatron_eopt

    info = {
        "device": device.type,
        "device_name": device_name(device),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "megatron_eopt_path": os.path.dirname(megatron_eopt.__file__),
        "megatron_eopt_cuda_kernels": megatron_eopt.cuda_kernels_built(),
        "emerging_optimizers": _package_version("emerging-optimizers"),
        "torch_threads": torch.get_num_threads(),
        "hostname_cpus": os.cpu_count(),
        "argv": sys.argv[1:],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_l2_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
        info["gpu_sm_count"] = props.multi_processor_count
    else:
        # A shared CPU machine: the load says how much the numbers can be trusted.
        info["load_average_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
    return info
