import types

import pytest
import torch

from megatron_eopt import registry
from megatron_eopt.optim import TensorParallelAdaptiveMuon, TensorParallelMuon
from megatron_eopt.registry import EmergingOptimizerEntry, ParamRule


@pytest.fixture
def isolated_registry(monkeypatch):
    registry.names()  # built-ins loaded before the copy
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))


def _megatron_like_config(**overrides):
    """The fields of Megatron-LM's OptimizerConfig the entries read, with non-default values."""
    fields = dict(
        lr=0.02,
        weight_decay=0.1,
        decoupled_weight_decay=True,
        muon_momentum=0.9,
        muon_nesterov=True,
        muon_split_qkv=True,
        muon_fp32_matmul_prec="highest",
        muon_coefficient_type="polar_express",
        muon_num_ns_steps=7,
        muon_scale_mode="shape_scaling",
        muon_extra_scale_factor=0.2,
        muon_tp_mode="duplicated",
        adaptive_muon_moment2_method="normuon",
        adaptive_muon_beta2=0.9,
        adaptive_muon_eps=1e-6,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def _model_chunk(heads=8, groups=2, kv=16, gate=False):
    cfg = types.SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=kv,
                                attention_output_gate=gate)
    return types.SimpleNamespace(config=cfg)


def test_builtin_entries():
    assert {"muon", "adaptive_muon"} <= set(registry.names())
    assert registry.names() == sorted(registry.names())
    assert registry.get("muon").optimizer_cls is TensorParallelMuon
    assert registry.get("adaptive_muon").optimizer_cls is TensorParallelAdaptiveMuon
    for name in ("muon", "adaptive_muon"):
        entry = registry.get(name)
        assert entry.init_state_fn is registry.init_optimizer_state
        ((rule, override),) = entry.default_param_overrides.items()
        assert isinstance(rule, ParamRule) and override == {"optimizer": "adam"}


def test_default_rule_routes_like_megatron():
    rule = next(iter(registry.get("muon").default_param_overrides))
    tagged = torch.nn.Parameter(torch.randn(8, 4))
    tagged.is_embedding_or_output_parameter = True
    assert rule(torch.randn(4)) and rule(torch.randn(())) and rule(torch.randn(2, 3, 4)) and rule(tagged)
    assert not rule(torch.randn(8, 4))
    flagged = torch.nn.Parameter(torch.randn(8, 4))
    flagged.use_muon = False  # Megatron-LM's explicit exclusion
    assert rule(flagged) and registry.is_muon_excluded(flagged)
    flagged.use_muon = True
    assert not rule(flagged)
    assert registry.uses_default_routing(registry.get("muon"))
    own = EmergingOptimizerEntry(TensorParallelMuon, default_param_overrides={ParamRule("x", lambda p: True): {"optimizer": "adam"}})
    assert not registry.uses_default_routing(own)


def test_unknown_name_lists_registered():
    with pytest.raises(KeyError, match="registered: .*muon"):
        registry.get("no_such_optimizer")


def test_register_get_replace(isolated_registry):
    entry = EmergingOptimizerEntry(torch.optim.SGD, config_to_kwargs=lambda c, m, pg: {"lr": c.lr})
    registry.register("plain_sgd", entry)
    assert registry.get("plain_sgd") is entry and "plain_sgd" in registry.names()
    with pytest.raises(ValueError, match="already registered"):
        registry.register("plain_sgd", entry)
    other = EmergingOptimizerEntry(torch.optim.SGD)
    registry.register("plain_sgd", other, replace=True)
    assert registry.get("plain_sgd") is other
    # an entry's default overrides are its own dict (not shared between entries)
    assert entry.default_param_overrides is not other.default_param_overrides


@pytest.mark.parametrize(
    "name, entry, error, match",
    [
        ("x", object(), TypeError, "EmergingOptimizerEntry"),
        ("x", EmergingOptimizerEntry(dict), TypeError, "optimizer_cls"),
        ("x", EmergingOptimizerEntry(torch.optim.SGD, init_state_fn=3), TypeError, "init_state_fn"),
        ("adam", EmergingOptimizerEntry(torch.optim.SGD), ValueError, "reserved"),
        ("", EmergingOptimizerEntry(torch.optim.SGD), TypeError, "non-empty"),
    ],
)
def test_register_rejects_bad_input(isolated_registry, name, entry, error, match):
    before = registry.names()
    with pytest.raises(error, match=match):
        registry.register(name, entry)
    assert registry.names() == before


def test_qkv_split_shapes():
    assert registry.qkv_split_shapes_from_model_config(_model_chunk().config) == [64, 16, 16]
    assert registry.qkv_split_shapes_from_model_config(_model_chunk(gate=True).config) == [64, 64, 16, 16]
    mha = types.SimpleNamespace(num_attention_heads=4, num_query_groups=None, kv_channels=8)
    assert registry.qkv_split_shapes_from_model_config(mha) == [8, 8, 8]


def test_config_to_kwargs_maps_megatron_fields():
    config = _megatron_like_config()
    pg = object()
    kwargs = registry.get("muon").config_to_kwargs(config, [_model_chunk()], pg)
    assert kwargs.pop("pg_collection") is pg
    is_qkv = kwargs.pop("is_qkv_fn")
    assert kwargs == dict(
        lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, split_qkv=True, fp32_matmul_prec="highest",
        coefficient_type="polar_express", num_ns_steps=7, scale_mode="shape_scaling", extra_scale_factor=0.2,
        tp_mode="duplicated", qkv_split_shapes=[64, 16, 16],
    )
    tagged = torch.nn.Parameter(torch.randn(2, 2))
    tagged.is_qkv = True
    assert is_qkv(tagged) and not is_qkv(torch.nn.Parameter(torch.randn(2, 2)))

    adaptive = registry.get("adaptive_muon").config_to_kwargs(config, [_model_chunk()], pg)
    assert (adaptive["moment2_method"], adaptive["beta2"], adaptive["eps"]) == ("normuon", 0.9, 1e-6)
    assert adaptive["coefficient_type"] == "polar_express"


def test_config_to_kwargs_leaves_missing_fields_to_defaults():
    config = types.SimpleNamespace(lr=0.1, weight_decay=0.0)
    kwargs = registry.get("muon").config_to_kwargs(config, [types.SimpleNamespace()], None)
    assert kwargs["split_qkv"] is False and kwargs["qkv_split_shapes"] is None
    assert set(kwargs) == {"lr", "weight_decay", "split_qkv", "is_qkv_fn", "qkv_split_shapes", "pg_collection"}
    opt = TensorParallelMuon([torch.nn.Parameter(torch.randn(4, 3))], **kwargs)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("name, method", [("muon", None), ("adaptive_muon", "adamuon"), ("adaptive_muon", "normuon")])
def test_entry_builds_and_init_state_creates_everything(name, method):
    entry = registry.get(name)
    config = _megatron_like_config(adaptive_muon_moment2_method=method, muon_split_qkv=False)
    kwargs = entry.config_to_kwargs(config, [_model_chunk()], None)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((6, 4), (4, 6), (5, 5))]
    params[0].grad = torch.randn(6, 4)  # the others have no grad yet
    opt = entry.optimizer_cls(params, **kwargs)
    entry.init_state_fn(opt, config)
    for p in params:
        state = opt.state[p]
        assert state["momentum_buffer"].shape == p.shape
        assert torch.count_nonzero(state["momentum_buffer"]) == 0
        if method == "adamuon":
            assert state["moment2_buffer"].shape == p.shape
        elif method == "normuon":
            assert state["moment2_buffer"].numel() == max(p.shape) and state["moment2_buffer"].dim() == 2
        else:
            assert "moment2_buffer" not in state
    # the state dict now has an entry per parameter: what a checkpoint loader needs
    assert len(opt.state_dict()["state"]) == len(params)


def test_init_state_fn_uses_emerging_optimizers_style_init_group():
    class EOStyle(torch.optim.SGD):
        def _init_group(self, group, skip_non_grad_params=True):
            for p in group["params"]:
                if skip_non_grad_params and p.grad is None:
                    continue
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    p = torch.nn.Parameter(torch.randn(3, 3))
    opt = EOStyle([p], lr=0.1)
    registry.init_optimizer_state(opt)
    assert opt.state[p]["momentum_buffer"].shape == (3, 3)
    with pytest.raises(TypeError, match="cannot create its state"):
        registry.init_optimizer_state(torch.optim.SGD([p], lr=0.1))


def test_layer_sharded_fields_reach_the_class():
    """The layer-sharded mode's config attributes (muon_tp_mode="layer_sharded", muon_ns_batch_size,
    muon_expert_tp_mode; set from Python, no Megatron-LM flags) map to the class, which refuses bad
    values naming them."""
    config = _megatron_like_config(muon_tp_mode="layer_sharded", muon_ns_batch_size=32,
                                   muon_expert_tp_mode="layer_sharded")
    kwargs = registry.get("muon").config_to_kwargs(config, [_model_chunk()], None)
    assert (kwargs["tp_mode"], kwargs["ns_batch_size"], kwargs["expert_tp_mode"]) == ("layer_sharded", 32,
                                                                                       "layer_sharded")
    opt = TensorParallelMuon([torch.nn.Parameter(torch.randn(4, 3))], **kwargs)
    assert (opt.tp_mode, opt.ns_batch_size, opt.expert_tp_mode) == ("layer_sharded", 32, "layer_sharded")
    for field, value in (("muon_ns_batch_size", 0), ("muon_expert_tp_mode", "sharded")):
        bad = registry.get("adaptive_muon").config_to_kwargs(_megatron_like_config(**{field: value}),
                                                              [_model_chunk()], None)
        with pytest.raises(ValueError, match=field.removeprefix("muon_")):
            registry.get("adaptive_muon").optimizer_cls([torch.nn.Parameter(torch.randn(4, 3))], **bad)


def test_every_prefixed_field_reaches_the_argument_of_its_name():
    """Megatron-LM's rule from the config's side: any ``muon_<name>`` field, not only a fixed table,
    reaches the argument ``<name>``; ``adaptive_muon_<name>`` wins over ``muon_<name>`` for AdaMuon."""
    config = _megatron_like_config(muon_use_syrk=False, muon_ns_products="full", muon_row_equilibration=True,
                                   muon_momentum=0.8, adaptive_muon_momentum=0.7)
    kwargs = registry.get("muon").config_to_kwargs(config, [_model_chunk()], None)
    assert (kwargs["use_syrk"], kwargs["ns_products"], kwargs["row_equilibration"]) == (False, "full", True)
    assert kwargs["momentum"] == 0.8
    adaptive = registry.get("adaptive_muon").config_to_kwargs(config, [_model_chunk()], None)
    assert adaptive["momentum"] == 0.7 and adaptive["ns_products"] == "full"
    TensorParallelAdaptiveMuon([torch.nn.Parameter(torch.randn(4, 3))], **adaptive)


@pytest.mark.parametrize("name", ["muon", "adaptive_muon"])
def test_unknown_prefixed_field_is_an_error_naming_it(name):
    """A ``muon_*`` field neither the constructor nor megatron-eopt knows is refused, never dropped:
    a dataclass field or an attribute set on the config alike."""
    config = _megatron_like_config(muon_split_mlp=True)
    with pytest.raises(registry.UnknownConfigFieldError, match=r"'muon_split_mlp' \(argument 'split_mlp'\).*megatron-core"):
        registry.get(name).config_to_kwargs(config, [_model_chunk()], None)
    config = _megatron_like_config()
    config.muon_split_mlp = False
    config.muon_no_such_option = 1
    with pytest.raises(ValueError, match="'muon_split_mlp'.*'muon_no_such_option'"):
        registry.get(name).config_to_kwargs(config, [_model_chunk()], None)
    if name == "adaptive_muon":
        with pytest.raises(ValueError, match=r"'adaptive_muon_beta3' \(argument 'beta3'\)"):
            registry.get(name).config_to_kwargs(_megatron_like_config(adaptive_muon_beta3=0.9), [_model_chunk()], None)
    else:  # the adaptive fields are not Muon's: left alone, as Megatron-LM does
        registry.get(name).config_to_kwargs(_megatron_like_config(adaptive_muon_beta3=0.9), [_model_chunk()], None)


def test_consumed_and_renamed_fields():
    """Fields read elsewhere (Megatron-LM's scalar optimizer, our clip policy) are not constructor
    arguments; an older spelling (muon_use_nesterov) reaches its argument unless the new one is there."""
    assert set(registry.CONSUMED_CONFIG_FIELDS) >= {"muon_scalar_optimizer", "muon_clip_policy"}
    config = _megatron_like_config(muon_scalar_optimizer="lion", muon_clip_policy="separate")
    kwargs = registry.get("muon").config_to_kwargs(config, [_model_chunk()], None)
    assert not {"scalar_optimizer", "clip_policy"} & set(kwargs)
    old = _megatron_like_config(muon_use_nesterov=False)
    del old.muon_nesterov
    assert registry.get("muon").config_to_kwargs(old, [_model_chunk()], None)["nesterov"] is False
    both = _megatron_like_config(muon_use_nesterov=False)  # muon_nesterov=True wins
    assert registry.get("muon").config_to_kwargs(both, [_model_chunk()], None)["nesterov"] is True


def test_family_entries_read_their_own_prefix_and_the_muon_fields_they_take():
    """Megatron-LM reads ``<entry name>_*`` fields for the other optimizers; ours also the ``muon_*``
    fields the class takes. Megatron Muon's options a class has no use for are left out; anything
    else unknown under either prefix raises."""
    from megatron_eopt.optim import Scion

    config = _megatron_like_config(scion_spectral_radius=30.0, muon_use_syrk=True)
    kwargs = registry.get("scion").config_to_kwargs(config, [_model_chunk()], None)
    assert kwargs["spectral_radius"] == 30.0 and kwargs["num_ns_steps"] == 7 and kwargs["momentum"] == 0.9
    assert "split_qkv" not in kwargs and "tp_mode" not in kwargs and "use_syrk" not in kwargs
    Scion([torch.nn.Parameter(torch.randn(4, 3))], **kwargs)
    with pytest.raises(ValueError, match="'scion_radius'"):
        registry.get("scion").config_to_kwargs(_megatron_like_config(scion_radius=1.0), [_model_chunk()], None)
    with pytest.raises(ValueError, match="'muon_split_mlp'"):
        registry.get("scion").config_to_kwargs(_megatron_like_config(muon_split_mlp=True), [_model_chunk()], None)
    hyperball = registry.get("muon_hyperball").config_to_kwargs(
        _megatron_like_config(muon_hyperball_radius=2.0, muon_ns_eps=1e-7), [_model_chunk()], None)
    assert (hyperball["hyperball_radius"], hyperball["ns_eps"], hyperball["num_ns_steps"]) == (2.0, 1e-7, 7)
    with pytest.raises(ValueError, match="muon_hyperball_radius"):
        registry.get("muon_hyperball").config_to_kwargs(_megatron_like_config(), [_model_chunk()], None)
