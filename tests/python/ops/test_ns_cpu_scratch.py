"""The CPU Newton–Schulz op's scratch, measured as the resident peak of one call in a fresh process.

A square fp32 matrix is the case where the standard iteration's s×s products are as large as its
iterates: its scratch is one iterate and P (G lives in the spare iterate's storage while that
iterate is dead), 2 × 16 MiB for 2048×2048, where a dedicated G would make it 48. Each path counts
its own buffers: ATen's GEMMs (the portable path, every CPU) none more; the symmetric kernel (CPUs
with AVX-512) a packed copy of W (16 MiB) and its fp32 partial sums over the 2048-deep products
(8320 tiles x 1 KiB = 8.1 MiB). The upper bound sits between those and a dedicated G, 12 MiB above
them for what else the process touches (a few MiB); the lower one 6 MiB below them (pages of a
buffer the call never touches are not resident). Only memory is asserted.
"""

import os
import subprocess
import sys

import pytest
from paths import BENCHMARKS

sys.path.insert(0, BENCHMARKS)

import step_memory  # noqa: E402
from megatron_eopt._library import cpu_symmetric_products  # noqa: E402

CHILD = r"""
import sys
import torch
import megatron_eopt  # noqa: F401
from megatron_eopt.ops._newton_schulz import _ns_arguments
sys.path.insert(0, sys.argv[1])
import step_memory

torch.set_num_threads(1)
megatron_eopt.set_cpu_symmetric_products(sys.argv[2])
# The product plan's probes run before the measured call, on a thread of their own: the scratch
# they take stays in that thread's pool and goes with the thread, so the measured call starts from
# an empty pool, as a process's first large call does.
import threading
probe = threading.Thread(target=megatron_eopt.cpu_product_plan, args=(2048,))
probe.start()
probe.join()
coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, "highest", "standard")
args = (coefficients, 5, repeat_last, 1e-7, None, "highest", "standard", "clamp", 1.0, False, False)
torch.ops.megatron_eopt.newton_schulz_(torch.randn(64, 64), *args)  # loads what a first call loads
x = torch.randn(2048, 2048)
assert step_memory.reset_peak_rss()
before = step_memory.hwm_bytes()
torch.ops.megatron_eopt.newton_schulz_(x, *args)
print((step_memory.hwm_bytes() - before) / 2**20)
"""


PATHS = ["panels"] + (["kernel"] if cpu_symmetric_products()["available"]["fp32"] else [])


@pytest.mark.parametrize("symmetric", PATHS)
def test_square_fp32_scratch_is_one_iterate_and_one_product(symmetric):
    if not step_memory.peak_reset_works():
        pytest.skip("the resident-set peak cannot be reset here (/proc/self/clear_refs)")
    benchmarks = BENCHMARKS
    # A fixed mmap threshold maps and unmaps every block above 64 KiB, so the resident peak
    # follows what the call holds at once (see test_step_memory.py).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, benchmarks, symmetric], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak_mib = float(done.stdout.split()[-1])
    print(f"2048x2048 fp32 in-place Newton–Schulz, symmetric products on {symmetric}: "
          f"resident peak {peak_mib:.1f} MiB above its input")
    kernel = 16 + 8320 / 1024 if symmetric == "kernel" else 0  # packed W, partial sums
    assert 26 + kernel <= peak_mib <= 44 + kernel, (peak_mib, kernel)  # the scratch itself is 32 MiB
