"""One rank of test_routing_sharded.py (gloo on CPU): models whose parameters are DTensors routed by
the use their forward makes of them, as the unsharded model is.

Cases: ``fsdp``: FSDP2 (``fully_shard`` on every block, then the model) on a hand-written model (a
bare fused per-head QKV, a chunked gate/up, (in, out) expert stacks through ``bmm``, a router) and on
tiny GPT-2 and Qwen3-MoE (their dummy inputs); ``dtensor``: the same hand-written model with its
parameters made ``Shard(0)`` / ``Shard(1)`` DTensors by hand; ``tp``: a tensor-parallel MLP
(``parallelize_module``), which the trace refuses by name, and a tensor-parallel Llama routed without
example inputs (by the tables and shapes, with a warning). Each rank saves its route table rows,
whether the routing ran a collective, and the errors and warnings met.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import counted_collectives, init_from_argv
from worker_exit import exits_without_teardown

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast",
               "all_to_all_single")


class Block(nn.Module):
    """Attention with a fused per-head QKV as a bare Parameter, a chunked gate/up, (in, out) experts."""

    def __init__(self, c=16, heads=4, experts=4, f=8):
        super().__init__()
        self.heads, self.d, self.experts = heads, c // heads, experts
        self.qkv = nn.Parameter(torch.randn(3 * c, c) / 4)
        self.out = nn.Parameter(torch.randn(c, c) / 4)
        self.gate_up = nn.Linear(c, 2 * f, bias=False)
        self.down = nn.Linear(f, c, bias=False)
        self.router = nn.Parameter(torch.randn(experts, c) / 4)
        self.ups = nn.Parameter(torch.randn(experts, c, f) / 4)
        self.downs = nn.Parameter(torch.randn(experts, f, c) / 4)
        self.norm = nn.Parameter(torch.ones(c))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = F.linear(x * self.norm, self.qkv).view(b, t, self.heads, 3, self.d).unbind(3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, c), self.out)
        gate, up = self.gate_up(x).chunk(2, -1)
        x = x + self.down(F.silu(gate) * up)
        weights, _ = F.linear(x, self.router).softmax(-1).topk(2, -1)
        h = x.reshape(1, b * t, c).expand(self.experts, b * t, c)
        experts = torch.bmm(F.silu(torch.bmm(h, self.ups)), self.downs).sum(0).view(b, t, c)
        return x + experts * weights.sum(-1, keepdim=True)


class Mixed(nn.Module):
    def __init__(self, vocab=32, c=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, c)
        self.layers = nn.ModuleList(Block(c) for _ in range(layers))
        self.head = nn.Linear(c, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def hf_model(name: str):
    import transformers as T

    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    config = {
        "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0,
                                     eos_token_id=0),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
    }[name]()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.AutoModelForCausalLM.from_config(config).float()


def models():
    """(name, the model unsharded, example_inputs): each built the same on every rank and in the test."""
    torch.manual_seed(0)
    return [("mixed", Mixed(), (torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),)),
            ("gpt2", hf_model("gpt2"), None), ("qwen3_moe", hf_model("qwen3_moe"), None)]


def rows(model, example_inputs):
    """The route table's rows (everything it says of each parameter) and the warnings of routing."""
    from megatron_eopt import route_parameters

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table, _ = route_parameters(model, example_inputs=example_inputs)
    return [(r.names, r.shape, r.optimizer, r.reason, r.weight_decay, r.view, r.scale, r.group_keys, r.source)
            for r in table], sorted(str(w.message) for w in seen)


def _blocks(model):
    return [m for m in model.modules() if isinstance(m, nn.ModuleList)][0]


def _shard_by_hand(model, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            dim = 1 if p.dim() >= 2 and p.shape[0] % mesh.size() else 0
            sharded = distribute_tensor(p.detach(), mesh, [Shard(dim)], src_data_rank=None)
            setattr(module, pname, nn.Parameter(sharded, requires_grad=p.requires_grad))


@exits_without_teardown
def main():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from megatron_eopt.param_use import trace_parameter_uses

    rank, world, seed, out, case = init_from_argv()
    mesh = init_device_mesh("cpu", (world,))
    saved = {}
    for name, model, inputs in models():
        for blocks in _blocks(model):
            fully_shard(blocks, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(hasattr(p, "device_mesh") for p in model.parameters())
        with counted_collectives(COLLECTIVES) as calls:
            saved[("fsdp", name)] = rows(model, inputs)
        saved[("fsdp", name, "collectives")] = sum(calls.values())
        # the hooks are back: a training forward / backward still gathers and reshards
        ids = inputs[0] if inputs else torch.tensor([[1, 2, 3, 4]])
        output = model(ids)
        (output.logits if hasattr(output, "logits") else output).float().square().mean().backward()
        saved[("fsdp", name, "grads")] = all(hasattr(p.grad, "device_mesh") for p in model.parameters())
    _, model, inputs = models()[0]
    _shard_by_hand(model, mesh)
    saved[("dtensor", "mixed")] = rows(model, inputs)

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 16, bias=False))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for what, call in (("route", lambda: rows(mlp, (torch.randn(2, 16),))),
                       ("trace", lambda: trace_parameter_uses(mlp, (torch.randn(2, 16),)))):
        try:
            call()
            saved[("tp", what)] = None
        except ValueError as exc:
            saved[("tp", what)] = str(exc)
    # a transformers model without example_inputs: not traced, said in a warning, routed by tables and shapes
    import transformers as T

    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=64))
    parallelize_module(llama.model.layers[0].self_attn, mesh, {"q_proj": ColwiseParallel(),
                                                               "o_proj": RowwiseParallel()})
    table_rows, seen = rows(llama, None)
    saved[("tp", "llama")] = ({r[0][0]: (r[2], r[-1]) for r in table_rows}, seen)
    torch.save(saved, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
