"""Hugging Face Trainer with Muon on the hidden matrices and AdamW on the rest, through Trainer's
``optimizer_cls_and_kwargs`` factory entry point (megatron_eopt.integrations.transformers)."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from megatron_eopt.integrations.transformers import MuonAdamWFactory, build_muon_adamw  # noqa: E402
from megatron_eopt.optim import HybridMuon  # noqa: E402

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset):
    """A learnable toy language: each sequence counts up from a random start, modulo VOCAB."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def trainer_for(model, tmp_path, max_steps, **kwargs):
    kwargs.setdefault("save_strategy", "no")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=max_steps, use_cpu=True,
        report_to=[], logging_steps=1, disable_tqdm=True, seed=0, **kwargs,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-3)))


def test_routing_muon_on_hidden_matrices_adamw_on_the_rest():
    model = tiny_gpt2()
    opt = build_muon_adamw(model)
    assert isinstance(opt, HybridMuon)
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    for name, p in model.named_parameters():
        hidden = p.ndim == 2 and "wte" not in name and "wpe" not in name and "lm_head" not in name
        assert (id(p) in muon) == hidden, name
    assert muon  # the attention and MLP matrices


def test_trainer_trains_with_the_factory(tmp_path):
    model = tiny_gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = trainer_for(model, tmp_path, max_steps=12, lr_scheduler_type="constant")
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, HybridMuon)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    moved = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(moved) == len(before)
    # every Muon matrix has its momentum; the AdamW side its moments
    for group in opt.param_groups:
        for p in group["params"]:
            keys = set(opt.state[p])
            assert keys == ({"momentum_buffer"} if group["use_muon"] else {"step", "exp_avg", "exp_avg_sq"})


def test_trainer_scheduler_scales_both_sides(tmp_path):
    model = tiny_gpt2()
    trainer = trainer_for(model, tmp_path, max_steps=4, lr_scheduler_type="linear")
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    # linear decay to 0 over 4 steps: after the run every group sits at 0 of its own initial lr
    for group in opt.param_groups:
        assert group["initial_lr"] == (0.02 if group["use_muon"] else 3e-3)
        assert group["lr"] == pytest.approx(0.0, abs=1e-12)


def test_trainer_checkpoint_holds_and_resumes_the_optimizer_state(tmp_path):
    trainer = trainer_for(tiny_gpt2(), tmp_path, max_steps=2, lr_scheduler_type="constant",
                          save_strategy="steps", save_steps=2)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    fresh = build_muon_adamw(transformers.GPT2LMHeadModel.from_pretrained(str(checkpoint)), lr=0.02, adamw_lr=3e-3)
    fresh.load_state_dict(saved)
    ours, theirs = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert ours.keys() == theirs.keys() and len(ours) == len(list(tiny_gpt2().parameters()))
    for i in ours:
        assert ours[i].keys() == theirs[i].keys()
        for k in ours[i]:
            assert torch.equal(torch.as_tensor(ours[i][k]), torch.as_tensor(theirs[i][k]))
    # Trainer resumes from it and trains on
    resumed = trainer_for(tiny_gpt2(), tmp_path, max_steps=3, lr_scheduler_type="constant")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3


@pytest.mark.parametrize("policy", ["adamw", "global"])
def test_muon_clip_trainer_clips_adamw_only_and_logs_the_total_norm(tmp_path, monkeypatch, policy):
    from megatron_eopt.integrations.transformers import MuonClipTrainer

    import megatron_eopt as me
    from megatron_eopt import clipping

    seen = []
    original = clipping.clip_grad_norm_

    def recording(optimizer, max_norm, **kwargs):
        muon = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
        other = [p for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]]
        before = [p.grad.clone() for p in muon + other]
        out = original(optimizer, max_norm, **kwargs)
        seen.append((max_norm, before, [p.grad.clone() for p in muon + other], len(muon), out))
        return out

    monkeypatch.setattr(clipping, "clip_grad_norm_", recording)
    model = tiny_gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=3,
                                          use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True, seed=0,
                                          save_strategy="no", max_grad_norm=0.05)  # small: every step clips
    cls = MuonClipTrainer if policy == "adamw" else type("GlobalClip", (MuonClipTrainer,), {"muon_clip_policy": "global"})
    trainer = cls(model=model, args=args, train_dataset=Tokens(),
                  optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-3)))
    trainer.train()
    assert isinstance(trainer, transformers.Trainer) and len(seen) == 3
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == 3
    for (max_norm, before, after, n_muon, parts), grad_norm in zip(seen, logged):
        assert max_norm == 0.05 and isinstance(parts, me.GradNorms)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
        assert grad_norm == pytest.approx(total.item(), rel=1e-5)  # the logged norm: all gradients, before clipping
        if policy == "adamw":
            assert all(torch.equal(a, b) for a, b in zip(before[:n_muon], after[:n_muon]))  # Muon's untouched
            adamw_after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in after[n_muon:]]))
            assert adamw_after.item() == pytest.approx(0.05, rel=1e-4)
        else:
            after_total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in after]))
            assert after_total.item() == pytest.approx(0.05, rel=1e-4)
    assert trainer.grad_norm_parts.total.item() == pytest.approx(logged[-1], rel=1e-5)


# --- resuming a model whose checkpoint names differ from its parameters (MoE experts) ---------------------------
# transformers 5 saves Qwen3-MoE's fused experts (E, 2I, H) gate_up_proj / (E, H, I) down_proj one gate_proj /
# up_proj / down_proj per expert, and Trainer's resume_from_checkpoint loads the file without converting them back.


def tiny_qwen3_moe():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, decoder_sparse_step=1, mlp_only_layers=[],
    )
    return transformers.Qwen3MoeForCausalLM(config)


EXPERTS = [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")]


def moe_trainer(cls, model, tmp_path, max_steps, eval_dataset=None, **kwargs):
    kwargs.setdefault("save_strategy", "no")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=max_steps, use_cpu=True, report_to=[],
        logging_steps=1, disable_tqdm=True, seed=0, lr_scheduler_type="constant", **kwargs,
    )
    return cls(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_dataset,
               optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-3)))


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """An uninterrupted 4-step run and a checkpoint of the same run after 2 steps (stock Trainer)."""
    tmp = tmp_path_factory.mktemp("moe")
    full = moe_trainer(transformers.Trainer, tiny_qwen3_moe(), tmp / "full", 4)
    full.train()
    reference = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    moe_trainer(transformers.Trainer, tiny_qwen3_moe(), tmp / "run", 2, save_strategy="steps", save_steps=2).train()
    return reference, tmp / "run" / "checkpoint-2"


def differing(model, reference):
    return [n for n, p in model.named_parameters() if not torch.equal(p.detach(), reference[n])]


def test_stock_trainer_resume_restarts_the_experts(moe_runs, tmp_path):
    # what the mixin fixes: the checkpoint holds the experts per expert, the stock resume leaves them as built
    from safetensors import safe_open

    reference, checkpoint = moe_runs
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert not keys & set(EXPERTS)
    assert {f"model.layers.1.mlp.experts.3.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")} <= keys
    resumed = moe_trainer(transformers.Trainer, tiny_qwen3_moe(), tmp_path, 4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert set(EXPERTS) <= set(differing(resumed.model, reference))


def test_muon_clip_trainer_resumes_the_experts_exactly(moe_runs, tmp_path):
    from megatron_eopt.integrations.transformers import MuonClipTrainer, ResumeConversionMixin

    reference, checkpoint = moe_runs
    assert issubclass(MuonClipTrainer, ResumeConversionMixin)
    resumed = moe_trainer(MuonClipTrainer, tiny_qwen3_moe(), tmp_path, 4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert differing(resumed.model, reference) == []  # bitwise equal to the uninterrupted run


def test_stock_trainer_resumes_exactly_after_load_converted_weights(moe_runs, tmp_path):
    from megatron_eopt.integrations.transformers import load_converted_weights

    reference, checkpoint = moe_runs
    model = tiny_qwen3_moe()
    loaded, used = load_converted_weights(model, checkpoint)
    assert sorted(loaded) == sorted(EXPERTS) and len(used) == 2 * 4 * 3
    resumed = moe_trainer(transformers.Trainer, model, tmp_path, 4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert differing(resumed.model, reference) == []
    # the documented workaround, from_pretrained before resuming, is exact as well
    resumed = moe_trainer(transformers.Trainer, transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)),
                          tmp_path, 4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert differing(resumed.model, reference) == []


def test_load_converted_weights_reads_the_experts_back_from_shards(tmp_path):
    from megatron_eopt.integrations.transformers import load_converted_weights

    trained = tiny_qwen3_moe()
    with torch.no_grad():
        for p in trained.parameters():
            p.normal_()
    trained.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = tiny_qwen3_moe()
    loaded, _ = load_converted_weights(model, tmp_path)
    assert sorted(loaded) == sorted(EXPERTS)
    expected = dict(trained.named_parameters())
    for name in EXPERTS:
        assert torch.equal(model.get_parameter(name), expected[name]), name
    # a dense model's checkpoint holds every weight under its own name: nothing to convert
    gpt2 = tiny_gpt2()
    gpt2.save_pretrained(str(tmp_path / "gpt2"))
    assert load_converted_weights(tiny_gpt2(), tmp_path / "gpt2") == ([], [])
    with pytest.raises(ValueError, match="checkpoint"):
        load_converted_weights(model, tmp_path / "absent")
    with pytest.raises(TypeError, match="model"):
        load_converted_weights("model", tmp_path)


def test_resume_refuses_a_checkpoint_without_the_saved_experts(moe_runs, tmp_path):
    # experts saved under names that this model's conversion does not produce: refuse, do not restart them
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_eopt.integrations.transformers import MuonClipTrainer

    _, checkpoint = moe_runs
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, broken)
    state = load_file(str(broken / "model.safetensors"))
    state = {k.replace("experts.2.", "experts.two."): v for k, v in state.items()}
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    resumed = moe_trainer(MuonClipTrainer, tiny_qwen3_moe(), tmp_path, 4)
    with pytest.raises(RuntimeError, match="#48805") as err:
        resumed.train(resume_from_checkpoint=str(broken))
    assert "from_pretrained" in str(err.value) and "experts.2." in str(err.value)
    assert resumed.state.global_step == 0


def test_load_best_model_at_end_converts_the_experts(tmp_path):
    from safetensors import safe_open

    from megatron_eopt.integrations.transformers import MuonClipTrainer

    trainer = moe_trainer(MuonClipTrainer, tiny_qwen3_moe(), tmp_path, 4, eval_dataset=Tokens(16, seed=1),
                          save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                          load_best_model_at_end=True, metric_for_best_model="loss",
                          greater_is_better=True)  # the worse (first) checkpoint
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    with safe_open(str(tmp_path / "checkpoint-2" / "model.safetensors"), framework="pt") as f:
        gate = f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight")
        down = f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
    experts = trainer.model.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj[3, :16], gate) and torch.equal(experts.down_proj[3], down)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_neox"])
def test_load_converted_weights_restores_renamed_weights(arch, tmp_path):
    # the mapping also renames: Mixtral's experts and router (block_sparse_moe), GPT-NeoX's output head (embed_out)
    from megatron_eopt.integrations.transformers import load_converted_weights

    T = transformers
    config = T.MixtralConfig(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, num_local_experts=4,
                             num_experts_per_tok=2) if arch == "mixtral" else \
        T.GPTNeoXConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                        vocab_size=VOCAB)
    torch.manual_seed(0)
    trained = T.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in trained.parameters():
            p.normal_()
    trained.save_pretrained(str(tmp_path))
    model = T.AutoModelForCausalLM.from_config(config)
    loaded, _ = load_converted_weights(model, tmp_path)
    expected = {"mixtral": {f"model.layers.{i}.mlp.{w}" for i in range(2)
                            for w in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")},
                "gpt_neox": {"lm_head.weight"}}[arch]
    assert set(loaded) == expected
    for name in expected:
        assert torch.equal(model.get_parameter(name), trained.get_parameter(name)), name
