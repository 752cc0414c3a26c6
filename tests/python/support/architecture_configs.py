"""Tiny configs of the transformers 5.24 architectures that tests/python/support/architecture_routes.py audits:
hidden 32, 4 heads of 8 (2 KV heads), intermediate 48, 2 layers (a hybrid model: one layer of each kind),
4 experts of 24, vocabulary 64; each built on CPU from its config alone, no weights downloaded."""

from __future__ import annotations

import inspect

import torch

H, I, HEADS, KV, HD, E, MOE_I, VOCAB = 32, 48, 4, 2, 8, 4, 24, 64

# One value per size, under every name a config of transformers 5.24 gives it; a config takes the
# names its class knows.
GENERIC = dict(
    hidden_size=H, d_model=H, n_embd=H, n_embed=H, embed_dim=H, dim=H,
    intermediate_size=I, ffn_dim=I, d_ff=I, n_inner=I, ffn_hidden_size=I, encoder_ffn_dim=I, decoder_ffn_dim=I,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2, encoder_layers=1, decoder_layers=1, num_decoder_layers=1,
    num_attention_heads=HEADS, n_head=HEADS, n_heads=HEADS, num_heads=HEADS, encoder_attention_heads=HEADS,
    decoder_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD, d_kv=HD, d_head=HD,
    vocab_size=VOCAB, max_position_embeddings=64, n_positions=64, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    decoder_start_token_id=0, sep_token_id=1, cls_token_id=2,
    num_experts=E, num_local_experts=E, n_routed_experts=E, moe_intermediate_size=MOE_I, num_experts_per_tok=2,
    rotary_dim=4, image_size=32, patch_size=8, num_channels=3,
)

# Per architecture: the config class's name in transformers.AutoConfig, the model class (the task
# head whose forward the trace runs), keyword overrides, and inputs other than input_ids.
ARCH_CONFIGS: dict[str, dict] = {}


def _add(name, model="AutoModelForCausalLM", model_type=None, inputs=None, **overrides):
    ARCH_CONFIGS[name] = dict(model_type=model_type or name, model=model, overrides=overrides, inputs=inputs)


def _ids():
    return torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _pixels():
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}


def _seq2seq():
    return {"input_ids": _ids(), "decoder_input_ids": _ids()}


for _name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "olmo", "olmo2", "olmo3",
              "stablelm", "starcoder2", "cohere", "cohere2", "helium", "smollm3", "ernie4_5", "bitnet",
              "diffllama", "exaone4", "seed_oss", "arcee", "nemotron", "hunyuan_v1_dense", "persimmon",
              "phi", "phi3", "opt", "xglm", "biogpt", "gpt2", "openai-gpt", "gpt_bigcode", "gpt_neox",
              "bloom", "mpt", "codegen", "gptj", "glm", "glm4", "minimax", "lfm2", "apertus", "mamba",
              "falcon_mamba", "rwkv"):
    _add(_name)
_add("gemma3_text")
_add("mixtral")
_add("qwen2_moe", shared_expert_intermediate_size=I)
_add("qwen3_moe")
_add("qwen3_next", layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
     linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, shared_expert_intermediate_size=I)
_add("olmoe")
_add("phimoe")
_add("granitemoe")
_add("granitemoeshared", shared_intermediate_size=I)
_add("jetmoe", kv_channels=HD, num_key_value_heads=HEADS)
_add("hunyuan_v1_moe")
_add("ernie4_5_moe")
_add("glm4_moe", first_k_dense_replace=1, n_group=1, topk_group=1)
_add("llama4_text", intermediate_size_mlp=64, moe_layers=[0, 1], num_experts_per_tok=1)
_add("gpt_oss")
_add("dots1", first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1)
_add("deepseek_v2", first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=16,
     kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=HEADS)
_add("deepseek_v3", first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=16,
     kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=HEADS, head_dim=None)
_add("dbrx", attn_config=dict(kv_n_heads=KV, clip_qkv=8.0, rope_theta=10000.0), ffn_config=dict(ffn_hidden_size=I, moe_num_experts=E,
                                                                              moe_top_k=2))
_add("falcon", multi_query=True, new_decoder_architecture=False)
_add("falcon_new", model_type="falcon", new_decoder_architecture=True, num_kv_heads=KV)
_add("gpt_neo", attention_types=[[["global", "local"], 1]], window_size=4)
_add("mamba2", num_heads=8, head_dim=8, n_groups=1, state_size=16, expand=2, time_step_rank=4, chunk_size=8)
_add("jamba", num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
     expert_layer_offset=1, mamba_dt_rank=4)
_add("bamba", attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_chunk_size=8)
_add("falcon_h1", mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_d_ssm=64)
_add("zamba", num_hidden_layers=3, layer_types=["linear_attention", "hybrid", "hybrid"], attention_head_dim=16,
     n_mamba_heads=2, mamba_dt_rank=4)
_add("zamba2", num_hidden_layers=2, layer_types=["linear_attention", "hybrid"], hybrid_layer_ids=[1], mamba_headdim=8,
     n_mamba_heads=8, attention_head_dim=16, adapter_rank=4, num_mem_blocks=1)
_add("recurrent_gemma", block_types=["recurrent", "attention"], lru_width=H, attention_window_size=8)
_add("gemma3n_text", num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
     laurel_rank=4, altup_num_inputs=2, layer_types=["sliding_attention", "full_attention"],
     activation_sparsity_pattern=[0.0, 0.0])
_add("bert", model="AutoModelForPreTraining")
_add("roberta", model="AutoModelForMaskedLM")
_add("electra", model="AutoModelForMaskedLM", embedding_size=16)
_add("albert", model="AutoModelForMaskedLM", embedding_size=16)
_add("distilbert", model="AutoModelForMaskedLM")
_add("deberta-v2", model="AutoModelForMaskedLM")
_add("modernbert", model="AutoModelForMaskedLM", global_attn_every_n_layers=1)
_add("t5", model="AutoModelForSeq2SeqLM", inputs=_seq2seq)
_add("bart", model="AutoModelForSeq2SeqLM", inputs=_seq2seq)
_add("xlnet", model="AutoModelForCausalLM", mem_len=None, inputs=lambda: {"input_ids": _ids(), "token_type_ids": _ids() % 2})
_add("vit", model="AutoModelForImageClassification", inputs=_pixels, num_labels=3)
_add("swin", model="AutoModelForImageClassification", inputs=_pixels, depths=[1, 1], num_heads=[2, 4],
     window_size=2, num_labels=3)
_add("clip", model="AutoModel", inputs=lambda: {"input_ids": _ids(), **_pixels()},
     text_config=dict(hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=HEADS,
                      vocab_size=VOCAB, max_position_embeddings=16, projection_dim=16),
     vision_config=dict(hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=HEADS,
                        image_size=32, patch_size=8, projection_dim=16), projection_dim=16)
_add("whisper", model="AutoModelForSpeechSeq2Seq", num_mel_bins=8, max_source_positions=8, max_target_positions=16,
     inputs=lambda: {"input_features": torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)),
                     "decoder_input_ids": _ids()})


def build(name: str):
    """The model of ``name`` (a key of ARCH_CONFIGS) in fp32, seeded, and its example inputs."""
    import transformers

    spec = ARCH_CONFIGS[name]
    cls = type(transformers.AutoConfig.for_model(spec["model_type"]))
    known = set(inspect.signature(cls.__init__).parameters) | set(vars(cls())) | set(
        getattr(cls, "__dataclass_fields__", {}))
    kwargs = {k: v for k, v in GENERIC.items() if k in known}
    kwargs.update({k: v for k, v in spec["overrides"].items() if v is not None})
    for k in [k for k, v in spec["overrides"].items() if v is None]:
        kwargs.pop(k, None)
    config = cls(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, spec["model"]).from_config(config).float()
    inputs = spec["inputs"]() if spec["inputs"] is not None else {"input_ids": _ids()}
    return model, inputs
