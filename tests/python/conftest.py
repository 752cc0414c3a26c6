import os
import sys
import typing

import pytest
import torch

# Emerging-Optimizers 0.3.0 (a reference in some tests) imports typing.override (Python >= 3.12).
if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

HAS_CUDA = torch.cuda.is_available()


def _use_megatron_checkout() -> str | None:
    """MEGATRON_LM_PATH=<a Megatron-LM checkout>: the Megatron tests import ``megatron`` from that
    checkout instead of the installed megatron-core (docs/megatron.md, "Testing against a Megatron-LM
    checkout"); the path also reaches the processes the tests start (PYTHONPATH)."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(path, "megatron", "core", "__init__.py")):
        raise pytest.UsageError(f"MEGATRON_LM_PATH={path} is not a Megatron-LM checkout (no megatron/core/__init__.py)")
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    return path


MEGATRON_LM_PATH = _use_megatron_checkout()


def _megatron_under_test() -> str:
    try:
        import megatron.core
    except ImportError:
        return "megatron-core: not installed (its tests skip)"
    except Exception as exc:  # a broken install: its tests say so; the summary only reports it
        return f"megatron-core: import failed ({type(exc).__name__}: {exc})"
    from megatron_eopt.integrations.megatron import megatron_core_version

    where = os.path.dirname(os.path.dirname(os.path.dirname(megatron.core.__file__)))
    version = ".".join(map(str, megatron_core_version() or ())) or "unknown"
    source = f"checkout {where} (MEGATRON_LM_PATH)" if MEGATRON_LM_PATH else f"installed package at {where}"
    commit = ""
    if os.path.isdir(os.path.join(where, ".git")):
        import subprocess

        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = f", commit {head.stdout.strip()[:12]}" if head.returncode == 0 else ""
    return f"megatron-core {version}: {source}{commit}"


def pytest_terminal_summary(terminalreporter):
    """Which CPU paths of the Newton–Schulz products this run tested, and what this CPU measured."""
    import cpu_paths

    terminalreporter.write_sep("-", "CPU Newton–Schulz paths")
    terminalreporter.write_line(cpu_paths.describe())
    terminalreporter.write_sep("-", "Megatron-LM under test")
    terminalreporter.write_line(_megatron_under_test())
    from megatron_eopt.integrations import megatron as integration

    for line in integration.version_report().splitlines()[1:]:
        terminalreporter.write_line(line)


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
