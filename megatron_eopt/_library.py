"""Loads the compiled operator library (``_C.so``) into ``torch.ops.megatron_eopt``."""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_library() -> str:
    candidates = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    if not candidates:
        raise ImportError(
            "megatron_eopt: the compiled library _C.so is missing next to "
            f"{_HERE}; install the package with `pip install --no-build-isolation .`"
        )
    return candidates[0]


LIBRARY_PATH = _find_library()
torch.ops.load_library(LIBRARY_PATH)
_cdll = ctypes.CDLL(LIBRARY_PATH)


def cuda_kernels_built() -> bool:
    """True when the library was compiled with its CUDA kernels (nvcc was found at build time)."""
    return bool(_cdll.megatron_eopt_cuda_kernels_built())


_cdll.megatron_eopt_torch_version_built.restype = ctypes.c_char_p
_cdll.megatron_eopt_cuda_archs_built.restype = ctypes.c_char_p
_cdll.megatron_eopt_cuda_version_built.restype = ctypes.c_int


def build_info() -> dict:
    """What the library was compiled against: torch version, CUDA runtime version (None for a
    CPU-only build) and CMake's CUDA architecture list (e.g. ``["80-real", "90-real", "100"]``:
    machine code for each, PTX for the last one, which newer GPUs compile at load time)."""
    cuda = _cdll.megatron_eopt_cuda_version_built()
    archs = _cdll.megatron_eopt_cuda_archs_built().decode()
    return {
        "torch": _cdll.megatron_eopt_torch_version_built().decode(),
        "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
        "cuda_archs": [a for a in archs.split(",") if a],
    }


_PRECISIONS = {"medium": 0, "high": 1, "highest": 2}
_ALGORITHMS = {"auto": 0, "standard": 1, "gram": 2}
_cdll.megatron_eopt_ns_plan.restype = ctypes.c_int
_cdll.megatron_eopt_ns_plan.argtypes = [
    ctypes.POINTER(ctypes.c_double), ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int8),
]


def ns_plan(
    coefficients: tuple[float, ...], steps: int, repeat_last: bool, m: int, n: int, transpose: bool,
    precision: str, algorithm: str, device_type: str,
) -> tuple[bool, tuple[bool, ...]]:
    """The fused op's Newton–Schulz choice for one (m, n) matrix: (use the Gram iteration, its
    restart flags per step). ``coefficients`` is the flattened (a, b, c) table."""
    values = (ctypes.c_double * len(coefficients))(*coefficients)
    restart = (ctypes.c_int8 * steps)()
    code = _cdll.megatron_eopt_ns_plan(
        values, len(coefficients), steps, int(repeat_last), m, n, int(transpose), _PRECISIONS[precision],
        _ALGORITHMS[algorithm], 1 if device_type == "cuda" else 0, restart,
    )
    if code < 0:
        raise ValueError("invalid Newton–Schulz arguments")
    return bool(code), tuple(bool(v) for v in restart)
