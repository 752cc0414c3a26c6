import pytest
import torch
from torch import nn

from megatron_eopt import build_optimizers, build_schedulers
from megatron_eopt.param_routing import route_parameters


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_fc_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.c_proj(self.c_attn(self.ln_1(x))[..., : x.size(-1)])
        return x + self.c_fc_proj(torch.relu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """nanoGPT layout: wte/wpe embeddings, lm_head tied to wte (the same Parameter)."""

    def __init__(self, vocab=50, d=16, n_layer=2, seq=8):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(seq, d),
                h=nn.ModuleList([Block(d) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class TinyLlama(nn.Module):
    """Llama layout with an untied top-level `output` head, plus odd parameters."""

    def __init__(self, d=16, vocab=40):
        super().__init__()
        self.tok_embeddings = nn.Parameter(torch.randn(vocab, d))  # a bare parameter, found by name
        self.attention_norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, 3 * d, bias=False)
        self.conv = nn.Conv2d(2, 4, 3)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))
        self.frozen = nn.Parameter(torch.randn(d, d), requires_grad=False)
        self.output = nn.Linear(d, vocab, bias=False)


def _route_map(table):
    return {r.name: (r.optimizer, r.reason) for r in table}


def test_gpt_routing_with_tied_head():
    model = TinyGPT()
    table, groups = route_parameters(model, weight_decay=0.1)
    routes = _route_map(table)
    wte = table["lm_head.weight"]
    assert wte is table["transformer.wte.weight"]  # one route for the tied pair
    assert set(wte.names) == {"transformer.wte.weight", "lm_head.weight"}
    assert wte.optimizer == "adamw" and "embedding" in wte.reason and "tied" in wte.reason
    assert routes["transformer.wpe.weight"][0] == "adamw"
    muon = set(table.names_for("muon"))
    assert muon == {
        f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("c_attn", "c_proj", "c_fc", "c_fc_proj")
    }
    for name, (opt, reason) in routes.items():
        if name.endswith(".bias"):
            assert (opt, reason) == ("adamw", "bias")
        if "ln_" in name and name.endswith(".weight"):
            assert (opt, reason) == ("adamw", "norm")
    # every trainable tensor lands in exactly one group
    ids = [id(p) for g in groups.values() for p in g]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    # weight decay: matrices decay, 0-D/1-D tensors do not
    assert all(r.weight_decay == (0.1 if len(r.shape) >= 2 else 0.0) for r in table)


def test_llama_routing_by_name_shape_and_frozen():
    model = TinyLlama()
    table, _ = route_parameters(model)
    routes = _route_map(table)
    assert routes["tok_embeddings"][0] == "adamw" and "embedding" in routes["tok_embeddings"][1]
    assert routes["output.weight"] == ("adamw", "output head (name 'output.weight')")
    assert routes["attention_norm.weight"] == ("adamw", "norm")
    assert routes["logit_scale"] == ("adamw", "scalar")
    assert routes["conv.weight"][0] == "adamw" and "4-D" in routes["conv.weight"][1]
    assert routes["frozen"] == ("frozen", "requires_grad=False")
    assert set(table.names_for("muon")) == {"wq.weight", "w1.weight"}


def test_head_tied_by_storage_to_a_distinct_parameter():
    emb = nn.Embedding(30, 8)
    proj_out = nn.Linear(8, 30, bias=False)
    proj_out.weight = nn.Parameter(emb.weight.data)  # another Parameter object, same memory
    hidden = nn.Linear(8, 8, bias=False)
    named = [("tok_embed.weight", emb.weight), ("hidden.weight", hidden.weight), ("proj_out.weight", proj_out.weight)]
    table, _ = route_parameters(named)
    assert table["proj_out.weight"].optimizer == "adamw"
    assert "shares storage with embedding 'tok_embed.weight'" in table["proj_out.weight"].reason
    assert table["hidden.weight"].optimizer == "muon"


def test_bert_attention_output_is_a_hidden_matrix_and_megatron_tags_count():
    inner = nn.Linear(8, 8)
    tagged = nn.Linear(8, 32, bias=False)
    tagged.weight.is_embedding_or_output_parameter = True
    named = {"encoder.layer.0.attention.output.dense.weight": inner.weight, "decoder_out.weight": tagged.weight}
    table, _ = route_parameters(named)
    assert table["encoder.layer.0.attention.output.dense.weight"].optimizer == "muon"
    assert table["decoder_out.weight"].optimizer == "adamw"
    assert "is_embedding_or_output_parameter" in table["decoder_out.weight"].reason


def test_adamw_patterns_force_and_custom_head_patterns():
    model = TinyLlama()
    table, _ = route_parameters(model, adamw_patterns=[r"^wq\."], head_patterns=[r"^w1\."])
    assert table["wq.weight"].optimizer == "adamw" and "adamw_patterns" in table["wq.weight"].reason
    assert table["w1.weight"].optimizer == "adamw" and "output head" in table["w1.weight"].reason
    # with the generic head names replaced, `output` is an ordinary matrix
    assert table["output.weight"].optimizer == "muon"


def test_distinct_parameters_sharing_storage_warn():
    base = torch.randn(6, 6)
    a, b = nn.Parameter(base), nn.Parameter(base.view(6, 6))
    with pytest.warns(UserWarning, match="sharing storage"):
        route_parameters([("a.weight", a), ("b.weight", b)])


def test_names_are_required():
    with pytest.raises(TypeError, match="routes by parameter name"):
        route_parameters(list(nn.Linear(3, 3).parameters()))


def test_table_text_lists_everything(capsys):
    model = TinyGPT()
    _, table = build_optimizers(model, verbose=True)
    text = capsys.readouterr().out
    assert text.strip() == table.format().strip()
    for route in table:
        assert route.name in text
    assert "muon: 8 tensors" in text
    assert "lm_head.weight" in text  # the tied alias is shown


def test_build_optimizers_and_train():
    from megatron_eopt.optim import Muon

    torch.manual_seed(0)
    model = TinyGPT()
    optimizers, table = build_optimizers(model, muon_lr=0.02, adamw_lr=1e-3, weight_decay=0.05)
    muon, adamw = optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    adamw_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    by_name = dict(model.named_parameters())
    assert muon_ids == {id(by_name[n]) for n in table.names_for("muon")}
    assert adamw_ids == {id(by_name[n]) for n in table.names_for("adamw")}
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["weight_decay"] == 0.05
    assert sorted(g["weight_decay"] for g in adamw.param_groups) == [0.0, 0.05]

    schedulers = build_schedulers(optimizers, warmup_steps=2, total_steps=10, decay="cosine")
    idx = torch.randint(0, 50, (4, 8))
    losses = []
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(6):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        losses.append(loss.item())
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        for s in schedulers:
            s.step()
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name


def test_build_optimizers_without_matrices_returns_adamw_only():
    norm = nn.LayerNorm(4)
    optimizers, table = build_optimizers(norm)
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.AdamW)
    assert table.names_for("muon") == []
