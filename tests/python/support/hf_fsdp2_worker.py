"""One rank of the FSDP2 test of the model routing (spawned by test_model_views.py, gloo on CPU).

Hugging Face models sharded by ``fully_shard`` (every decoder layer, then the model), the optimizer
routed on the sharded model (the module classes stay; the parameters are DTensors): the views
(Conv1D (in, out), fused QKV split along columns, experts per expert with their gate/up split)
must step the same as one process on the whole model. Every rank takes the same batch, so FSDP2's
averaged gradients equal the single process's.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.integrations.transformers import build_muon_adamw  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from reference import rel_err  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

TOL = 1e-5  # fp32 "highest"; FSDP2's gradient average divides by the world size


def _models():
    import transformers as T

    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return {
        "gpt2": T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0,
                             eos_token_id=0),
        "qwen3_moe": T.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
        "gpt_oss": T.GptOssConfig(**small, num_local_experts=4, num_experts_per_tok=2),
    }


def _build(config):
    import transformers as T

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.AutoModelForCausalLM.from_config(config).float().eval()  # no dropout: the same loss everywhere


def _layers(model):
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise AssertionError("no layer list")


def check(name, config, mesh, sharded_mode):
    from torch.distributed.fsdp import fully_shard

    ref_model, model = _build(config), _build(config)
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kwargs = dict(lr=0.02, adamw_lr=1e-3, weight_decay=0.1, fp32_matmul_prec="highest")
    ref_opt = build_muon_adamw(ref_model, **kwargs)
    opt = build_muon_adamw(model, sharded_mode=sharded_mode, **kwargs)
    assert [g.get("matrix_layout") for g in opt.param_groups] == [g.get("matrix_layout") for g in ref_opt.param_groups]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    ref = dict(ref_model.named_parameters())
    for pname, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        err = rel_err(full.detach(), ref[pname].detach())
        assert err <= TOL, f"{name} {sharded_mode} on {mesh.size()} ranks: {pname} rel err {err:.2e}"


@exits_without_teardown
def worker(rank, world_size, init_file):
    with gloo_world(rank, world_size, init_file):
        mesh = init_device_mesh("cpu", (world_size,))
        for name, config in _models().items():
            check(name, config, mesh, "owner")
        check("gpt2", _models()["gpt2"], mesh, "gather")
