"""The 2-D hidden matrices Muon updates in real models (nn.Linear layout: (out_features, in_features)).

Embeddings, output heads, norms and biases go to AdamW in every Muon recipe, so they are left out.
"""

from __future__ import annotations


def gpt2_124m() -> list[tuple[int, int]]:
    """GPT-2 small: 12 layers, d_model 768, fused QKV (2304 rows), MLP 3072."""
    d, layers = 768, 12
    per_layer = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    return per_layer * layers


def gpt2_layer() -> list[tuple[int, int]]:
    """One GPT-2 small decoder layer: QKV 2304 x 768, projection 768 x 768, MLP 3072 x 768 and 768 x 3072."""
    return gpt2_124m()[:4]


def demo_gpt() -> list[tuple[int, int]]:
    """The hidden matrices of examples/train_gpt.py's model (4 layers, d_model 256): 16 small matrices."""
    d, layers = 256, 4
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers


def llama_layer(hidden: int, heads: int, kv_heads: int, ffn: int) -> list[tuple[int, int]]:
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden), (hidden, ffn)]


def llama_1b() -> list[tuple[int, int]]:
    """Llama-3.2-1B: 16 layers, hidden 2048, 32 heads / 8 KV heads, FFN 8192 (0.97 B matrix params)."""
    return llama_layer(2048, 32, 8, 8192) * 16


def llama_8b_layers(layers: int = 4) -> list[tuple[int, int]]:
    """Llama-3-8B decoder layers: hidden 4096, 32 heads / 8 KV heads, FFN 14336 (218 M params each)."""
    return llama_layer(4096, 32, 8, 14336) * layers


def qwen3_moe_layer(expert_rows: int = 2048, q_rows: int = 2048) -> list[tuple[int, int]]:
    """Qwen3-30B-A3B MoE layer: q/o, k/v 512x2048, router 128x2048, 128 experts x (gate, up, down).

    The defaults are the benchmark shapes of docs/benchmarks.md (experts 2048x2048); the real model has 768-row
    gate/up (and 768-column down) experts and a 4096-row q projection.
    """
    hidden, experts = 2048, 128
    attention = [(q_rows, hidden), (512, hidden), (512, hidden), (hidden, q_rows)]
    router = [(experts, hidden)]
    per_expert = [(expert_rows, hidden), (expert_rows, hidden), (hidden, expert_rows)]
    return attention + router + per_expert * experts


def llama_1b_layer() -> list[tuple[int, int]]:
    """One decoder layer of Llama-3.2-1B (61 M params): the seven matrices of llama_1b()."""
    return llama_layer(2048, 32, 8, 8192)


def qwen3_moe_experts(experts: int = 8) -> list[tuple[int, int]]:
    """A Qwen3-30B-A3B MoE layer with its real shapes (q 4096 x 2048, k/v 512 x 2048, o 2048 x 4096,
    router 128 x 2048) and `experts` of its 128 experts (gate/up 768 x 2048, down 2048 x 768):
    the rectangular expert matrices of a MoE model at a size a CPU steps in seconds."""
    return qwen3_moe_layer(expert_rows=768, q_rows=4096)[: 5 + 3 * experts]


def tiny_gpt() -> list[tuple[int, int]]:
    """A 2-layer, d_model 64 GPT for quick runs: every code path, hardly any work."""
    d = 64
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 2


def numel(shapes: list[tuple[int, int]]) -> int:
    return sum(m * n for m, n in shapes)
