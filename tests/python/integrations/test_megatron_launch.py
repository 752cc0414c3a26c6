"""examples/megatron_muon.md's recipe, checked as far as a CPU machine allows: its exact flags go
through megatron-core's own argument parser into the documented OptimizerConfig, that config
builds megatron-eopt's TensorParallelMuon through the installed registry entry, and
examples/megatron_launch.py installs megatron-eopt before it runs the training script."""

import json
import os
import re
import shlex
import subprocess
import sys
import types

import pytest
import torch
from paths import ROOT

try:
    from megatron.training import arguments as mtraining_arguments
except ModuleNotFoundError:  # only a missing megatron-core skips; a broken one fails
    mtraining_arguments = None

pytestmark = pytest.mark.skipif(mtraining_arguments is None, reason="megatron-core is not installed")

DOC = os.path.join(ROOT, "examples", "megatron_muon.md")
LAUNCH = os.path.join(ROOT, "examples", "megatron_launch.py")

# What $MODEL_ARGS $DATA_ARGS $PARALLEL_ARGS stand for in the recipe: a tiny mock-data GPT.
STAND_IN_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--train-iters", "10", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128",
]


def recipe_flags() -> list[str]:
    """The flags of the documented pretrain_gpt.py command, without the $VARIABLES."""
    with open(DOC) as f:
        text = f.read()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "pretrain_gpt.py" in b)
    tokens = shlex.split(block.replace("\\\n", " "))
    start = next(i for i, t in enumerate(tokens) if t.endswith("pretrain_gpt.py")) + 1
    return [t for t in tokens[start:] if not t.startswith("$")]


def optimizer_config_from_flags(monkeypatch, flags):
    """What pretrain_gpt.py does with its command line: parse, validate, OptimizerConfig."""
    from megatron.training.training import get_megatron_optimizer_config

    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *STAND_IN_ARGS, *flags])
    args = mtraining_arguments.parse_args()
    args = mtraining_arguments.validate_args(args) or args
    config, _ = get_megatron_optimizer_config(args)
    return config


def test_recipe_flags_parse_into_the_documented_config(monkeypatch):
    flags = recipe_flags()
    assert flags[:2] == ["--optimizer", "muon"]
    config = optimizer_config_from_flags(monkeypatch, flags)
    expected = dict(
        optimizer="muon", lr=3e-4, min_lr=3e-5, weight_decay=0.1, muon_momentum=0.95, muon_nesterov=True,
        muon_coefficient_type="quintic", muon_num_ns_steps=5, muon_scale_mode="spectral",
        muon_extra_scale_factor=0.2, muon_fp32_matmul_prec="medium", muon_tp_mode="blockwise",
        muon_scalar_optimizer="adam", muon_split_qkv=True, adam_beta1=0.9, adam_beta2=0.95,
        use_layer_wise_distributed_optimizer=True, use_distributed_optimizer=False, bf16=True,
        decoupled_weight_decay=True,
    )
    assert {k: getattr(config, k) for k in expected} == expected


def test_installed_entry_builds_our_muon_from_that_config(monkeypatch):
    from megatron.core.optimizer import emerging_optimizers as mcore_emerging

    from megatron_eopt.integrations import megatron as eopt_megatron
    from megatron_eopt.optim import TensorParallelMuon

    config = optimizer_config_from_flags(monkeypatch, recipe_flags())
    eopt_megatron.install()
    try:
        entry = mcore_emerging._EMERGING_OPTIMIZERS["muon"]
        assert entry.optimizer_cls is TensorParallelMuon
        chunk = types.SimpleNamespace(config=types.SimpleNamespace(
            num_attention_heads=4, num_query_groups=2, kv_channels=16, attention_output_gate=False))
        kwargs = entry.config_to_kwargs(config, [chunk], None)
        weight = torch.nn.Parameter(torch.randn(32, 64))
        opt = entry.optimizer_cls([weight], lr=config.lr, weight_decay=config.weight_decay, **{
            k: v for k, v in kwargs.items() if k not in ("lr", "weight_decay")})
        assert isinstance(opt, TensorParallelMuon)
        group = opt.param_groups[0]
        assert group["lr"] == pytest.approx(3e-4) and group["weight_decay"] == pytest.approx(0.1)
        assert group["momentum"] == pytest.approx(0.95)
        assert kwargs["nesterov"] is True and kwargs["coefficient_type"] == "quintic"
        assert kwargs["num_ns_steps"] == 5 and kwargs["scale_mode"] == "spectral"
        assert kwargs["extra_scale_factor"] == pytest.approx(0.2) and kwargs["fp32_matmul_prec"] == "medium"
        assert kwargs["tp_mode"] == "blockwise" and kwargs["split_qkv"] is True
        assert kwargs["qkv_split_shapes"] == [32, 16, 16]  # (heads / groups) * kv_channels, kv, kv
        weight.grad = torch.randn_like(weight)
        before = weight.detach().clone()
        opt.step()
        assert torch.isfinite(weight).all() and not torch.equal(weight.detach(), before)
    finally:
        eopt_megatron.uninstall()


STAND_IN_SCRIPT = """
import json, sys
import helper_next_to_script  # Megatron's scripts import modules from their own folder
from megatron_eopt.integrations import megatron as eopt_megatron
from megatron.core.optimizer import emerging_optimizers
import megatron_eopt.optim
with open(sys.argv[1], "w") as f:
    json.dump({
        "main": __name__,
        "argv": sys.argv,
        "installed": eopt_megatron.installed(),
        "muon_is_ours": emerging_optimizers._EMERGING_OPTIMIZERS["muon"].optimizer_cls
                        is megatron_eopt.optim.TensorParallelMuon,
    }, f)
"""


def test_launcher_installs_before_running_the_script(tmp_path):
    script = tmp_path / "pretrain_stand_in.py"
    script.write_text(STAND_IN_SCRIPT)
    (tmp_path / "helper_next_to_script.py").write_text("")
    report = tmp_path / "report.json"
    proc = subprocess.run(  # megatron_eopt imported as in this test run (installed or PYTHONPATH)
        [sys.executable, LAUNCH, str(script), str(report), "--optimizer", "muon"],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path.parent),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(report.read_text())
    assert seen["main"] == "__main__"
    assert seen["argv"] == [str(script), str(report), "--optimizer", "muon"]
    assert {"muon", "adaptive_muon"} <= set(seen["installed"])
    assert seen["muon_is_ours"] is True
    assert "are megatron-eopt's" in proc.stderr


def test_launcher_without_a_script_prints_usage():
    proc = subprocess.run([sys.executable, LAUNCH], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "megatron_launch.py" in proc.stderr


# A tiny GPT's flags for Megatron-LM's argument check, with Torch-FSDP2 (which needs untied embeddings).
FSDP2_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "10",
    "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights", "--use-torch-fsdp2",
]


def _validated(monkeypatch, flags):
    """Megatron-LM's own parse_args + validate_args on ``flags`` (one rank); the args."""
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    return args


@pytest.mark.parametrize("name", ["muon", "adaptive_muon"])
def test_allow_torch_fsdp2_lifts_megatrons_refusal_only(monkeypatch, name):
    from megatron_eopt.integrations import megatron as eopt_megatron

    flags = [*FSDP2_FLAGS, "--optimizer", name, "--ckpt-format", "torch_dcp"]
    try:
        eopt_megatron.install()
        with pytest.raises(AssertionError, match="Torch-FSDP2"):  # Megatron-LM's refusal, without the opt-in
            _validated(monkeypatch, flags)
        eopt_megatron.allow_torch_fsdp2()
        args = _validated(monkeypatch, flags)
        assert args.optimizer == name and args.use_torch_fsdp2 and args.ckpt_format == "torch_dcp"
        assert not args.use_layer_wise_distributed_optimizer
        with pytest.raises(ValueError, match="--ckpt-format torch_dcp"):
            _validated(monkeypatch, [*FSDP2_FLAGS, "--optimizer", name, "--ckpt-format", "torch_dist"])
        with pytest.raises(ValueError, match="--use-distributed-optimizer"):
            _validated(monkeypatch, [*flags, "--use-distributed-optimizer"])
        with pytest.raises(AssertionError, match="untie"):  # Megatron-LM's other checks still run
            _validated(monkeypatch, [f for f in flags if f != "--untie-embeddings-and-output-weights"])
        eopt_megatron.uninstall()  # the check is Megatron-LM's own again
        with pytest.raises(AssertionError, match="Torch-FSDP2"):
            _validated(monkeypatch, flags)
    finally:
        eopt_megatron.uninstall()


FSDP2_STAND_IN_SCRIPT = """
import sys
from megatron.training import arguments
args = arguments.parse_args()
arguments.validate_args(args, {})
print("validated", args.optimizer, args.use_torch_fsdp2, args.ckpt_format)
"""


def test_launcher_opt_in_flag_lifts_the_fsdp2_refusal(tmp_path):
    pytest.importorskip("megatron.training.arguments")
    script = tmp_path / "pretrain_stand_in.py"
    script.write_text(FSDP2_STAND_IN_SCRIPT)
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0"}
    flags = [*FSDP2_FLAGS, "--optimizer", "muon", "--ckpt-format", "torch_dcp"]
    refused = subprocess.run([sys.executable, LAUNCH, str(script), *flags], capture_output=True, text=True,
                             timeout=300, env=env)
    assert refused.returncode != 0 and "does not support Torch-FSDP2" in refused.stderr
    allowed = subprocess.run([sys.executable, LAUNCH, str(script), "--eopt-allow-torch-fsdp2", *flags],
                             capture_output=True, text=True, timeout=300, env=env)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "validated muon True torch_dcp" in allowed.stdout
