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
