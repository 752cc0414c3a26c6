"""The memory a Muon step needs beyond its parameters, gradients and state (its transient memory),
measured as resident memory in a fresh process per case (benchmarks/step_memory.py's child).

K same-shape matrices are stacked into one Newton–Schulz batch, so without a workspace budget the
transient memory grows with K; with a small ``workspace_mib`` the step works through the stack in
chunks and the transient memory stays about the same from K = 4 to K = 16. Only memory is asserted
(no timing), with margins far above what the allocator's caching and the process's own growth move
(a few MiB), so a loaded machine does not change the outcome.
"""

import sys

import pytest
from paths import BENCHMARKS

sys.path.insert(0, BENCHMARKS)

import step_memory  # noqa: E402

# Thin matrices: 4 MiB each in fp32, but a Newton–Schulz on them is cheap (s = 64), so the stacked
# buffers, not the products, dominate the step's memory and a step takes about a second.
SHAPE = (64, 16384)
MATRIX_MIB = SHAPE[0] * SHAPE[1] * 4 / 2**20
BUDGET_MIB = 16


@pytest.fixture(autouse=True)
def _resident_memory_follows_live_memory(monkeypatch):
    # glibc raises its mmap threshold to the size of a freed block, after which blocks of a few MiB
    # come from the heap and stay resident (and fragment) when freed: the resident peak then counts
    # memory the step no longer holds, more of it the more blocks a step frees. A fixed threshold
    # maps and unmaps every block above 64 KiB, so the peak measures what the step holds at once.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")


def _transient_mib(k: int, workspace) -> float:
    """The largest (step peak - state) over two steps of our Muon on K matrices of SHAPE."""
    if not step_memory.peak_reset_works():
        pytest.skip("the resident-set peak cannot be reset here (/proc/self/clear_refs): no per-step peak")
    result = step_memory.run_child(f"{k}x{SHAPE[0]}x{SHAPE[1]}", "ours", device="cpu", steps=2,
                                   precision="highest", workspace=workspace, threads=1, timeout=900)
    assert "error" not in result, result.get("stderr_tail") or result["error"]
    assert result["method"] == "VmHWM"
    assert result["state_mib"] == pytest.approx(k * MATRIX_MIB, rel=0.01)  # fp32 momentum
    return max(peak - result["state_mib"] for peak in result["step_peaks_mib"])


def test_transient_memory_grows_with_the_stack_without_a_budget():
    """The measurement sees the stack: unbounded, 12 more matrices need about 12 x 4 MiB more.

    The stacked copy of the gradients is the one buffer that must grow by a matrix per matrix, and
    the lean step holds little else per matrix, so the growth sits right at 12 matrices: the bound
    leaves one matrix of slack for the allocator's page rounding rather than demanding more.
    """
    workspace = "none" if step_memory.workspace_support() else None
    small, large = _transient_mib(4, workspace), _transient_mib(16, workspace)
    print(f"transient MiB, unbounded workspace: K=4 {small:.1f}, K=16 {large:.1f}")
    assert small > 0
    assert large > small + 11 * MATRIX_MIB and large > 2 * small, (small, large)


def test_workspace_budget_bounds_the_transient_memory():
    if step_memory.workspace_support() is None:
        pytest.skip("megatron_eopt.optim.Muon has no workspace_mib option in this build")
    small, large = _transient_mib(4, BUDGET_MIB), _transient_mib(16, BUDGET_MIB)
    print(f"transient MiB, workspace {BUDGET_MIB} MiB: K=4 {small:.1f}, K=16 {large:.1f}")
    # 1.5x, plus 8 MiB for the allocator's caching: unbounded, K = 16 needs about 48 MiB above K = 4.
    assert large <= 1.5 * small + 8, (small, large)
