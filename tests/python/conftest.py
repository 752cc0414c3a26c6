import os
import sys
import typing

import pytest
import torch

# Emerging-Optimizers 0.3.0 (a reference in some tests) imports typing.override (Python >= 3.12).
if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.path.dirname(__file__))

HAS_CUDA = torch.cuda.is_available()


def pytest_terminal_summary(terminalreporter):
    """Which CPU paths of the Newton–Schulz products this run tested, and what this CPU measured."""
    import cpu_paths

    terminalreporter.write_sep("-", "CPU Newton–Schulz paths")
    terminalreporter.write_line(cpu_paths.describe())


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def gen(request):
    """A generator with a fresh seed per test; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    env = os.environ.get("MEGATRON_EOPT_TEST_SEED")
    if env is not None:
        seed = int(env)
    print(f"seed={seed} (replay with MEGATRON_EOPT_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)
