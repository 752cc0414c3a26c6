"""python -m megatron_eopt.doctor: build facts, the CPU self-test, and failure reporting."""

import subprocess
import sys

import pytest
import torch

from megatron_eopt import doctor
from megatron_eopt._library import build_info, cuda_kernels_built


def test_cli_passes_on_this_machine():
    proc = subprocess.run([sys.executable, "-m", "megatron_eopt.doctor", "--device", "cpu"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    info = build_info()
    assert f"built against {info['torch']} for torch >= {info['torch_floor']} (stable ABI), running {torch.__version__}" in out
    for name in ("newton_schulz highest", "newton_schulz_split", "foreach_momentum_ + foreach_update_ float16",
                 "adamuon_normalize_", "normuon_normalize_", "namo_normalize_", "Muon step", "AdaptiveMuon"):
        assert name in out, name
    assert "FAIL" not in out
    # What the CPU products run on, per size class, with the probe times it was chosen from.
    assert "CPU products, sides < 384 (probe 256x512, ms: fp32_general" in out
    assert "CPU products, sides 384 to 1535 (probe 768x1536, ms: fp32_general" in out
    assert "CPU products, sides >= 1536 (probe 1536x1536, ms: fp32_general" in out


def test_build_info_matches_the_build():
    info = build_info()
    # Built with some torch's headers for a stable-ABI floor no newer than the running torch.
    assert len(info["torch"].split(".")) == 3
    floor = tuple(int(v) for v in info["torch_floor"].split("."))
    assert floor <= tuple(int(v) for v in info["torch"].split(".")[:2])
    assert floor <= tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert (info["cuda"] is not None) == cuda_kernels_built() == bool(info["cuda_archs"])


def test_a_wrong_result_fails_with_its_error_and_exit_status(monkeypatch, capsys):
    def broken(device, seed):
        return [doctor.Result(device, "deliberately wrong", doctor.rel_err(torch.ones(3), torch.zeros(3) + 2), 1e-6)]

    def crashing(device, seed):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(doctor, "CHECKS", [broken, crashing])
    assert doctor.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  cpu     deliberately wrong" in out and "max rel err 5.00e-01" in out
    assert "no kernel image" in out and "0 of 2 checks passed" in out


@pytest.mark.parametrize("archs,capability,covered", [
    (["80-real", "90-real", "100"], (8, 0), True),
    (["80-real", "90-real", "100"], (8, 6), True),    # sm_80 machine code runs on 8.6
    (["80-real", "90-real", "100"], (9, 0), True),
    (["80-real", "90-real", "100"], (10, 0), True),
    (["80-real", "90-real", "100"], (12, 0), True),   # PTX of 100 compiles for newer GPUs
    (["90-real"], (8, 0), False),
    (["90-real"], (10, 0), False),
    (["90"], (12, 0), True),                           # plain "90": machine code and PTX
    (["90a-real"], (9, 0), True),                       # arch-specific code: that capability only
    (["90a-real"], (10, 0), False),
    ([], (9, 0), False),
])
def test_arch_coverage(archs, capability, covered):
    assert doctor.arch_covers(archs, capability) is covered


@pytest.mark.gpu
def test_gpu_self_test_passes():
    assert doctor.main([]) == 0
