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
