"""A float64 re-expression of Motif's parallel Muon (its single-file release, read for behaviour),
used as the reference of the Motif lineage in test_motif_compat.py and motif_worker.py.

Muon groups: ``buf = momentum·buf + g``; Newton–Schulz input ``g + momentum·buf`` (Nesterov) or
``buf``; Motif's five-row quintic, each matrix (each expert of an (E, m, n) tensor) normalized by
``‖X‖_F + 1e-7`` and iterated on its short side; ``p *= 1 - lr·wd``,
``p -= lr·0.2·√max(m, n)·update``. AdamW groups: bias-corrected Adam with ``adamw_betas``,
``adamw_eps``, decoupled decay ``p *= 1 - lr·wd``. QK-clip: positional indices, the smallest
``sqrt(tau / logit)`` per listed head, rows of the head scaled; MLA as documented in
``megatron_eopt.compat.motif_qk_clip``. The state and param groups have Motif's layout.
"""

from __future__ import annotations

import math

import torch

# Motif's table, written out here (not read from the package under test).
MOTIF_QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adamw_betas", "adamw_eps", "none_grad")


def motif_ns(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Newton–Schulz of one matrix or of each (m, n) slice of an (E, m, n) tensor, computed in
    ``dtype`` (float64: the reference; bfloat16: Motif's own arithmetic, the input and every product
    rounded to bf16), returned in float64."""
    if x.dim() == 3:
        return torch.stack([motif_ns(m, dtype) for m in x])
    x = x.to(dtype)
    tall = x.shape[0] > x.shape[1]
    w = x.T if tall else x
    w = w / (w.norm() + 1e-7)
    for a, b, c in MOTIF_QUINTIC:
        gram = w @ w.T
        w = a * w + (b * gram + c * gram @ gram) @ w
    return (w.T if tall else w).double()


def parse_name(name: str):
    """(query or key, MLA, layer) of a projection's name, or None: the second-to-last part names the
    projection, the layer is the last all-digit part."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    kinds = {"wq": ("q", False), "q_proj": ("q", False), "wk": ("k", False), "k_proj": ("k", False),
             "wq_b": ("q", True), "wkv_b": ("k", True)}
    if parts[-2] not in kinds:
        return None
    digits = [int(p) for p in parts if p.isdigit()]
    return (*kinds[parts[-2]], digits[-1] if digits else -1)


def clip_row_factors(rows: int, kind: str, mla: bool, logits, config) -> torch.Tensor:
    """Per-row factors of one weight under Motif's QK-clip (ones where nothing clips)."""
    indices = config.get("q_indices" if kind == "q" else "k_indices") or []
    tau = config.get("threshold")
    if mla:
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        per_head = nope + (rope if kind == "q" else v)
    else:
        per_head = config["head_dim"]
    heads = rows // per_head
    gamma = [1.0] * heads
    for j, h in enumerate(indices):
        value = float(logits[j])
        if value > tau:
            gamma[h] = min(gamma[h], tau / value)
    out = []
    for h in range(heads):
        if not mla:
            out += [math.sqrt(gamma[h])] * per_head
        elif kind == "q":
            out += [math.sqrt(gamma[h])] * nope + [gamma[h]] * rope
        else:
            out += [math.sqrt(gamma[h])] * nope + [1.0] * v
    return torch.tensor(out, dtype=torch.float64)


class MotifReference:
    """Motif's optimizer on float64 copies of the parameters, with a Motif-layout state_dict."""

    def __init__(self, params: list[torch.Tensor], groups: list[dict], clip_config=None):
        """params: the model's parameters in group order; groups: Motif groups whose 'params' are
        indices into `params` (every Motif key present)."""
        self.p = [t.detach().double().clone() for t in params]
        self.groups = [dict(g) for g in groups]
        self.state: dict[int, dict] = {}
        self.clip_config = clip_config
        self.ns_dtype = torch.float64  # what motif_ns computes in

    def step(self, grads: dict[int, torch.Tensor], qk_logits=None) -> None:
        for group in self.groups:
            lr, wd = group["lr"], group["weight_decay"]
            for pos, i in enumerate(group["params"]):
                if i not in grads:
                    continue
                g = grads[i].double()
                st = self.state.setdefault(i, {})
                if group["use_muon"]:
                    mu = group["momentum"]
                    buf = st.get("momentum_buffer", torch.zeros_like(g)) * mu + g
                    st["momentum_buffer"] = buf
                    u = motif_ns(g + mu * buf if group["nesterov"] else buf, self.ns_dtype)
                    m, n = self.p[i].shape[-2:]
                    self.p[i] = self.p[i] * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(m, n)) * u
                    self._clip(i, group["names"][pos] if "names" in group else "", qk_logits)
                else:
                    b1, b2 = group["adamw_betas"]
                    t = float(st.get("step", 0.0)) + 1
                    m1 = st.get("moment1", torch.zeros_like(g)) * b1 + (1 - b1) * g
                    m2 = st.get("moment2", torch.zeros_like(g)) * b2 + (1 - b2) * g * g
                    st.update(step=t, moment1=m1, moment2=m2)
                    denom = (m2 / (1 - b2**t)).sqrt() + group["adamw_eps"]
                    self.p[i] = self.p[i] * (1 - lr * wd) - lr * (m1 / (1 - b1**t)) / denom

    def _clip(self, i: int, name: str, qk_logits) -> None:
        config = self.clip_config
        parsed = parse_name(name)
        if config is None or qk_logits is None or parsed is None:
            return
        kind, mla, layer = parsed
        if not config.get("q_indices" if kind == "q" else "k_indices"):
            return
        factors = clip_row_factors(self.p[i].shape[0], kind, mla, qk_logits[layer], config)
        self.p[i] = self.p[i] * factors[:, None]

    def state_dict(self) -> dict:
        """Motif's layout: fp32 tensors, AdamW 'step' as an fp32 0-dim tensor."""
        state = {}
        for i, st in self.state.items():
            state[i] = {k: (torch.tensor(v, dtype=torch.float32) if k == "step" else v.float().clone())
                        for k, v in st.items()}
        return {"state": state, "param_groups": [dict(g) for g in self.groups]}

    def load_state_dict(self, sd: dict) -> None:
        """Takes a state_dict of either optimizer: Motif's keys are read, others ignored."""
        self.state = {}
        for i, st in sd["state"].items():
            keep = {}
            for k in ("momentum_buffer", "moment1", "moment2"):
                if k in st:
                    keep[k] = st[k].double().clone()
            if "step" in st:
                keep["step"] = float(st["step"])
            self.state[i] = keep
        self.groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
