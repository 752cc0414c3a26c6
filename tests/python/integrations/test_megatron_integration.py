"""megatron-eopt inside Megatron-LM's own optimizer factory, on a real (small) GPTModel.

What runs: megatron-core's GPTModel (local layer spec, GQA, TP = PP = 1, one-rank gloo group)
does a forward/backward on CPU; ``megatron.core.optimizer.get_megatron_optimizer`` builds the
optimizer (param tagging, default param overrides, param groups, FP32Optimizer and
ChainedOptimizer wrappers) and ``ChainedOptimizer.step()`` runs. See megatron_cpu.py for the
three CUDA-only scalars redirected to the CPU.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
from typing import Any

import pytest
import torch
from paths import SUPPORT

import megatron_eopt
from megatron_eopt import _megatron_version
from megatron_eopt.integrations import megatron as integration
from megatron_eopt.optim import TensorParallelAdaptiveMuon, TensorParallelMuon

from reference import TOLERANCE, ns_tolerance, rel_err

import megatron_cpu  # noqa: E402

mcore_optimizer = megatron_cpu.megatron_optimizer_module()

needs_megatron = pytest.mark.skipif(mcore_optimizer is None, reason="megatron-core is not installed")


@pytest.fixture(scope="module")
def megatron_env():
    if mcore_optimizer is None:
        pytest.skip("megatron-core is not installed")
    import megatron_cpu

    with megatron_cpu.single_rank_megatron():
        yield megatron_cpu


@pytest.fixture
def stock_registry(megatron_env):
    """Each test starts from Megatron's own registry and leaves it that way."""
    integration.uninstall()
    yield mcore_optimizer.emerging_optimizers._EMERGING_OPTIMIZERS
    integration.uninstall()


def _config(optimizer, **fields):
    base = dict(optimizer=optimizer, lr=0.02, min_lr=0.0, weight_decay=0.1, clip_grad=0.0, bf16=False, fp16=False)
    base.update(fields)
    return mcore_optimizer.OptimizerConfig(**base)


def _inner_by_param_name(model, chained):
    """{parameter name: the torch optimizer that owns it} for a Megatron ChainedOptimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    owner = {}
    for wrapper in chained.chained_optimizers:
        for group in wrapper.optimizer.param_groups:
            for p in group["params"]:
                owner[names[id(p)]] = wrapper.optimizer
    return owner


@needs_megatron
def test_install_replaces_registry_entries_idempotently(stock_registry):
    table = stock_registry
    stock = dict(table)
    replaced = integration.install()
    assert {"muon", "adaptive_muon"} <= set(replaced)
    assert replaced["muon"] is stock["muon"] and replaced["adaptive_muon"] is stock["adaptive_muon"]
    assert table["muon"].optimizer_cls is TensorParallelMuon
    assert table["adaptive_muon"].optimizer_cls is TensorParallelAdaptiveMuon
    assert isinstance(table["muon"], mcore_optimizer.emerging_optimizers.EmergingOptimizerEntry)
    keys = list(table["muon"].default_param_overrides)
    assert keys and all(isinstance(key, mcore_optimizer.ParamKey) for key in keys)
    # Megatron's own routing keys, unchanged (plus use_muon = False where Megatron ignores it)
    assert set(stock["muon"].default_param_overrides) <= set(keys)
    assert integration.install() == {}  # idempotent
    assert integration.installed() == sorted(megatron_eopt.registry.names())
    integration.uninstall()
    assert table["muon"] is stock["muon"] and integration.installed() == []
    assert set(table) == set(stock)


@needs_megatron
def test_install_fills_config_to_cls_where_megatron_has_it(stock_registry, monkeypatch):
    """Megatron-LM's layer-sharded Muon chooses a class per tp mode through the entry's
    ``config_to_cls``: where the entry has that field, install() fills it with our class (which runs
    every mode itself), so no mode falls back to a stock class."""
    emerging = mcore_optimizer.emerging_optimizers

    @dataclasses.dataclass
    class EntryWithClassChoice(emerging.EmergingOptimizerEntry):
        config_to_cls: Any = None

    monkeypatch.setattr(emerging, "EmergingOptimizerEntry", EntryWithClassChoice)
    integration.install()
    try:
        for name, cls in (("muon", TensorParallelMuon), ("adaptive_muon", TensorParallelAdaptiveMuon)):
            config = types.SimpleNamespace(muon_tp_mode="layer_sharded", muon_expert_tp_mode="duplicated")
            assert stock_registry[name].config_to_cls(config) is cls
    finally:
        integration.uninstall()


@needs_megatron
@pytest.mark.parametrize("name, cls", [("muon", TensorParallelMuon), ("adaptive_muon", TensorParallelAdaptiveMuon)])
def test_factory_builds_tp_mode_auto(stock_registry, megatron_env, name, cls):
    """``--muon-tp-mode auto`` (Megatron-LM PR #6664) builds ours and steps; at TP 1 nothing is sharded,
    so every weight reports "replicated"."""
    model = megatron_env.build_gpt(seed=1)
    integration.install()
    config = _config(name, muon_tp_mode="auto")
    config.muon_expert_tp_mode = "auto"
    with megatron_env.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(config, [model])
        ours = [w.optimizer for w in chained.chained_optimizers if isinstance(w.optimizer, cls)]
        assert ours and all(opt.tp_mode == "auto" and opt.expert_tp_mode == "auto" for opt in ours)
        assert all(set(opt.tp_modes().values()) == {"replicated"} for opt in ours)
        before = [p.detach().clone() for p in model.parameters()]
        megatron_env.forward_backward(model, seed=0)
        assert chained.step()[0]
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@needs_megatron
def test_install_fills_constructor_only_kwargs_where_megatron_has_it(stock_registry, monkeypatch):
    """Megatron-LM's optimizer recipes (#5925) refuse an entry's ``constructor_only_kwargs`` per
    parameter group: where its entry has that field, install() hands ours on, every optimizer-wide
    argument (the #5925 list for its own classes among them), the per-group values left out."""
    emerging = mcore_optimizer.emerging_optimizers

    @dataclasses.dataclass
    class EntryWithConstructorOnly(emerging.EmergingOptimizerEntry):
        constructor_only_kwargs: frozenset = frozenset()

    monkeypatch.setattr(emerging, "EmergingOptimizerEntry", EntryWithConstructorOnly)
    integration.install()
    try:
        proposal = {"split_qkv", "is_qkv_fn", "qkv_split_shapes", "fp32_matmul_prec", "coefficient_type",
                    "num_ns_steps", "scale_mode", "extra_scale_factor", "use_decoupled_weight_decay",
                    "pg_collection", "tp_mode"}
        for name, per_group in (("muon", {"lr", "momentum", "weight_decay"}),
                                ("adaptive_muon", {"lr", "momentum", "weight_decay", "beta2", "eps"})):
            only = stock_registry[name].constructor_only_kwargs
            assert only == megatron_eopt.registry.get(name).constructor_only_kwargs
            assert proposal | {"use_syrk", "tp_mode", "state_dtype"} <= only and not per_group & only
            assert name == "muon" or "moment2_method" in only
    finally:
        integration.uninstall()


@needs_megatron
@pytest.mark.parametrize("name, cls", [("muon", TensorParallelMuon), ("adaptive_muon", TensorParallelAdaptiveMuon)])
def test_factory_builds_ours_and_routes_like_megatron(stock_registry, megatron_env, name, cls):
    model = megatron_env.build_gpt(seed=1)
    integration.install()
    with megatron_env.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config(name), [model])
    owner = _inner_by_param_name(model, chained)
    assert set(owner) == {n for n, _ in model.named_parameters()}
    ours = {n for n, opt in owner.items() if isinstance(opt, cls)}
    adam = {n for n, opt in owner.items() if isinstance(opt, torch.optim.AdamW)}
    # Megatron's rule: 2-D and not tagged embedding/output -> Muon; the rest -> Adam
    expected = {
        n for n, p in model.named_parameters()
        if p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)
    }
    assert ours == expected
    assert {f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in range(2)} <= ours
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"} <= adam
    assert ours | adam == set(owner)
    muon_opt = next(opt for opt in owner.values() if isinstance(opt, cls))
    assert muon_opt.qkv_split_shapes == [32, 16, 16]  # 4 heads / 2 groups x kv 16, then k, v
    qkv = dict(model.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.is_qkv and muon_opt.is_qkv_fn(qkv)


@needs_megatron
@pytest.mark.parametrize("name, cls", [("muon", TensorParallelMuon), ("adaptive_muon", TensorParallelAdaptiveMuon)])
def test_install_sets_the_state_dtype_and_workspace_of_what_megatron_builds(stock_registry, megatron_env, name, cls):
    model = megatron_env.build_gpt(seed=1)
    with pytest.raises(ValueError, match="workspace_mib"):
        integration.install(workspace_mib=0)
    with pytest.raises(ValueError, match="state_dtype"):
        integration.install(state_dtype="int4")

    def built(config):
        with megatron_env.megatron_optimizer_on_cpu():
            chained = mcore_optimizer.get_megatron_optimizer(config, [model])
        return next(opt for opt in _inner_by_param_name(model, chained).values() if isinstance(opt, cls))

    integration.install()
    default = built(_config(name))
    assert default.state_dtype == "fp32" and default.workspace_mib == "auto"
    integration.install(state_dtype="int8", workspace_mib=64)  # already installed: the options change
    ours = built(_config(name))
    assert ours.state_dtype == "int8" and ours.workspace_mib == 64
    config = _config(name)
    config.muon_workspace_mib = None  # the config's attribute wins, per build
    config.muon_state_dtype = "bf16"
    ours = built(config)
    assert ours.state_dtype == "bf16" and ours.workspace_mib is None
    integration.uninstall()
    integration.install()
    assert built(_config(name)).workspace_mib == "auto"  # uninstall forgot the options


def _emerging_optimizers_adaptive_muon_entry():
    """Emerging-Optimizers' AdaptiveMuon as a Megatron registry entry (no QKV split, TP = 1).

    The reference for "adaptive_muon": Megatron-LM 0.19.2's own TensorParallelAdaptiveMuon
    cannot step with Emerging-Optimizers 0.3.0 (AdaptiveMuon.step reads self.scale_mode, which
    the Megatron subclass never sets).
    """
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon

    def to_kwargs(c, model_chunks, pg_collection):
        return dict(
            lr=c.lr, momentum=c.muon_momentum, weight_decay=c.weight_decay, nesterov=c.muon_nesterov,
            fp32_matmul_prec=c.muon_fp32_matmul_prec, coefficient_type=c.muon_coefficient_type,
            num_ns_steps=c.muon_num_ns_steps, scale_mode=c.muon_scale_mode, extra_scale_factor=c.muon_extra_scale_factor,
            moment2_method=c.adaptive_muon_moment2_method, beta2=c.adaptive_muon_beta2, eps=c.adaptive_muon_eps,
        )

    stock = mcore_optimizer.emerging_optimizers._EMERGING_OPTIMIZERS["adaptive_muon"]
    return mcore_optimizer.emerging_optimizers.EmergingOptimizerEntry(
        AdaptiveMuon, init_state_fn=stock.init_state_fn, config_to_kwargs=to_kwargs,
        default_param_overrides=stock.default_param_overrides,
    )


@needs_megatron
@pytest.mark.parametrize(
    "name, fields",
    [
        ("muon", dict(muon_coefficient_type="polar_express", muon_num_ns_steps=6, muon_nesterov=True,
                      muon_momentum=0.9, muon_scale_mode="shape_scaling", muon_extra_scale_factor=0.5)),
        ("muon", dict(muon_split_qkv=False, muon_scale_mode="spectral", muon_extra_scale_factor=0.2)),
        ("adaptive_muon", dict(adaptive_muon_moment2_method="normuon", adaptive_muon_beta2=0.9,
                               adaptive_muon_eps=1e-7, muon_nesterov=True, muon_split_qkv=False)),
        ("adaptive_muon", dict(adaptive_muon_moment2_method="adamuon", muon_split_qkv=False,
                               muon_scale_mode="unit_rms_norm")),
    ],
)
def test_training_steps_match_the_reference_optimizers(stock_registry, megatron_env, name, fields):
    """Megatron's ChainedOptimizer with ours steps like it does with the reference in our place.

    Reference: Megatron-LM's own TensorParallelMuon for "muon"; Emerging-Optimizers' AdaptiveMuon
    for "adaptive_muon" (both need emerging-optimizers, which CI installs). The two models train
    in lockstep on the same grads (the reference model's), so differences cannot compound.
    """
    if not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("the reference optimizers need emerging-optimizers")
    config = _config(name, muon_fp32_matmul_prec="highest", **fields)
    table = stock_registry
    stock_entry = table[name]
    reference_model, model = megatron_env.build_gpt(seed=7), megatron_env.build_gpt(seed=7)
    start = {n: p.detach().clone() for n, p in reference_model.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.equal(p, start[n])
    with megatron_env.megatron_optimizer_on_cpu():
        if name == "adaptive_muon":
            table[name] = _emerging_optimizers_adaptive_muon_entry()
        try:
            reference_chained = mcore_optimizer.get_megatron_optimizer(config, [reference_model])
        finally:
            table[name] = stock_entry
        integration.install()
        chained = mcore_optimizer.get_megatron_optimizer(config, [model])
        ours = dict(model.named_parameters())
        for step in range(3):
            megatron_env.forward_backward(reference_model, seed=100 + step)
            for n, p in reference_model.named_parameters():
                ours[n].grad = p.grad.clone()
                ours[n].main_grad = ours[n].grad
            assert reference_chained.step()[0] and chained.step()[0]

    assert not any(type(w.optimizer).__module__.startswith("megatron_eopt") for w in reference_chained.chained_optimizers)
    owner = _inner_by_param_name(model, chained)
    assert any(isinstance(opt, TensorParallelMuon) for opt in owner.values())
    # fp32 ("highest") Newton–Schulz on both sides. AdaMuon divides elementwise by the root of its
    # second moment, which turns the normwise fp32 difference of two Newton–Schulz implementations
    # (different products: symmetric blocks, the Gram iteration) into an elementwise one; the
    # optimizer parity tests allow it the TF32 tolerance (test_optim_muon_parity._fp32_tolerance).
    # Expanding schedules (polar_express: slope 13 at sigma = 1) magnify fp32 rounding itself, so
    # their matrices are held to the amplification of a gradient-like input (ns_tolerance); two
    # fp32 implementations, each within it of the exact result, are within twice it of each other.
    tol = TOLERANCE["high"] if fields.get("adaptive_muon_moment2_method") == "adamuon" else TOLERANCE["highest"]
    coefficient_type, steps = config.muon_coefficient_type, config.muon_num_ns_steps
    for n, p in reference_model.named_parameters():
        delta, ref_delta = ours[n].detach() - start[n], p.detach() - start[n]
        assert ref_delta.norm() > 0, n
        bound = tol
        if p.ndim == 2:
            bound = 2 * max(tol, ns_tolerance(torch.randn(p.shape), "highest", "cpu", coefficient_type, steps))
        assert rel_err(delta, ref_delta) <= bound, (n, type(owner[n]).__name__)


@needs_megatron
@pytest.mark.parametrize("name, method", [("muon", None), ("adaptive_muon", "normuon")])
def test_init_state_fn_through_megatron_wrapper(stock_registry, megatron_env, name, method):
    model = megatron_env.build_gpt(seed=3)
    integration.install()
    config = _config(name, adaptive_muon_moment2_method=method or "adamuon")
    with megatron_env.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(config, [model])
    ours = [w for w in chained.chained_optimizers if isinstance(w.optimizer, TensorParallelMuon)]
    assert len(ours) == 1
    wrapper = ours[0]
    wrapper.init_state_fn(wrapper.optimizer, config)  # what Megatron calls before loading a checkpoint
    for group in wrapper.optimizer.param_groups:
        for p in group["params"]:
            state = wrapper.optimizer.state[p]
            assert state["momentum_buffer"].shape == p.shape
            assert ("moment2_buffer" in state) == (method is not None)


def _mapped_or_consumed(fields, cls, prefixes):
    """The fields among ``fields`` with one of ``prefixes`` that are neither a constructor argument of
    ``cls`` (prefix stripped) nor read elsewhere (registry.CONSUMED_CONFIG_FIELDS / RENAMED_CONFIG_FIELDS)."""
    import inspect

    registry = megatron_eopt.registry
    arguments = set(inspect.signature(cls).parameters)
    return [f for f in fields if any(f.startswith(p + "_") for p in prefixes)
            and f not in registry.CONSUMED_CONFIG_FIELDS and f not in registry.RENAMED_CONFIG_FIELDS
            and registry._strip_prefix(f, prefixes) not in arguments]


@needs_megatron
@pytest.mark.parametrize("name, cls, prefixes", [("muon", TensorParallelMuon, ("muon",)),
                                                  ("adaptive_muon", TensorParallelAdaptiveMuon, ("muon", "adaptive_muon"))])
def test_every_muon_field_of_megatrons_config_is_mapped_or_consumed(name, cls, prefixes):
    """Each muon_* / adaptive_muon_* field of this megatron-core's OptimizerConfig reaches the
    constructor argument of its name, or is one the integration lists as read elsewhere; a field a
    newer megatron-core adds makes this test name it."""
    registry = megatron_eopt.registry
    fields = [f.name for f in dataclasses.fields(mcore_optimizer.OptimizerConfig)]
    version = ".".join(map(str, integration.megatron_core_version() or ()))
    unknown = _mapped_or_consumed(fields, cls, prefixes)
    assert not unknown, f"megatron-core {version}: OptimizerConfig fields neither mapped nor consumed: {unknown}"
    config = _config(name)
    chunk = types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8))
    kwargs = registry.get(name).config_to_kwargs(config, [chunk], None)
    for field in fields:
        if not any(field.startswith(p + "_") for p in prefixes) or field in registry.CONSUMED_CONFIG_FIELDS:
            continue
        argument = registry._strip_prefix(field, prefixes)
        if field.startswith("muon_") and hasattr(config, "adaptive_muon_" + argument) and "adaptive_muon" in prefixes:
            continue  # the adaptive field wins, as in Megatron-LM
        assert argument in kwargs and kwargs[argument] == getattr(config, field), field
    assert kwargs["lr"] == config.lr and kwargs["weight_decay"] == config.weight_decay
    # the consumed fields are real fields of this config, or ours (set as attributes)
    assert set(registry.CONSUMED_CONFIG_FIELDS) - set(fields) <= {"muon_clip_policy"}


@needs_megatron
def test_split_options_this_megatron_core_lacks_stop_the_build_naming_it(stock_registry, megatron_env):
    """megatron-core 0.19's OptimizerConfig has no muon_split_glu / muon_split_qkv_per_head (Megatron-LM
    PRs #6688, #6326): set on its config, the build stops naming the version; a config class that
    declares them (a newer megatron-core) hands them on, and the per-head split runs on the GPT's QKV."""
    model = megatron_env.build_gpt(seed=1)
    integration.install()
    version = r"\.".join(map(str, integration.megatron_core_version()))
    declared = {f.name for f in dataclasses.fields(mcore_optimizer.OptimizerConfig)}
    for field in ("muon_split_glu", "muon_split_qkv_per_head"):
        if field in declared:
            continue  # a megatron-core that has it
        config = _config("muon")
        setattr(config, field, True)
        with megatron_env.megatron_optimizer_on_cpu(), pytest.raises(
                ValueError, match=rf"OptimizerConfig\.{field}=True .*megatron-core {version} has no such option"):
            mcore_optimizer.get_megatron_optimizer(config, [model])

    @dataclasses.dataclass
    class NewerOptimizerConfig(mcore_optimizer.OptimizerConfig):
        muon_split_glu: bool = True
        muon_split_qkv_per_head: bool = True

    fields = {f.name: getattr(_config("muon"), f.name) for f in dataclasses.fields(mcore_optimizer.OptimizerConfig)
              if f.init}
    with megatron_env.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(NewerOptimizerConfig(**fields), [model])
        ours = next(o for o in _inner_by_param_name(model, chained).values() if isinstance(o, TensorParallelMuon))
        assert ours.split_glu is True and ours.split_qkv_per_head is True
        assert ours.qkv_split_shapes == [16] * 8  # per query group: 2 query heads, k, v; 2 groups
        qkv = dict(model.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert ours._plan.entries[ours._plan.index[id(qkv)]].split.sizes == (16,) * 8
        before = qkv.detach().clone()
        megatron_env.forward_backward(model, seed=2)
        chained.step()
    assert not torch.equal(before, qkv.detach())


@needs_megatron
@pytest.mark.parametrize("name", ["muon", "adaptive_muon"])
def test_unknown_muon_field_stops_get_megatron_optimizer(stock_registry, megatron_env, name):
    """A config of a newer Megatron-LM carrying a muon_* field megatron-eopt does not know stops
    get_megatron_optimizer with an error naming the field and the megatron-core version."""

    @dataclasses.dataclass
    class NewerOptimizerConfig(mcore_optimizer.OptimizerConfig):
        muon_split_mlp: bool = True

    base = dataclasses.asdict(_config(name))
    config = NewerOptimizerConfig(**{k: v for k, v in base.items() if k in {f.name for f in dataclasses.fields(_config(name)) if f.init}})
    model = megatron_env.build_gpt(seed=1)
    integration.install()
    version = r"\.".join(map(str, integration.megatron_core_version()))
    with megatron_env.megatron_optimizer_on_cpu(), pytest.raises(
            ValueError, match=rf"'muon_split_mlp' \(argument 'split_mlp'\) of megatron-core {version}"):
        mcore_optimizer.get_megatron_optimizer(config, [model])


@needs_megatron
def test_own_names_registered_here_reach_megatron(stock_registry, megatron_env, monkeypatch):
    registry = megatron_eopt.registry
    registry.names()
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))

    def normuon_kwargs(config, model_chunks, pg_collection):
        kwargs = registry.adaptive_muon_config_to_kwargs(config, model_chunks, pg_collection)
        kwargs["moment2_method"] = "normuon"
        return kwargs

    registry.register("normuon", registry.EmergingOptimizerEntry(TensorParallelAdaptiveMuon, config_to_kwargs=normuon_kwargs))
    with pytest.raises(KeyError, match="no_such_name"):
        integration.install(["no_such_name"])
    assert integration.install(["normuon"]) == {"normuon": None}  # a new name in Megatron's registry
    assert integration.installed() == ["normuon"]  # "muon" was not selected
    model = megatron_env.build_gpt(seed=4)
    with megatron_env.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config("normuon"), [model])
        megatron_env.forward_backward(model, seed=1)
        assert chained.step()[0]
    ours = [w.optimizer for w in chained.chained_optimizers if isinstance(w.optimizer, TensorParallelAdaptiveMuon)]
    assert len(ours) == 1 and ours[0].moment2_method == "normuon"
    owner = _inner_by_param_name(model, chained)
    assert isinstance(owner["output_layer.weight"], torch.optim.AdamW)  # the default overrides apply
    integration.uninstall()
    assert "normuon" not in stock_registry


@needs_megatron
@pytest.mark.parametrize("name, cls", [("muon", TensorParallelMuon), ("adaptive_muon", TensorParallelAdaptiveMuon)])
def test_routing_is_megatrons_own_and_honours_use_muon_false(stock_registry, megatron_env, name, cls):
    """The installed entry routes by Megatron's own overrides (whatever they are) plus use_muon = False."""
    model = megatron_env.build_gpt(seed=6)
    params = dict(model.named_parameters())
    excluded = "decoder.layers.0.mlp.linear_fc1.weight"
    params[excluded].use_muon = False  # Megatron-LM's flag (set e.g. on Mamba input projections)
    try:
        # Megatron's rule, extended here by one name pattern, is what the installed entry must follow.
        stock = stock_registry[name]
        ParamKey = mcore_optimizer.ParamKey
        patched = dict(stock.default_param_overrides)
        patched[ParamKey(name="*.linear_proj.weight")] = {"optimizer": "adam"}
        stock_registry[name] = type(stock)(stock.optimizer_cls, stock.init_state_fn, stock.config_to_kwargs, patched)
        integration.install([name])
        stock_registry_entry = integration._REPLACED[name]
        assert stock_registry_entry.default_param_overrides is patched
        with megatron_env.megatron_optimizer_on_cpu():
            chained = mcore_optimizer.get_megatron_optimizer(_config(name), [model])
            megatron_env.forward_backward(model, seed=2)
            assert chained.step()[0]
    finally:
        del params[excluded].use_muon
    owner = _inner_by_param_name(model, chained)
    ours = {n for n, opt in owner.items() if isinstance(opt, cls)}
    expected = {
        n for n, p in params.items()
        if p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)
        and not n.endswith(".linear_proj.weight") and n != excluded
    }
    assert ours == expected
    assert isinstance(owner[excluded], torch.optim.AdamW)
    assert isinstance(owner["decoder.layers.0.self_attention.linear_proj.weight"], torch.optim.AdamW)
    integration.uninstall()
    assert stock_registry[name] is not stock  # uninstall put back what install replaced
    stock_registry[name] = stock


@needs_megatron
def test_entry_with_own_overrides_keeps_them(stock_registry, megatron_env, monkeypatch):
    registry = megatron_eopt.registry
    registry.names()
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    rule = registry.ParamRule("only_fc2", lambda p: p.dim() != 2 or p.shape == (64, 96))
    entry = registry.EmergingOptimizerEntry(
        TensorParallelMuon, config_to_kwargs=registry.muon_config_to_kwargs,
        default_param_overrides={rule: {"optimizer": "adam"}},
    )
    registry.register("muon", entry, replace=True)
    integration.install(["muon"])
    (key,) = stock_registry["muon"].default_param_overrides
    assert key.predicate.name == "only_fc2"


@needs_megatron
def test_replace_classes_binds_megatrons_class_names(stock_registry, megatron_env):
    emerging = mcore_optimizer.emerging_optimizers
    stock_classes = (emerging.TensorParallelMuon, emerging.TensorParallelAdaptiveMuon)
    integration.install()
    assert (emerging.TensorParallelMuon, emerging.TensorParallelAdaptiveMuon) == stock_classes  # opt-in only
    assert not integration.classes_replaced()
    integration.uninstall()
    with pytest.raises(ValueError, match="adaptive_muon"):
        integration.install(["muon"], replace_classes=True)
    assert emerging.TensorParallelMuon is stock_classes[0]
    integration.install(["muon", "adaptive_muon"])
    integration.install([], replace_classes=True)  # both already installed
    integration.install(replace_classes=True)  # idempotent
    assert emerging.TensorParallelMuon is TensorParallelMuon
    assert emerging.TensorParallelAdaptiveMuon is TensorParallelAdaptiveMuon
    assert integration.classes_replaced()
    # Code that builds Megatron's class by name, with Megatron's own config mapping, gets ours.
    model = megatron_env.build_gpt(seed=8)
    config = _config("muon")
    weights = [p for p in model.parameters() if p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)]
    built = emerging.TensorParallelMuon(weights, **emerging._muon_config_to_kwargs(config, [model], None))
    assert type(built) is TensorParallelMuon
    adaptive = emerging.TensorParallelAdaptiveMuon(
        weights, **emerging._adaptive_muon_config_to_kwargs(config, [model], None)
    )
    assert type(adaptive) is TensorParallelAdaptiveMuon
    megatron_env.forward_backward(model, seed=3)
    built.step()
    adaptive.step()
    integration.uninstall()
    assert (emerging.TensorParallelMuon, emerging.TensorParallelAdaptiveMuon) == stock_classes
    assert not integration.classes_replaced()


def _muon_param_groups(state_dict):
    """The param groups (without params) of each optimizer in a ChainedOptimizer state dict."""
    return [[{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]] for sd in state_dict]


def _trained_optimizer(megatron_env, name, seed, steps=1):
    model = megatron_env.build_gpt(seed=seed)
    with megatron_env.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config(name), [model])
        for step in range(steps):
            megatron_env.forward_backward(model, seed=seed * 10 + step)
            assert chained.step()[0]
    return model, chained


@needs_megatron
@pytest.mark.parametrize("name, cls", [("muon", TensorParallelMuon), ("adaptive_muon", TensorParallelAdaptiveMuon)])
def test_factory_optimizer_state_dict_round_trip_keeps_param_groups(stock_registry, megatron_env, name, cls):
    integration.install()
    _, chained = _trained_optimizer(megatron_env, name, seed=11)
    assert any(isinstance(w.optimizer, cls) for w in chained.chained_optimizers)
    before = chained.state_dict()
    chained.load_state_dict(before)
    after = chained.state_dict()
    megatron_env.assert_same_state(before, after)
    for groups in _muon_param_groups(after):
        assert all("differentiable" not in g for g in groups if "optimizer" not in g)


def _save_and_load(megatron_env, source, target, tmp_path):
    """torch_dist save of source's optimizer (model, optimizer); load into target's; both state dicts."""
    from megatron.core import dist_checkpointing

    (model_a, opt_a), (model_b, opt_b) = source, target
    with megatron_env.dist_checkpointing_on_cpu():
        dist_checkpointing.save(opt_a.sharded_state_dict(model_a.sharded_state_dict()), str(tmp_path))
        loaded = dist_checkpointing.load(opt_b.sharded_state_dict(model_b.sharded_state_dict(), is_loading=True),
                                         str(tmp_path))
    opt_b.load_state_dict(loaded)
    return opt_a.state_dict(), opt_b.state_dict()


@needs_megatron
@pytest.mark.parametrize("name", ["muon", "adaptive_muon"])
def test_torch_dist_checkpoint_round_trip(stock_registry, megatron_env, tmp_path, name):
    """Megatron's dist_checkpointing (torch_dist) save, then load into a fresh optimizer: the same
    state dict (param groups with the same keys and values, same state tensors)."""
    integration.install()
    saved, loaded = _save_and_load(
        megatron_env, _trained_optimizer(megatron_env, name, seed=12, steps=2),
        _trained_optimizer(megatron_env, name, seed=13), tmp_path,
    )
    megatron_env.assert_same_state(saved, loaded)


@needs_megatron
@pytest.mark.parametrize("direction", ["stock_to_plug", "plug_to_stock"])
def test_torch_dist_checkpoint_cross_load_with_megatrons_own_muon(stock_registry, megatron_env, tmp_path, direction):
    """A checkpoint of Megatron's own TensorParallelMuon (Emerging-Optimizers) loads into ours and back."""
    if not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("Megatron's own TensorParallelMuon needs emerging-optimizers")

    def build(plug, seed, steps):
        integration.install() if plug else integration.uninstall()
        built = _trained_optimizer(megatron_env, "muon", seed=seed, steps=steps)
        ours = any(isinstance(w.optimizer, TensorParallelMuon) for w in built[1].chained_optimizers)
        assert ours == plug
        return built

    source_plug = direction == "plug_to_stock"
    source = build(source_plug, seed=14, steps=2)
    target = build(not source_plug, seed=15, steps=1)
    saved, loaded = _save_and_load(megatron_env, source, target, tmp_path)
    megatron_env.assert_same_state(saved, loaded)


@needs_megatron
@pytest.mark.distributed
def test_torch_dist_checkpoint_at_tensor_parallel_2(stock_registry, megatron_env, tmp_path):
    """Two ranks (gloo), TP = 2: torch_dist save / load of ours into ours (muon, adaptive_muon),
    Megatron's own TensorParallelMuon into ours and ours into Megatron's: same state dict per rank.
    Then, resharding: those TP = 2 checkpoints (one written by ours, one by stock) loaded here at
    TP = 1 by stock and by ours give the same state dict."""
    if not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("the cross-loads need Megatron's own TensorParallelMuon (emerging-optimizers)")
    import torch.multiprocessing as mp

    import megatron_ckpt_worker
    from megatron.core import dist_checkpointing

    ckpt_root = tmp_path / "checkpoints"
    ckpt_root.mkdir()
    mp.spawn(megatron_ckpt_worker.worker, args=(2, str(tmp_path / "rendezvous"), str(ckpt_root)), nprocs=2, join=True)

    def state_tensors(chained):
        return [t.clone() for sd in chained.state_dict() for st in sd["state"].values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0]

    for case, (name, writer_plug, _) in enumerate(megatron_ckpt_worker.CASES):
        if name != "muon" or case == 3:
            continue  # case 3's writer is ours, as case 0's
        loaded = {}
        for plug in (False, True):
            integration.install() if plug else integration.uninstall()
            # The reader has stepped once: the state it ends with must come from the checkpoint.
            model, chained = _trained_optimizer(megatron_env, "muon", seed=16)
            before = state_tensors(chained)
            with megatron_env.dist_checkpointing_on_cpu():
                sharded = chained.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
                chained.load_state_dict(dist_checkpointing.load(sharded, str(ckpt_root / f"case{case}")))
            after = state_tensors(chained)
            assert len(after) == len(before) and any(not torch.equal(a, b) for a, b in zip(before, after))
            loaded[plug] = chained.state_dict()
        megatron_env.assert_same_state(loaded[False], loaded[True], f"TP=2 -> 1, written by plug={writer_plug}")


@needs_megatron
def test_legacy_get_megatron_muon_optimizer(stock_registry, megatron_env):
    from megatron_eopt import muon as legacy

    model = megatron_env.build_gpt(seed=5)
    legacy._warned.discard("get_megatron_muon_optimizer")
    with megatron_env.megatron_optimizer_on_cpu():
        with pytest.warns(DeprecationWarning, match="get_megatron_optimizer"):
            chained = legacy.get_megatron_muon_optimizer(_config("muon"), [model])
        megatron_env.forward_backward(model, seed=0)
        assert chained.step()[0]
    assert any(isinstance(w.optimizer, TensorParallelMuon) for w in chained.chained_optimizers)
    assert "muon" in integration.installed()


def test_install_error_when_megatron_is_missing(monkeypatch):
    monkeypatch.setattr(integration, "megatron_core_version", lambda: None)
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer", None)
    with pytest.raises(ImportError, match=r"needs megatron-core >= 0\.18.*pip install megatron-core"):
        integration.install()


def test_install_error_when_megatron_is_too_old(monkeypatch):
    monkeypatch.setattr(integration, "megatron_core_version", lambda: (0, 17, 1))
    with pytest.raises(ImportError, match=r">= 0\.18.*found 0\.17\.1"):
        integration.install()


def test_version_is_the_imported_packages(tmp_path):
    # A Megatron-LM checkout ahead of the installed release on the path is what `import megatron.core`
    # loads, so it is the version reported (read from its package_info.py without importing it).
    import subprocess

    core = tmp_path / "checkout" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('not imported by the version check')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = 'rc0'\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from megatron_eopt.integrations import megatron as m; print(m.megatron_core_version())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "checkout")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "(0, 20, 0)", out.stdout + out.stderr
    installed = integration.megatron_core_version()
    assert installed is not None and installed >= (0, 18)


def test_version_parsing():
    assert _megatron_version._parse_version("0.19.2") == (0, 19, 2)
    assert _megatron_version._parse_version("0.18.0rc1+abc123") == (0, 18, 0)
    assert _megatron_version._parse_version("1.0") == (1, 0)


_WITHOUT_EO = textwrap.dedent(
    """
    import importlib.abc, importlib.metadata, json, sys
    # A machine without Emerging-Optimizers: neither importable nor in the metadata.
    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "emerging_optimizers":
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _Hide())
    _version = importlib.metadata.version
    def version(name):
        if name.replace("_", "-") == "emerging-optimizers":
            raise importlib.metadata.PackageNotFoundError(name)
        return _version(name)
    importlib.metadata.version = version

    import torch
    import megatron.core.optimizer as mo
    import megatron_cpu
    from megatron_eopt.integrations import megatron as integration
    from megatron_eopt.optim import TensorParallelMuon

    megatron_cpu.init_megatron_single_rank()
    result = {"have_eo": mo.HAVE_EMERGING_OPTIMIZERS}
    model = megatron_cpu.build_gpt(seed=2)
    config = mo.OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, clip_grad=0.0)
    with megatron_cpu.megatron_optimizer_on_cpu():
        try:
            mo.get_megatron_optimizer(config, [model])
        except ImportError as exc:
            result["stock_error"] = str(exc)
        result["replaced"] = sorted(integration.install())
        chained = mo.get_megatron_optimizer(config, [model])
        result["types"] = sorted(type(w.optimizer).__name__ for w in chained.chained_optimizers)
        before = [p.detach().clone() for p in model.parameters()]
        megatron_cpu.forward_backward(model, seed=0)
        result["step"] = bool(chained.step()[0])
        result["changed"] = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        result["n_params"] = len(before)
        lion = mo.OptimizerConfig(optimizer="muon", lr=0.02, clip_grad=0.0, muon_scalar_optimizer="lion")
        try:
            mo.get_megatron_optimizer(lion, [model])
        except ImportError as exc:
            result["lion_error"] = str(exc)
    integration.uninstall()
    result["restored"] = mo.HAVE_EMERGING_OPTIMIZERS
    megatron_cpu.shutdown_megatron()
    print("RESULT " + json.dumps(result))
    """
)


@needs_megatron
def test_works_without_emerging_optimizers_installed():
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_eopt.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root, SUPPORT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_EO], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["have_eo"] is False
    assert "emerging-optimizers" in result["stock_error"]  # Megatron alone refuses optimizer="muon"
    assert {"muon", "adaptive_muon"} <= set(result["replaced"])
    assert result["types"] == ["AdamW", "TensorParallelMuon"]
    assert result["step"] and result["changed"] == result["n_params"]
    assert "emerging-optimizers" in result["lion_error"]
    assert result["restored"] is False


def test_version_report_names_the_followed_pull_requests_the_docs_describe():
    import re

    from paths import ROOT

    report = integration.version_report()
    with open(os.path.join(ROOT, "docs", "megatron.md"), encoding="utf-8") as f:
        docs = f.read()
    numbers = re.findall(r"#(\d{4})", report)
    assert len(numbers) >= 10 and report.splitlines()[0].startswith("megatron-core ")
    for number in numbers:
        assert f"#{number}" in docs, number
