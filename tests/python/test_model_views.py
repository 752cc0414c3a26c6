"""The routing of the most-used transformers 5 architectures, each built tiny from its config (no
weights downloaded): every parameter's optimizer, Muon view and scale against a table written from
the architecture's definition; one Muon step equal to a float64 per-matrix Muon on the (out, in)
matrices the table names; one Trainer step."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from megatron_eopt import MatrixView, model_matrix_views, muon_param_groups, route_parameters  # noqa: E402
from megatron_eopt.integrations.transformers import MuonAdamWFactory, build_muon_adamw  # noqa: E402
from optim_helpers import matrix_blocks  # noqa: E402

from reference import newton_schulz_ref  # noqa: E402

H, I, HEADS, KV, HD, E, MOE_I, VOCAB = 32, 48, 4, 2, 8, 4, 24, 64
LLAMA_LIKE = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=KV, head_dim=HD, vocab_size=VOCAB, pad_token_id=0, bos_token_id=0,
                  eos_token_id=0)


def _configs():
    T = transformers
    moe = dict(num_experts_per_tok=2)
    return {
        "llama": T.LlamaConfig(**LLAMA_LIKE),
        "qwen2": T.Qwen2Config(**LLAMA_LIKE),
        "qwen3": T.Qwen3Config(**LLAMA_LIKE),
        "qwen3_moe": T.Qwen3MoeConfig(**LLAMA_LIKE, num_experts=E, moe_intermediate_size=MOE_I, **moe),
        "mixtral": T.MixtralConfig(**LLAMA_LIKE, num_local_experts=E, **moe),
        "deepseek_v3": T.DeepseekV3Config(
            hidden_size=H, intermediate_size=I, moe_intermediate_size=MOE_I, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=E,
            n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, vocab_size=VOCAB, pad_token_id=0, bos_token_id=0, eos_token_id=0, **moe),
        "gpt_oss": T.GptOssConfig(**LLAMA_LIKE, num_local_experts=E, **moe),
        "gpt2": T.GPT2Config(n_embd=H, n_layer=2, n_head=HEADS, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                             eos_token_id=0),
        "gpt_neox": T.GPTNeoXConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=HEADS,
                                    vocab_size=VOCAB, bos_token_id=0, eos_token_id=0),
        "falcon": T.FalconConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, vocab_size=VOCAB,
                                 bos_token_id=0, eos_token_id=0),
        "gemma2": T.Gemma2Config(**LLAMA_LIKE),
        "gemma3": T.Gemma3TextConfig(**LLAMA_LIKE),
        "phi3": T.Phi3Config(**LLAMA_LIKE),
        "olmo2": T.Olmo2Config(**LLAMA_LIKE),
    }


def M(*parts, nd_mode=None, layout=None, split=None):
    """A Muon route: its param-group keys and the (out, in) parts of one matrix (per expert)."""
    keys = {}
    if nd_mode:
        keys["nd_mode"] = nd_mode
    if layout:
        keys["matrix_layout"] = layout
    if split:
        keys["split_shapes"] = tuple(split)
    return ("muon", keys, list(parts))


def A(reason):
    return ("adamw", reason)


# Written from each architecture's definition (modeling_*.py of transformers 5.24) at the sizes above.
LLAMA_ATTN = {r"self_attn\.q_proj\.weight": M((HEADS * HD, H)), r"self_attn\.[kv]_proj\.weight": M((KV * HD, H)),
              r"self_attn\.o_proj\.weight": M((H, HEADS * HD))}
LLAMA_MLP = {r"mlp\.(gate|up)_proj\.weight": M((I, H)), r"mlp\.down_proj\.weight": M((H, I))}
COMMON = {r"embed_tokens\.weight$": A("embedding"), r"^lm_head\.weight$": A("output head"),
          r"norm\.weight$|layernorm\.weight$": A("norm"), r"\.bias$": A("bias")}
EXPERTS = {r"mlp\.gate\.weight": A("router"),
           r"experts\.gate_up_proj$": M((MOE_I, H), (MOE_I, H), nd_mode="batch", split=(MOE_I, MOE_I)),
           r"experts\.down_proj$": M((H, MOE_I), nd_mode="batch")}
TABLES = {
    "llama": {**COMMON, **LLAMA_ATTN, **LLAMA_MLP},
    "qwen2": {**COMMON, **LLAMA_ATTN, **LLAMA_MLP},
    "qwen3": {**COMMON, **LLAMA_ATTN, **LLAMA_MLP},
    "gemma2": {**COMMON, **LLAMA_ATTN, **LLAMA_MLP},
    "gemma3": {**COMMON, **LLAMA_ATTN, **LLAMA_MLP},
    "olmo2": {**COMMON, **LLAMA_ATTN, **LLAMA_MLP},
    "qwen3_moe": {**COMMON, **LLAMA_ATTN, **EXPERTS},
    "mixtral": {**COMMON, **LLAMA_ATTN, r"mlp\.gate\.weight": A("router"),
                r"experts\.gate_up_proj$": M((I, H), (I, H), nd_mode="batch", split=(I, I)),
                r"experts\.down_proj$": M((H, I), nd_mode="batch")},
    "deepseek_v3": {**COMMON, **EXPERTS, **LLAMA_MLP,
                    r"q_a_proj\.weight": M((16, H)), r"q_b_proj\.weight": M((HEADS * (8 + 4), 16)),
                    r"kv_a_proj_with_mqa\.weight": M((8 + 4, H)), r"kv_b_proj\.weight": M((HEADS * (8 + 8), 8)),
                    r"self_attn\.o_proj\.weight": M((H, HEADS * 8)),
                    r"shared_experts\.(gate|up)_proj\.weight": M((MOE_I, H)),
                    r"shared_experts\.down_proj\.weight": M((H, MOE_I))},
    "gpt_oss": {**COMMON, **LLAMA_ATTN, r"self_attn\.sinks$": A("1-D vector"),
                r"mlp\.router\.weight": A("router"), r"mlp\.router\.bias": A("bias"),
                # stored (E, in, out), gate and up interleaved along out
                r"experts\.gate_up_proj$": M((I, H), (I, H), nd_mode="batch", layout="in_out", split=(1, 1)),
                r"experts\.down_proj$": M((H, I), nd_mode="batch", layout="in_out"),
                r"experts\.(gate_up|down)_proj_bias$": A("expert bias")},
    "gpt2": {r"wte\.weight": A("embedding"), r"wpe\.weight": A("embedding"), r"ln_\w+\.weight": A("norm"),
             r"\.bias$": A("bias"),
             r"attn\.c_attn\.weight": M((H, H), (H, H), (H, H), layout="in_out", split=(H, H, H)),
             r"attn\.c_proj\.weight": M((H, H), layout="in_out"),
             r"mlp\.c_fc\.weight": M((4 * H, H), layout="in_out"), r"mlp\.c_proj\.weight": M((H, 4 * H), layout="in_out")},
    "gpt_neox": {r"embed_in\.weight": A("embedding"), r"^embed_out\.weight$|^lm_head\.weight$": A("output head"),
                 r"(layernorm|layer_norm)\.weight$": A("norm"), r"\.bias$": A("bias"),
                 r"query_key_value\.weight": M((H, H), (H, H), (H, H), split=(HD, HD, HD)),  # per head [q; k; v]
                 r"attention\.dense\.weight": M((H, H)), r"dense_h_to_4h\.weight": M((I, H)),
                 r"dense_4h_to_h\.weight": M((H, I))},
    "falcon": {r"word_embeddings\.weight": A("embedding"), r"^lm_head\.weight$": A("output head"),
               r"(layernorm|ln_f)\.weight$": A("norm"), r"\.bias$": A("bias"),
               # multi-query (the default): [Q of all heads; k; v]
               r"query_key_value\.weight": M((H, H), (HD, H), (HD, H), split=(H, HD, HD)),
               r"self_attention\.dense\.weight": M((H, H)), r"dense_h_to_4h\.weight": M((4 * H, H)),
               r"dense_4h_to_h\.weight": M((H, 4 * H))},
    "phi3": {**COMMON, r"self_attn\.o_proj\.weight": M((H, HEADS * HD)),
             r"qkv_proj\.weight": M((HEADS * HD, H), (KV * HD, H), (KV * HD, H), split=(HEADS * HD, KV * HD, KV * HD)),
             r"mlp\.gate_up_proj\.weight": M((I, H), (I, H), split=(I, I)), r"mlp\.down_proj\.weight": M((H, I))},
}
ARCHS = list(TABLES)


def _model(arch):
    configs = _configs()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(configs[arch]).float()


def _expected(table, name):
    hits = [v for pattern, v in table.items() if re.search(pattern, name)]
    assert hits, f"{name}: no row of the table"
    muon = [h for h in hits if h[0] == "muon"]
    return muon[0] if muon else hits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_route_view_and_scale_of_every_parameter(arch):
    model = _model(arch)
    table, _ = route_parameters(model)
    seen = 0
    for route in table:
        want = _expected(TABLES[arch], route.name)
        assert route.optimizer == want[0], (route.name, route.reason)
        if want[0] == "adamw":
            assert want[1] in route.reason, (route.name, route.reason)
            continue
        seen += 1
        assert dict(route.group_keys) == want[1], route.name
        scales = [math.sqrt(max(1.0, o / i)) for o, i in want[2]]
        assert route.scale == " / ".join(f"{s:.3g}" for s in scales), route.name
        experts = route.shape[0] if want[1].get("nd_mode") == "batch" else 1
        parts = " + ".join(f"{o}x{i}" for o, i in want[2])
        parts = f"[{parts}]" if len(want[2]) > 1 else parts
        assert route.view == (f"{experts} x {parts}" if experts > 1 else parts), route.name
    assert seen > 0
    assert "muon view (out x in)" in table.format()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_step_equals_float64_per_matrix_muon(arch):
    """Muon's first step on every matrix the table names: p(1 - lr·wd) - lr·scale(out, in)·NS(g),
    Newton–Schulz of each (out, in) matrix in float64 (a first step's Nesterov momentum is a multiple
    of the gradient, which the normalization removes)."""
    model = _model(arch)
    lr, wd = 0.02, 0.1
    opt = build_muon_adamw(model, lr=lr, weight_decay=wd, fp32_matmul_prec="highest")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    checked = 0
    for name, p in model.named_parameters():
        want = _expected(TABLES[arch], name)
        if want[0] != "muon" or name not in grads:
            continue
        keys = want[1]
        for w0, g, w1 in zip(matrix_blocks(before[name], keys), matrix_blocks(grads[name], keys),
                             matrix_blocks(p.detach(), keys)):
            o, i = w0.shape
            ref = w0.double() * (1 - lr * wd) - lr * math.sqrt(max(1.0, o / i)) * newton_schulz_ref(g.double())
            torch.testing.assert_close(w1.double(), ref, rtol=0, atol=2e-6, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_one_trainer_step(arch, tmp_path):
    model = _model(arch)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = (torch.arange(8) + i) % VOCAB
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                          use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-3)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    experts = [n for n in moved if "experts" in n and n.endswith("proj")]
    assert moved and (experts or arch not in ("qwen3_moe", "gpt_oss"))


def test_options_fused_gate_up_whole_and_routers_muon():
    model = _model("qwen3_moe")
    table, _ = route_parameters(model, fused_gate_up="whole", routers="muon")
    gate_up = table["model.layers.0.mlp.experts.gate_up_proj"]
    assert dict(gate_up.group_keys) == {"nd_mode": "batch"} and gate_up.view == f"{E} x {2 * MOE_I}x{H}"
    assert table["model.layers.0.mlp.gate.weight"].optimizer == "muon"


def test_bad_options_are_clear_errors():
    model = _model("gpt2")
    with pytest.raises(ValueError, match=r"views names 'transformer\.h\.0\.attn\.c_atn\.weight', which is not a"):
        route_parameters(model, views={"transformer.h.0.attn.c_atn.weight": None})
    with pytest.raises(ValueError, match=r"adamw_patterns: 'no_such_module' matches no parameter"):
        build_muon_adamw(model, adamw_patterns=["no_such_module"])
    with pytest.raises(ValueError, match=r"fused_gate_up must be one of"):
        route_parameters(model, fused_gate_up="apart")
    with pytest.raises(ValueError, match=r"routers must be one of"):
        build_muon_adamw(model, routers="sgd")


def test_views_override_and_unknown_nd_weights_are_reported():
    model = _model("gpt2")
    table, _ = route_parameters(model, views={"transformer.h.0.attn.c_attn.weight": MatrixView(
        "conv1d", "whole", matrix_layout="in_out")})
    assert dict(table["transformer.h.0.attn.c_attn.weight"].group_keys) == {"matrix_layout": "in_out"}
    assert dict(table["transformer.h.1.attn.c_attn.weight"].group_keys)["split_shapes"] == (H, H, H)

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.Parameter(torch.randn(3, 4, 5))

    with pytest.warns(UserWarning, match=r"belong to modules the routing does not know.*\['stack'\]"):
        table, _ = route_parameters(Custom())
    assert table["stack"].optimizer == "adamw"


def test_flat_lists_and_groups():
    model = _model("qwen3_moe")
    with pytest.warns(UserWarning, match="as_groups=True"):
        muon, other = muon_param_groups(model)
    experts = {id(p) for n, p in model.named_parameters() if "experts" in n}
    assert not experts & {id(p) for p in muon} and experts <= {id(p) for p in other}
    groups, other = muon_param_groups(model, as_groups=True)
    batch = [g for g in groups if g.get("nd_mode") == "batch"]
    assert {id(p) for g in batch for p in g["params"]} == experts
    from megatron_eopt.torch_optim import Muon as TorchFrontMuon

    opt = TorchFrontMuon(groups, lr=0.02)  # torch.optim.Muon's front end takes the views' keys
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
    opt.step()
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n in before)
    views = model_matrix_views(model)
    assert sum(v.kind == "router" for _, v in views.values()) == 2


def test_build_optimizers_gives_views_to_its_muon_and_refuses_a_muon_without_them():
    from megatron_eopt import build_optimizers

    model = _model("gpt2")
    (muon, adamw), table = build_optimizers(model)
    layouts = {g.get("matrix_layout") for g in muon.param_groups}
    assert layouts == {"in_out"} and any(g.get("split_shapes") == [H, H, H] for g in muon.param_groups)
    with pytest.raises(ValueError, match=r"muon_cls 'Muon' takes no matrix views"):
        build_optimizers(model, muon_cls=torch.optim.Muon)

    class TorchMuon(torch.optim.Muon):
        def __init__(self, params, scale_mode=None, **kwargs):  # build_optimizers' scale_mode: not torch's
            super().__init__(params, **kwargs)

    (muon, _), _ = build_optimizers(model, muon_cls=TorchMuon, views={
        n: None for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))})
    assert isinstance(muon, torch.optim.Muon)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2])
def test_fsdp2_sharded_models_step_as_one_process(tmp_path, world_size):
    """GPT-2 (Conv1D, fused QKV columns), Qwen3-MoE and gpt-oss (experts, routers) under fully_shard
    on gloo ranks equal one process on the whole model, in owner and gather mode."""
    import os

    import torch.multiprocessing as mp

    import hf_fsdp2_worker

    mp.spawn(hf_fsdp2_worker.worker, args=(world_size, os.path.join(tmp_path, "rendezvous")), nprocs=world_size,
             join=True)
