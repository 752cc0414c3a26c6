"""The route of every parameter kind of each transformers 5.24 architecture of
tests/python/support/architecture_configs.py, written from its modeling_*.py (what its forward does with the
weight), at the sizes there: H=32, 4 heads of 8 (2 KV heads), intermediate 48, 4 experts of 24.

A row: a regular expression searched in the parameter name -> its route. The first matching row of
the architecture's own rules wins, then the common rows. Muon rows hold the param-group keys (the
(out, in) matrices and their scales follow from them and the stored shape); AdamW rows a word of the
reason the routing must give (what the weight is)."""

from __future__ import annotations

from architecture_configs import HD, HEADS, KV, H, I, MOE_I


def M(nd_mode=None, layout=None, split=None):
    keys = {}
    if nd_mode:
        keys["nd_mode"] = nd_mode
    if layout:
        keys["matrix_layout"] = layout
    if split:
        keys["split_shapes"] = tuple(split)
    return ("muon", keys)


def A(reason=""):
    return ("adamw", reason)


PLAIN = M()  # an nn.Linear multiplied as stored, (out, in)
IN_OUT = M(layout="in_out")  # Conv1D, x @ W
EXPERTS = M(nd_mode="batch")  # (E, out, in): F.linear(x, W[e])
EXPERTS_IN_OUT = M(nd_mode="batch", layout="in_out")  # (E, in, out): x @ W[e], bmm
GATE_UP = lambda i: M(split=(i, i))  # noqa: E731  [gate; up] rows, act(gate) * up
EXPERTS_GATE_UP = lambda i: M(nd_mode="batch", split=(i, i))  # noqa: E731

COMMON = {
    r"\.bias$|_bias$": A("bias"),
    r"(^|\.|_)(\w*norm\w*|ln\w*|LayerNorm)\.weight$|norm$": A(""),
    r"embed|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings|shared\.weight": A("embedding"),
    r"^lm_head\.weight$|^embed_out|^head\.weight$|^classifier\.weight$": A(""),
    # hidden matrices of every architecture: attention and MLP projections multiplied as stored
    r"\.(q|k|v|o|query|key|value|dense|out|gate|up|down|fc\d?|fc_in|fc_out|out_proj|c_fc|wi|wo|wi_0|wi_1|"
    r"lin\d|q_lin|k_lin|v_lin|out_lin|ffn\.lin\d|c_proj|dense_h_to_4h|dense_4h_to_h|intermediate\.dense|"
    r"output\.dense|linear_\w+|\w+_proj)(\.weight)?$": PLAIN,
    r"\.weight$": PLAIN,  # any other nn.Linear of the blocks (ffn, ffn_output, ...): F.linear, as stored
}

ROUTER = A("router")

ARCH_ROUTES: dict[str, dict] = {}

# Llama-like: q_proj / k_proj / v_proj / o_proj, gate_proj / up_proj / down_proj, each an nn.Linear
# multiplied as stored (rotary halves re-joined: one matrix each).
for _name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo", "olmo2",
              "olmo3", "stablelm", "starcoder2", "cohere", "cohere2", "helium", "smollm3", "ernie4_5", "bitnet",
              "exaone4", "seed_oss", "arcee", "nemotron", "hunyuan_v1_dense", "phi", "opt", "xglm", "biogpt",
              "gptj", "apertus", "gpt_neo", "lfm2"):
    ARCH_ROUTES[_name] = {}
ARCH_ROUTES["apertus"] = {r"act_fn\.alpha_[pn]$": A("1-D")}  # xIELU's learned scalars
ARCH_ROUTES["diffllama"] = {r"lambda_": A("1-D")}
ARCH_ROUTES["lfm2"] = {r"conv\.conv\.weight": A(""), r"conv\.(in|out)_proj\.weight": PLAIN}

# GLM / GLM-4: gate_up_proj(x).chunk(2, -1), act(gate) * up; q / k: an interleaved partial rotary,
# re-joined (torch.cat((q_embed, q_pass), -1)): one matrix each.
ARCH_ROUTES["glm"] = ARCH_ROUTES["glm4"] = {r"mlp\.gate_up_proj\.weight": GATE_UP(I)}
# Phi-3: qkv_proj(x) sliced [Q | K | V] (GQA sizes); gate_up_proj chunked in two.
ARCH_ROUTES["phi3"] = {r"qkv_proj\.weight": M(split=(HEADS * HD, KV * HD, KV * HD)),
                       r"gate_up_proj\.weight": GATE_UP(I)}
# Fused QKV per head: Persimmon / Bloom view (b, t, heads, 3, head_dim), GPT-NeoX (b, t, heads, 3 * head_dim)
# chunked; MiniMax's lightning attention (b, t, heads, 3 * head_dim) split; CodeGen (b, t, 4, -1) split in
# [q; v; k] per model-parallel group of 8 rows each.
ARCH_ROUTES["persimmon"] = {r"query_key_value\.weight": M(split=(HD, HD, HD))}
ARCH_ROUTES["bloom"] = {r"query_key_value\.weight": M(split=(HD, HD, HD))}
ARCH_ROUTES["gpt_neox"] = {r"query_key_value\.weight": M(split=(HD, HD, HD))}
ARCH_ROUTES["codegen"] = {r"qkv_proj\.weight": M(split=(H // 4, H // 4, H // 4))}
# MPT: Wqkv(x).chunk(3, dim=2); DBRX: Wqkv(x).split([H, kv, kv], dim=2) (clip_qkv in between).
ARCH_ROUTES["mpt"] = {r"Wqkv\.weight": M(split=(H, H, H))}
# DBRX experts: w1 / v1 (E·ffn, H) viewed (E, ffn, H)[e], x @ w.T: per-expert (out, in) row blocks;
# w2 viewed the same but x @ w2[e]: (in, out) blocks stacked along their input dim, which no
# param-group keys describe -> AdamW with a warning (not guessed).
ARCH_ROUTES["dbrx"] = {r"Wqkv\.weight": M(split=(H, KV * HD, KV * HD)), r"router\.layer\.weight": ROUTER,
                       r"experts\.mlp\.(w1|v1)$": M(split=(I,) * 4),
                       r"experts\.mlp\.w2$": A("matrices Muon cannot be given")}
# GPT-2 / OpenAI GPT: Conv1D, x @ W (in, out); c_attn's output split(split_size, dim=2) [Q | K | V].
ARCH_ROUTES["gpt2"] = ARCH_ROUTES["openai-gpt"] = {r"c_attn\.weight": M(layout="in_out", split=(H, H, H)),
                                                  r"(c_proj|c_fc)\.weight": IN_OUT}
# GPTBigCode multi-query: c_attn (nn.Linear) split((H, head_dim, head_dim), dim=3).
ARCH_ROUTES["gpt_bigcode"] = {r"c_attn\.weight": M(split=(H, HD, HD))}
# Falcon: multi-query [Q; k; v]; the new decoder architecture per KV group [2 q heads; k; v].
ARCH_ROUTES["falcon"] = {r"query_key_value\.weight": M(split=(H, HD, HD))}
ARCH_ROUTES["falcon_new"] = {r"query_key_value\.weight": M(split=(HEADS // KV * HD, HD, HD))}

# MoE, transformers' experts (E, 2I, H) / (E, H, I): F.linear(x, W[e]), gate_up chunked; routers -> AdamW.
for _name, _i, _router in (("mixtral", I, r"mlp\.gate\.weight"), ("qwen2_moe", MOE_I, r"mlp\.gate\.weight"),
                           ("qwen3_moe", MOE_I, r"mlp\.gate\.weight"), ("olmoe", I, r"mlp\.gate\.weight"),
                           ("phimoe", I, r"mlp\.router\.weight"), ("granitemoe", I, r"router\.weight"),
                           ("granitemoeshared", I, r"router\.weight"), ("hunyuan_v1_moe", I, r"gate\.wg\.weight"),
                           ("ernie4_5_moe", MOE_I, r"mlp\.gate\.weight"), ("glm4_moe", MOE_I, r"mlp\.gate\.weight"),
                           ("dots1", MOE_I, r"mlp\.gate\.weight"), ("minimax", I, r"mlp\.gate\.weight"),
                           ("deepseek_v2", MOE_I, r"mlp\.gate\.weight"), ("deepseek_v3", MOE_I, r"mlp\.gate\.weight"),
                           ("jamba", I, r"router\.weight"), ("qwen3_next", MOE_I, r"mlp\.gate\.weight")):
    ARCH_ROUTES[_name] = {_router: ROUTER, r"experts\.gate_up_proj$": EXPERTS_GATE_UP(_i),
                          r"experts\.down_proj$": EXPERTS, r"shared_expert_gate\.weight": PLAIN}
ARCH_ROUTES["qwen2_moe"][r"shared_expert_gate\.weight"] = PLAIN  # (1, H): sigmoid(x W^T) * shared
ARCH_ROUTES["ernie4_5_moe"][r"e_score_correction_bias"] = ("frozen", "")
# GraniteMoeShared: shared_mlp.input_linear(x).chunk(2, -1), act(gate) * up.
ARCH_ROUTES["granitemoeshared"][r"shared_mlp\.input_linear\.weight"] = GATE_UP(I)
# MiniMax: see the per-head QKV above.
ARCH_ROUTES["minimax"][r"qkv_proj\.weight"] = M(split=(HD, HD, HD))
# DeepSeek-V2 / V3: MLA's low-rank factors each one matrix, whole (a recipe choice).
for _name in ("deepseek_v2", "deepseek_v3"):
    ARCH_ROUTES[_name][r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight"] = PLAIN
# Llama 4: Llama4TextExperts, bmm(x, gate_up_proj (E, H, 2I)).chunk(2, -1) and bmm(., down_proj (E, I, H)).
ARCH_ROUTES["llama4_text"] = {r"router\.weight": ROUTER, r"experts\.gate_up_proj$": M("batch", "in_out", (I, I)),
                              r"experts\.down_proj$": EXPERTS_IN_OUT}
# gpt-oss: (E, H, 2I) with gate and up interleaved (gate_up[..., ::2], [..., 1::2]); biases and sinks AdamW.
ARCH_ROUTES["gpt_oss"] = {r"router\.weight": ROUTER, r"experts\.gate_up_proj$": M("batch", "in_out", (1, 1)),
                          r"experts\.down_proj$": EXPERTS_IN_OUT, r"experts\.\w+_bias$": A("expert bias"),
                          r"sinks$": A("")}
# JetMoE: MoE MLP input_linear (E, 2I, H) per expert (F.linear(x_e, W[e]), outputs concatenated back in
# token order, then chunk(2, -1)): per expert [gate; up]; attention experts (E, H, H) per expert;
# kv_proj(x).chunk(2, -1): [K; V].
ARCH_ROUTES["jetmoe"] = {r"router\.layer\.weight": ROUTER, r"mlp\.input_linear\.weight": EXPERTS_GATE_UP(I),
                         r"(input|output)_linear\.weight": EXPERTS, r"kv_proj\.weight": M(split=(H, H))}
# Qwen3-Next: gated attention q_proj per head [q; gate]; Gated DeltaNet in_proj_qkvz viewed per key head
# (2 of them) and split [q 8; k 8; v 16; z 16]; in_proj_ba per key head [b 2; a 2]; the depthwise conv1d
# and A_log elementwise.
ARCH_ROUTES["qwen3_next"].update({r"self_attn\.q_proj\.weight": M(split=(HD, HD)),
                                  r"in_proj_qkvz\.weight": M(split=(8, 8, 16, 16)),
                                  r"in_proj_ba\.weight": M(split=(2, 2)), r"conv1d\.weight": A(""),
                                  r"A_log": A(""), r"dt_bias": A("")})
# Mamba / Falcon-Mamba: in_proj(x).chunk(2) [x; z]; x_proj(x) split [dt_rank; B; C]; A_log (d, N) only
# -exp(A_log) elementwise (a 2-D non-matrix -> AdamW); conv1d depthwise.
_MAMBA = {r"A_log": A("not a matrix"), r"conv1d\.weight": A(""), r"mixer\.D$": A("")}
ARCH_ROUTES["mamba"] = ARCH_ROUTES["falcon_mamba"] = {
    **_MAMBA, r"mixer\.in_proj\.weight": M(split=(48, 48)), r"x_proj\.weight": M(split=(2, 16, 16))}
ARCH_ROUTES["jamba"].update({r"mamba\.in_proj\.weight": M(split=(64, 64)), r"x_proj\.weight": M(split=(4, 16, 16)),
                             r"A_log": A("not a matrix"), r"conv1d\.weight": A(""), r"mamba\.D$": A("")})
# Mamba2 / Bamba / Falcon-H1 / Zamba2: in_proj(x).split([I, conv_dim, heads]) [z; xBC; dt], xBC split
# again after the depthwise convolution into [x (I); B (groups·N); C (groups·N)]: five matrices.
for _name, _state in (("mamba2", 16), ("bamba", 256), ("falcon_h1", 256), ("zamba2", 64)):
    ARCH_ROUTES.setdefault(_name, {}).update({r"in_proj\.weight": M(split=(64, 64, _state, _state, 8)),
                                              r"A_log": A(""), r"conv1d\.weight": A(""), r"\.D$": A("")})
# Zamba2's shared MLP: (gate_up_proj(x) + adapter(x)).chunk(2): both [gate; up] (the adapter's
# second factor too); its first factor (rank 4, H) is plain.
ARCH_ROUTES["zamba2"].update({r"feed_forward\.gate_up_proj\.weight": GATE_UP(I),
                              r"gate_up_proj_adapter_list\.\d+\.1\.weight": GATE_UP(I)})
# Zamba: in_proj(x).view(b, -1, 2, t).chunk(2, 2): x and gate interleaved; x_proj_weight (heads, dt+2N, d)
# per head, split [dt; B; C]; dt_proj_weight per head; dt_proj_bias, A_log elementwise.
ARCH_ROUTES["zamba"] = {r"mamba\.in_proj\.weight": M(split=(1, 1)), r"x_proj_weight": M("batch", split=(4, 16, 16)),
                        r"dt_proj_weight": EXPERTS, r"dt_proj_bias": A("not a matrix"), r"A_log": A(""),
                        r"conv1d\.weight": A(""), r"\.D$": A("")}
# RecurrentGemma: rg_lru gate weights (heads, d, d) used through baddbmm(bias, x, W): per-head (in, out);
# their (heads, d) biases only added (2-D non-matrices -> AdamW); conv_1d depthwise.
ARCH_ROUTES["recurrent_gemma"] = {r"gate_weight$": EXPERTS_IN_OUT, r"gate_bias$": A("not a matrix"),
                                  r"conv_1d\.weight": A(""), r"recurrent_param": A("")}
# RWKV: time_mix_* (1, 1, H) mixing coefficients, elementwise.
ARCH_ROUTES["rwkv"] = {r"time_": A(""), r"(key|value|receptance|output)\.weight": PLAIN}
# Gemma-3n: altup_unembed_projections are hidden (H, H) matrices despite their name; per-layer input
# embeddings a lookup table; altup / laurel small matrices multiplied as stored.
ARCH_ROUTES["gemma3n_text"] = {r"altup_(un)?embed_projections\.\d+\.weight": PLAIN,
                               r"embed_tokens_per_layer": A("embedding"), r"correct_output_scale": A(""),
                               r"\.weight$": None}  # the common rows
# Encoders. BERT pre-training: the (2, H) next-sentence head and the tied decoder AdamW, the LM
# transform dense a hidden matrix. RoBERTa / ModernBERT: lm_head.dense / head.dense hidden despite the
# head name. ModernBERT: Wqkv(x).view(b, t, 3, heads, hd) [Q; K; V]; Wi(x).chunk(2): act(input) * gate.
ARCH_ROUTES["bert"] = {r"seq_relationship\.weight": A("output head"), r"transform\.dense\.weight": PLAIN}
ARCH_ROUTES["roberta"] = {r"lm_head\.dense\.weight": PLAIN, r"lm_head\.": A("")}
ARCH_ROUTES["electra"] = {r"embeddings_project\.weight": PLAIN, r"generator_predictions\.dense\.weight": PLAIN}
ARCH_ROUTES["albert"] = {r"embedding_hidden_mapping_in\.weight": PLAIN, r"predictions\.dense\.weight": PLAIN}
ARCH_ROUTES["distilbert"] = {r"vocab_transform\.weight": PLAIN}
ARCH_ROUTES["deberta-v2"] = {}
ARCH_ROUTES["modernbert"] = {r"Wqkv\.weight": M(split=(H, H, H)), r"Wi\.weight": GATE_UP(I),
                             r"head\.dense\.weight": PLAIN, r"head\.norm": A("")}
# T5: relative_attention_bias an nn.Embedding; BART: as Llama (encoder and decoder, cross-attention).
ARCH_ROUTES["t5"] = {r"relative_attention_bias": A("embedding")}
ARCH_ROUTES["bart"] = {}
# XLNet: q / k / v / r (d_model, heads, head_dim) through einsum("ibh,hnd->ibnd"): one (in, out) matrix
# each; o einsum("ibnd,hnd->ibh"): (out, in); r_w_bias / r_r_bias / r_s_bias (heads, d) added (AdamW);
# seg_embed (2, heads, d) multiplied with the query per segment (a lookup by segment, AdamW).
ARCH_ROUTES["xlnet"] = {r"rel_attn\.(q|k|v|r)$": M("flatten", "in_out"), r"rel_attn\.o$": M("flatten"),
                        r"r_\w_bias$": A("not a matrix"), r"seg_embed|mask_emb": A("")}
# Vision: patch embeddings are convolutions (AdamW), cls token and position embeddings AdamW;
# Swin's relative_position_bias_table (window², heads) an index lookup (AdamW).
ARCH_ROUTES["vit"] = {r"cls_token|patch_embeddings": A("")}
ARCH_ROUTES["swin"] = {r"relative_position_bias_table": A("lookup"), r"patch_embeddings": A("")}
# CLIP: text / visual projections give the model's outputs (AdamW, output heads); class_embedding.
ARCH_ROUTES["clip"] = {r"(text|visual)_projection\.weight": A("output head"), r"class_embedding|patch_embedding": A(""),
                       r"logit_scale": A("scalar")}
# Whisper: the encoder's two convolutions (not depthwise) -> AdamW, with a warning (not read).
ARCH_ROUTES["whisper"] = {r"encoder\.conv\d\.weight": A(""), r"encoder\.embed_positions": ("frozen", "")}

# Every configuration above builds and traces on CPU: 81 on the meta device; BART, BioGPT, DBRX,
# DeBERTa-v2, Falcon (both layouts), GPT-2, JetMoE and OpenAI GPT on the real weights (a forward reading
# a value: a padding mask, an expert's token count).


def expected(arch: str, name: str):
    """The route of parameter ``name`` of ``arch``: the first row of its own rules, then of COMMON."""
    import re

    for table in (ARCH_ROUTES[arch], COMMON):
        for pattern, route in table.items():
            if route is not None and re.search(pattern, name):
                return route
    return None

# What the routing must say (warnings) for each architecture; the others route without a word.
# A name table read against the use: the use wins, said (ELECTRA's and ALBERT's embedding projections,
# RoBERTa's and ModernBERT's head transforms are hidden matrices named like embeddings / heads).
WARNINGS: dict[str, tuple[str, ...]] = {
    "albert": ("embedding_hidden_mapping_in.weight (embedding",),
    "electra": ("embeddings_project.weight (embedding",),
    "roberta": ("lm_head.dense.weight (output head",),
    "modernbert": ("head.dense.weight (output head",),
    "dbrx": ("ffn.experts.mlp.w2: matrices stacked along their input dim",),
    "whisper": ("model.encoder.conv1.weight: used by convolution", "belong to modules the routing does not know"),
    "xlnet": ("routed by their shape alone (no use seen, no table): ['transformer.mask_emb']",
              "belong to modules the routing does not know"),
}
