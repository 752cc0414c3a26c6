"""Loads the compiled operator library (``_C.so``) into ``torch.ops.megatron_eopt``.

Both libraries use only the LibTorch stable ABI (compiled for the stable-ABI version of their
torch floor, 2.11 by default), so one build loads on that torch and every later one; an older
torch lacks the stable C functions they call and cannot load them.

A checkout imported from its own directory (``python3 -m pytest`` run there) shadows the installed
package; when it has no library built in place, it loads the installed package's libraries and
warns if they were built from other C++ sources than the checkout's (docs/development.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import sys
import warnings

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# The file next to an installed library that lists the C++ sources it was built from
# (cmake/SourceManifest.cmake writes it; source_manifest() computes the same lines).
_SOURCES_FILE = "_C_sources.sha256"
_SOURCE_DIRS, _SOURCE_EXTENSIONS = ("csrc", "cmake"), (".cpp", ".h", ".cu", ".cuh", ".cmake")


def _op_libraries(directory: str) -> list[str]:
    return [p for p in sorted(glob.glob(os.path.join(directory, "_C*.so")))
            if not os.path.basename(p).startswith("_C_cuda")]


def _installed_package_dir() -> str | None:
    """The first other ``megatron_eopt`` on sys.path with a compiled library: the installed package
    that a checkout shadows when Python runs from it (``python3 -m pytest`` puts the working
    directory first on sys.path)."""
    here = os.path.realpath(_HERE)
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "megatron_eopt")
        if os.path.realpath(candidate) != here and _op_libraries(candidate):
            return candidate
    return None


def source_manifest(root: str) -> dict[str, str]:
    """``{path: sha256}`` of the C++ sources a build compiles, for the checkout at ``root``: every
    .cpp/.h/.cu/.cuh/.cmake file under csrc/ and cmake/, and CMakeLists.txt (paths relative to
    ``root``, with "/")."""
    paths = ["CMakeLists.txt"]
    for top in _SOURCE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            paths += [os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                      for f in files if f.endswith(_SOURCE_EXTENSIONS)]
    out = {}
    for path in sorted(paths):
        with open(os.path.join(root, path), "rb") as f:
            out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


def _sources_differing(library_dir: str, root: str) -> list[str] | None:
    """The C++ source files of the checkout at ``root`` that differ from (or are missing in, or were
    added since) those the library in ``library_dir`` was built from; None when the library does not
    record its sources (a build older than the record)."""
    recorded_file = os.path.join(library_dir, _SOURCES_FILE)
    if not os.path.isfile(recorded_file):
        return None
    recorded = {}
    with open(recorded_file) as f:
        for line in f:
            digest, _, path = line.rstrip("\n").partition("  ")
            recorded[path] = digest
    current = source_manifest(root)
    return sorted(p for p in recorded.keys() | current.keys() if recorded.get(p) != current.get(p))


def _find_library() -> str:
    """``_C.so`` next to this file; in a checkout that has none (nothing built in place), the installed
    package's, with a warning when the checkout's C++ sources differ from those it was built from."""
    candidates = _op_libraries(_HERE)
    if candidates:
        return candidates[0]
    installed = _installed_package_dir()
    if installed is None:
        raise ImportError(
            f"megatron_eopt: the compiled library _C.so is missing next to {_HERE}, and no installed "
            "megatron_eopt on sys.path has one; install the package with `pip install --no-build-isolation .` "
            "(docs/development.md)"
        )
    root = os.path.dirname(_HERE)
    if os.path.isfile(os.path.join(root, "CMakeLists.txt")) and os.path.isdir(os.path.join(root, "csrc")):
        differing = _sources_differing(installed, root)
        if differing:
            shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
            warnings.warn(
                f"megatron_eopt: the checkout {root} has no compiled library of its own and loads the installed "
                f"one from {installed}, which was built from other C++ sources ({shown} "
                f"{'differs' if len(differing) == 1 else 'differ'}): its ops may not "
                "match this checkout's Python code. Rebuild it with `pip install --no-build-isolation .`, "
                "or build one in place (docs/development.md).",
                RuntimeWarning, stacklevel=3,
            )
    return _op_libraries(installed)[0]

def _load_op_library(path: str) -> ctypes.CDLL:
    try:
        torch.ops.load_library(path)
    except OSError as e:
        raise ImportError(
            f"megatron_eopt: {os.path.basename(path)} does not load into torch {torch.__version__} ({e}). "
            "The package needs a torch at least as new as the stable-ABI floor it was built for "
            "(2.11 for the released wheels); install a newer torch or rebuild the package against this one."
        ) from e
    cdll = ctypes.CDLL(path)
    cdll.megatron_eopt_torch_version_built.restype = ctypes.c_char_p
    cdll.megatron_eopt_torch_floor.restype = ctypes.c_char_p
    return cdll


LIBRARY_PATH = _find_library()
# Where both libraries come from: this package, or the installed one a checkout shadows.
LIBRARY_DIR = os.path.dirname(LIBRARY_PATH)
_cdll = _load_op_library(LIBRARY_PATH)


def _cuda_library_candidates() -> list[tuple[int, str]]:
    """The CUDA libraries next to _C.so: (CUDA major version they were built for, path)."""
    found = []
    for path in sorted(glob.glob(os.path.join(LIBRARY_DIR, "_C_cuda*.so"))):
        digits = os.path.basename(path)[len("_C_cuda") :].split(".")[0]
        if digits.isdigit():
            found.append((int(digits), path))
    return found


def load_cuda_kernels(candidates=None, torch_cuda: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """Loads the CUDA kernels when the running torch can host them: (its handle or None, why).

    The library is loaded only when torch was built with CUDA of the major version the kernels
    were built for; otherwise (a CPU-only torch, another CUDA major, a missing CUDA library) the
    CPU ops keep working and the reason is returned (and warned about once at import).
    """
    candidates = _cuda_library_candidates() if candidates is None else candidates
    if not candidates:
        return None, "this build has no CUDA kernels (nvcc was not found, or MEGATRON_EOPT_CUDA=OFF, at build time)"
    if torch_cuda is None:
        return None, (f"torch {torch.__version__} is a CPU-only build; the CUDA kernels (built for CUDA "
                      f"{', '.join(str(m) for m, _ in candidates)}) are not loaded")
    major = int(str(torch_cuda).split(".")[0])
    match = [path for m, path in candidates if m == major]
    if not match:
        return None, (f"torch {torch.__version__} uses CUDA {torch_cuda}, but the CUDA kernels were built for CUDA "
                      f"{', '.join(str(m) for m, _ in candidates)}; rebuild the package against this torch")
    try:
        handle = ctypes.CDLL(match[0])  # resolves libcublas etc. first: a failure leaves no half-registered ops
        torch.ops.load_library(match[0])
    except OSError as e:
        return None, f"the CUDA kernels could not be loaded ({e}); the CPU ops work"
    return handle, "loaded"


_cuda_cdll, CUDA_KERNELS_STATUS = load_cuda_kernels(torch_cuda=torch.version.cuda)
if _cuda_cdll is None and _cuda_library_candidates():
    warnings.warn(f"megatron_eopt: {CUDA_KERNELS_STATUS}", RuntimeWarning, stacklevel=2)
if _cuda_cdll is not None:
    _cuda_cdll.megatron_eopt_cuda_archs_built.restype = ctypes.c_char_p
    _cuda_cdll.megatron_eopt_cuda_version_built.restype = ctypes.c_int


def gemm_counts() -> tuple[int, int]:
    """(cuBLASLt GEMMs, cuBLAS fallback GEMMs) the CUDA kernels have run in this process."""
    if _cuda_cdll is None:
        return 0, 0
    lt, fallback = ctypes.c_int64(), ctypes.c_int64()
    _cuda_cdll.megatron_eopt_gemm_counts(ctypes.byref(lt), ctypes.byref(fallback))
    return lt.value, fallback.value


@contextlib.contextmanager
def forced_blas_fallback():
    """Within the block, every Newton-Schulz GEMM on CUDA runs through the cuBLAS fallback that
    serves the problems cuBLASLt has no algorithm for (a self-test of that path)."""
    if _cuda_cdll is None:
        raise RuntimeError(f"the CUDA kernels are not loaded: {CUDA_KERNELS_STATUS}")
    _cuda_cdll.megatron_eopt_force_blas_fallback(1)
    try:
        yield
    finally:
        _cuda_cdll.megatron_eopt_force_blas_fallback(0)


def cuda_symmetric_products() -> tuple[int, int] | None:
    """The rule the CUDA Newton–Schulz op follows for its products with a symmetric result, as set by
    :func:`set_cuda_symmetric_products`: ``(max_blocks, min_panel)``, or None for the measured
    default (the initial state)."""
    if _cuda_cdll is None:
        return None
    blocks, panel = ctypes.c_int64(), ctypes.c_int64()
    _cuda_cdll.megatron_eopt_symmetric_panels(ctypes.byref(blocks), ctypes.byref(panel))
    return None if blocks.value == 0 else (blocks.value, panel.value)


def set_cuda_symmetric_products(max_blocks: int | None, min_panel: int = 1024) -> None:
    """Process-wide: how the CUDA Newton–Schulz op computes the products whose result is symmetric
    (X·Xᵀ and G·G of the standard iteration, X·Xᵀ and every s×s product of the Gram iteration): as
    their lower block triangle, one cuBLASLt GEMM per block column, plus a mirror copy, or as full
    GEMMs. With ``max_blocks`` k, a side of ``s`` gets ``min(k, s // min_panel)`` blocks (panels are
    multiples of 64; 4 blocks multiply 62.5% of the full FLOPs, 8 blocks 56%); ``max_blocks=1``
    runs full GEMMs everywhere. ``None`` returns to the default, which uses blocks only where an
    H100 measured them faster: bf16 products ("medium") on a side of at least 8192, or of at least
    4096 in a batch of at least 4 (``docs/newton-schulz.md``). Results equal the full products'
    within rounding (each panel is another GEMM kernel)."""
    if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1):
        raise ValueError(f"set_cuda_symmetric_products: max_blocks must be None or an int >= 1, got {max_blocks!r}")
    if isinstance(min_panel, bool) or not isinstance(min_panel, int) or min_panel < 64:
        raise ValueError(f"set_cuda_symmetric_products: min_panel must be an int >= 64, got {min_panel!r}")
    if _cuda_cdll is None:
        raise RuntimeError(f"set_cuda_symmetric_products: the CUDA kernels are not loaded: {CUDA_KERNELS_STATUS}")
    _cuda_cdll.megatron_eopt_set_symmetric_panels(ctypes.c_int64(max_blocks or 0), ctypes.c_int64(min_panel))


_CPU_BF16_PRODUCTS = ("auto", "bf16", "fp32")
_CPU_SYMMETRIC_PRODUCTS = ("auto", "kernel", "gemm", "panels", "full")


def _check_environment(name: str, allowed: tuple[str, ...]) -> None:
    # The library reads these at load; a value it does not know would silently mean "auto".
    value = os.environ.get(name)
    if value is not None and value not in allowed:
        raise ValueError(f"megatron_eopt: environment variable {name} must be one of {allowed}, got {value!r}")


_check_environment("MEGATRON_EOPT_CPU_BF16_PRODUCTS", _CPU_BF16_PRODUCTS)
_check_environment("MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS", _CPU_SYMMETRIC_PRODUCTS)


def set_cpu_bf16_products(mode: str) -> None:
    """Process-wide: how the CPU Newton–Schulz computes the bf16 products of "medium". ``"bf16"``:
    ATen's bf16 GEMMs (oneDNN: fast on CPUs with AVX512-BF16 or AMX, a slow fallback elsewhere);
    ``"fp32"``: fp32 GEMMs of the same bf16 values, each result rounded to bf16 where the bf16 GEMM
    stores it. Both are bf16 products with fp32 accumulation and differ by summation order only.
    ``"auto"`` (the initial setting, unless the environment variable
    ``MEGATRON_EOPT_CPU_BF16_PRODUCTS`` names another): whichever :func:`cpu_product_plan` measured
    faster on this CPU; ``"fp32"`` without bf16 instructions."""
    if mode not in _CPU_BF16_PRODUCTS:
        raise ValueError(f"set_cpu_bf16_products: mode must be one of {_CPU_BF16_PRODUCTS}, got {mode!r}")
    _cdll.megatron_eopt_set_cpu_bf16_products(ctypes.c_int(_CPU_BF16_PRODUCTS.index(mode)))


def cpu_bf16_products(side: int = 2048) -> dict:
    """The setting of :func:`set_cpu_bf16_products` (``"mode"``), whether this CPU has bf16 GEMM
    instructions (``"bf16_instructions"``), and what "medium" runs now for a Gram side of ``side``
    (``"products"``: ``"bf16"`` or ``"fp32"``)."""
    mode, instructions = ctypes.c_int(), ctypes.c_int()
    _cdll.megatron_eopt_cpu_bf16_products(ctypes.byref(mode), ctypes.byref(instructions))
    setting = _CPU_BF16_PRODUCTS[mode.value]
    if setting == "auto" and not instructions.value:
        uses = "fp32"  # nothing to measure
    else:
        uses = setting if setting != "auto" else cpu_product_plan(side)["in_use"]["medium"]
    return {"mode": setting, "bf16_instructions": bool(instructions.value), "products": uses}


def set_cpu_symmetric_products(mode: str) -> None:
    """Process-wide: how the CPU Newton–Schulz forms its products with a symmetric result (W·Wᵀ and
    G·G of the standard iteration, R and R·R of the Gram iteration). ``"kernel"``: the package's
    AVX-512 kernel, which multiplies only the upper triangle (where this CPU has AVX-512; ATen's
    GEMMs otherwise); ``"gemm"``: ATen's GEMMs, the portable path every CPU runs, on the lower column
    panels of a side of at least 512 or as one full GEMM, whichever measured faster (``"panels"``
    and ``"full"`` pin one); ``"auto"`` (the initial setting, unless the environment variable
    ``MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS`` names another): whichever :func:`cpu_product_plan`
    measured faster on this CPU. Results differ by summation order only."""
    if mode not in _CPU_SYMMETRIC_PRODUCTS:
        raise ValueError(f"set_cpu_symmetric_products: mode must be one of {_CPU_SYMMETRIC_PRODUCTS}, got {mode!r}")
    _cdll.megatron_eopt_set_cpu_symmetric_products(ctypes.c_int(_CPU_SYMMETRIC_PRODUCTS.index(mode)))


def cpu_symmetric_products(side: int = 2048) -> dict:
    """Whether the CPU forms the Newton–Schulz products W·Wᵀ and G·G of a Gram side ``side`` on the
    package's AVX-512 kernel (half the multiply-adds, a packed copy of the operand as scratch) or
    on ATen's GEMMs: ``{"fp32": bool, "bf16": bool}`` for fp32 and bf16 values, with the settings
    applied; ``"available"``: where the kernel can run on this CPU (x86-64 with AVX-512 F/BW/VL, and
    AVX512-BF16 for bf16); ``"mode"``: the setting of :func:`set_cpu_symmetric_products`."""
    fp32, bf16 = ctypes.c_int(), ctypes.c_int()
    _cdll.megatron_eopt_cpu_syrk_kernel(ctypes.byref(fp32), ctypes.byref(bf16))
    mode = _CPU_SYMMETRIC_PRODUCTS[_cdll.megatron_eopt_cpu_symmetric_products_setting()]
    available = {"fp32": bool(fp32.value), "bf16": bool(bf16.value)}
    if not (available["fp32"] or available["bf16"]):
        in_use = {"fp32": False, "bf16": False}  # nothing to measure
    else:
        plan = cpu_product_plan(side)["in_use"]
        in_use = {"fp32": plan["symmetric_fp32"] == "kernel", "bf16": plan["symmetric_bf16"] == "kernel"}
    return {**in_use, "available": available, "mode": mode}


_cdll.megatron_eopt_cpu_product_plan_fields.restype = ctypes.c_char_p
_cdll.megatron_eopt_cpu_product_plan_fields.argtypes = [ctypes.c_int]
# The names of cpu_product_plan's seconds, choices and in-use entries, as the library lays them out.
_PLAN_FIELDS = tuple(_cdll.megatron_eopt_cpu_product_plan_fields(i).decode().split(",") for i in range(3))
_cdll.megatron_eopt_cpu_product_plan.restype = ctypes.c_int
_cdll.megatron_eopt_cpu_product_plan.argtypes = [
    ctypes.c_int64,
    ctypes.POINTER(ctypes.c_int64),
    ctypes.POINTER(ctypes.c_int64),
    ctypes.POINTER(ctypes.c_double),
    ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_int64),
    ctypes.POINTER(ctypes.c_double),
    ctypes.c_char_p,
    ctypes.c_int64,
]
# What each choice's flag means (True, False).
_CHOICE_WORDS = {"symmetric_fp32": ("kernel", "gemm"), "symmetric_bf16": ("kernel", "gemm"), "medium": ("bf16", "fp32"),
                 "gemm_fp32": ("panels", "full"), "gemm_bf16": ("panels", "full")}


def cpu_product_plan(side: int = 2048) -> dict:
    """How the CPU Newton–Schulz computes its products for a Gram (short) side of ``side``, as
    measured on this CPU: the first call of a size class (sides below 384, 384 to 1535, and from
    1536 on) times each candidate on a probe of that class and the process keeps the result.

    Returns ``probe`` (the probe X's shape; the general product is a square matrix times X, the
    symmetric one X·Xᵀ), ``ms`` (the best time of each candidate, None where it cannot run here:
    ``fp32_general``, ``fp32_full`` (X·Xᵀ as one GEMM), ``fp32_panels`` (as GEMMs on its lower column
    panels), ``fp32_kernel`` and the same for bf16, where bf16 GEMM instructions exist), ``measured``
    (the faster of each choice: ``symmetric_fp32`` and ``symmetric_bf16`` ``"kernel"`` or
    ``"gemm"``, ``gemm_fp32`` and ``gemm_bf16`` ``"panels"`` or ``"full"``, ``medium`` ``"bf16"`` or
    ``"fp32"`` products),
    ``in_use`` (the same with :func:`set_cpu_symmetric_products` and :func:`set_cpu_bf16_products`
    applied) and ``bf16_speedup`` (how many times faster "medium"'s step products are in bf16 GEMMs
    than in fp32 ones: the weight of the Gram iteration's fp32 products in ``algorithm="auto"``)."""
    probe, depth = ctypes.c_int64(), ctypes.c_int64()
    names, choice_names, in_use_names = _PLAN_FIELDS
    seconds = (ctypes.c_double * len(names))()
    choices, in_use = (ctypes.c_int * len(choice_names))(), (ctypes.c_int * len(in_use_names))()
    sizes = (ctypes.c_int64 * 3)(*map(len, _PLAN_FIELDS))
    speedup = ctypes.c_double()
    error = ctypes.create_string_buffer(512)
    code = _cdll.megatron_eopt_cpu_product_plan(int(side), ctypes.byref(probe), ctypes.byref(depth), seconds,
                                                choices, in_use, sizes, ctypes.byref(speedup), error, len(error))
    if code != 0:
        raise RuntimeError(f"cpu_product_plan: the measurement failed: {error.value.decode()}")

    def described(fields, flags):
        return {name: _CHOICE_WORDS[name][0 if flag else 1] for name, flag in zip(fields, flags)}

    measured = described(choice_names, choices)

    return {
        "probe": (probe.value, depth.value),
        "ms": {k: (v * 1e3 if v > 0 else None) for k, v in zip(names, seconds)},
        "measured": measured,
        "in_use": described(in_use_names, in_use),
        "bf16_speedup": speedup.value,
    }


def cuda_kernels_built() -> bool:
    """True when the CUDA kernels are loaded (built, and compatible with the running torch);
    ``CUDA_KERNELS_STATUS`` says why not otherwise."""
    return _cuda_cdll is not None


def build_info() -> dict:
    """What the libraries were compiled against: torch version (``torch``, the headers) and the oldest
    torch they load on (``torch_floor``, their stable-ABI target), CUDA runtime version and CMake's
    CUDA architecture list of the loaded CUDA kernels (e.g. ``["80-real", "90-real", "100"]``:
    machine code for each, PTX for the last one, which newer GPUs compile at load time; None and
    [] without them), and ``cuda_status``: why the kernels are or are not loaded."""
    cuda = _cuda_cdll.megatron_eopt_cuda_version_built() if _cuda_cdll is not None else 0
    archs = _cuda_cdll.megatron_eopt_cuda_archs_built().decode() if _cuda_cdll is not None else ""
    return {
        "torch": _cdll.megatron_eopt_torch_version_built().decode(),
        "torch_floor": _cdll.megatron_eopt_torch_floor().decode(),
        "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
        "cuda_archs": [a for a in archs.split(",") if a],
        "cuda_status": CUDA_KERNELS_STATUS,
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
