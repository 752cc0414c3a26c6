"""Routing by use on models whose parameters are DTensors (megatron_eopt.param_use_sharded), on 2
gloo ranks (sharded_routing_worker.py): FSDP2 and hand-made DTensor models route exactly as the
unsharded model, with no collective; a tensor-parallel model is refused with the parameter named."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from dist_harness import run_workers

    return run_workers("sharded_routing_worker.py", tmp_path_factory.mktemp("sharded_routing"), 2, 0, "all",
                       timeout=300)


@pytest.fixture(scope="module")
def unsharded():
    from sharded_routing_worker import models, rows

    return {name: rows(model, inputs) for name, model, inputs in models()}


@pytest.mark.parametrize("name", ["mixed", "gpt2", "qwen3_moe"])
def test_fsdp2_model_routes_as_the_unsharded_one(ranks, unsharded, name):
    ref_rows, ref_warnings = unsharded[name]
    assert any(r[-1] == "use" for r in ref_rows)  # the reference was traced: the comparison reads uses
    for saved in ranks:
        got_rows, got_warnings = saved[("fsdp", name)]
        assert got_rows == ref_rows
        assert got_warnings == ref_warnings
        assert saved[("fsdp", name, "collectives")] == 0  # FSDP2's hooks set aside: nothing gathered
        assert saved[("fsdp", name, "grads")]  # and back in place: a training step still runs sharded


def test_mixed_model_is_read_by_use(unsharded):
    routes = {r[0][0]: r for r in unsharded["mixed"][0]}
    qkv, experts, router = routes["layers.0.qkv"], routes["layers.0.ups"], routes["layers.0.router"]
    assert qkv[2] == "muon" and qkv[-1] == "use" and "output split" in qkv[3]
    assert experts[2] == "muon" and dict(experts[7])["nd_mode"] == "batch"
    assert dict(experts[7])["matrix_layout"] == "in_out"
    assert router[2] == "adamw" and "router" in router[3]
    assert "fused gate/up split" in routes["layers.0.gate_up.weight"][3]


def test_hand_made_dtensors_route_as_the_unsharded_model(ranks, unsharded):
    for saved in ranks:
        assert saved[("dtensor", "mixed")] == unsharded["mixed"]


def test_tensor_parallel_model_is_refused_by_name(ranks):
    for saved in ranks:
        for what in ("route", "trace"):
            message = saved[("tp", what)]
            assert message is not None, what
            assert "'0.weight'" in message and "tensor parallelism" in message, message
            assert "Shard(dim=0)" in message and "example_inputs=False" in message, message


def test_tensor_parallel_transformers_model_without_inputs_is_routed_without_a_trace(ranks):
    for saved in ranks:
        routes, seen = saved[("tp", "llama")]
        q = "model.layers.0.self_attn.q_proj.weight"
        assert routes[q] == ("muon", "shape") and routes["model.layers.0.mlp.up_proj.weight"] == ("muon", "shape")
        assert routes["model.embed_tokens.weight"][0] == "adamw" and routes["lm_head.weight"][0] == "adamw"
        assert any("the forward is not traced" in m and repr(q) in m for m in seen), seen
