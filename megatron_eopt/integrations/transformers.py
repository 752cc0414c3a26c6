"""Hugging Face ``transformers.Trainer`` with Muon on the hidden matrices and AdamW on the rest.

Trainer builds its optimizer from ``optimizer_cls_and_kwargs``; when the first element is not a
``torch.optim.Optimizer`` subclass, Trainer treats it as a factory: it instantiates it and calls
the instance with the model and the keyword arguments. :class:`MuonAdamWFactory` is such a factory::

    from megatron_eopt.integrations.transformers import MuonAdamWFactory

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-4)))

It routes the model's parameters with :func:`megatron_eopt.route_parameters` (hidden matrices to
Muon, each seen as the (out, in) matrices its forward multiplies by, read from one traced forward
on the model's dummy inputs or ``example_inputs`` and from its module classes: ``Conv1D`` weights stored (in,
out), fused QKV and gate/up projections split, MoE experts one matrix per expert, see
:mod:`megatron_eopt.model_views`; embeddings, output heads, norms, biases and routers to AdamW)
and returns one
:class:`megatron_eopt.optim.HybridMuon`, so Trainer's learning-rate scheduler, gradient clipping,
checkpointing (``optimizer.pt``) and resuming see a single optimizer. Trainer's
``args.learning_rate`` and ``args.weight_decay`` do not reach a factory: give the values here.

Outside Trainer's factory path, ``build_muon_adamw(model, ...)`` returns the same optimizer (for
``Trainer(optimizers=(optimizer, None))`` or a hand-written loop).

Trainer clips every gradient by one global norm (``max_grad_norm=1.0`` by default).
:class:`MuonClipMixin` (or the ready-made ``MuonClipTrainer = MuonClipMixin + Trainer``) replaces
that clip with :func:`megatron_eopt.clip_grad_norm_` at the same ``max_grad_norm``: by default only
the AdamW part is clipped, by its own norm, and the logged ``grad_norm`` is still the norm of all
gradients before clipping.

Resuming: transformers 5 saves some weights under other names than the model's (its checkpoint
conversion mapping: MoE experts stored fused, ``(E, 2I, H)`` ``gate_up_proj``, are saved one
``gate_proj`` / ``up_proj`` / ``down_proj`` per expert; GPT-NeoX's ``lm_head`` is saved as
``embed_out``), and Trainer's ``resume_from_checkpoint`` loads the checkpoint without converting them
back (transformers issue #48805): those weights keep their initial values while the optimizer's
state is restored. :class:`ResumeConversionMixin` (part
of :class:`MuonClipMixin` and ``MuonClipTrainer``) loads them converted back, and
:func:`load_converted_weights` does it for a stock Trainer's model.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..clipping import DEFAULT_CLIP_POLICY
from ..optim.hybrid import HybridMuon
from ..param_routing import DEFAULT_EMBEDDING_PATTERNS, DEFAULT_HEAD_PATTERNS, route_parameters

__all__ = [  # and MuonClipTrainer, built on first use
    "MuonAdamWFactory", "MuonClipMixin", "ResumeConversionMixin", "build_muon_adamw", "load_converted_weights",
]


def build_muon_adamw(
    model: nn.Module,
    *,
    lr: float = 0.02,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    adamw_lr: float = 3e-4,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    scale_mode: str = "shape_scaling",
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    head_patterns: Sequence[str] = DEFAULT_HEAD_PATTERNS,
    adamw_patterns: Sequence[str] = (),
    fused_gate_up: str = "split",
    routers: str = "adamw",
    views: Mapping[str, Any] | None = None,
    verbose: bool = False,
    example_inputs: Any = None,
    **muon_kwargs: Any,
) -> HybridMuon:
    """One :class:`HybridMuon` for ``model``: Muon (``lr``, ``momentum``, ``nesterov``,
    ``weight_decay``, ``scale_mode`` — √max(1, m/n) by default, the scale lr ≈ 0.02 is tuned
    for — and any other :class:`megatron_eopt.optim.Muon` keyword) on the 2-D hidden matrices,
    AdamW (``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay`` on matrices, none
    on 0-D / 1-D tensors) on the rest. ``verbose=True`` prints the routing table (each parameter's
    optimizer, matrix view and scale). ``fused_gate_up`` (``"split"``: gate and up of a fused
    projection orthogonalized apart, as separate ``nn.Linear`` would be; ``"whole"``: together, as
    Megatron-LM's ``linear_fc1``), ``routers`` (``"adamw"`` or ``"muon"``), ``views`` and
    ``example_inputs`` (the forward traced to read each weight's use; None: the model's
    ``dummy_inputs``; False: no trace) are those of :func:`megatron_eopt.route_parameters`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    table, routed = route_parameters(
        model, weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay,
        embedding_patterns=embedding_patterns, head_patterns=head_patterns, adamw_patterns=adamw_patterns,
        fused_gate_up=fused_gate_up, routers=routers, views=views,
        scale_mode=scale_mode if isinstance(scale_mode, str) else "shape_scaling", example_inputs=example_inputs,
    )
    adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    groups = [
        dict(g, use_muon=True, weight_decay=weight_decay) for g in table.muon_groups
    ] + [
        {"params": routed["adamw_decay"], "use_muon": False, "weight_decay": adamw_wd},
        {"params": routed["adamw_no_decay"], "use_muon": False, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model has no trainable parameters")
    if verbose:
        table.print()
    return HybridMuon(
        groups, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, scale_mode=scale_mode,
        adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_weight_decay=adamw_wd,
        **muon_kwargs,
    )


class MuonAdamWFactory:
    """The ``optimizer_cls_and_kwargs`` factory of ``transformers.Trainer``: ``MuonAdamWFactory()(model,
    **kwargs)`` is :func:`build_muon_adamw` (see the module docstring)."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        return build_muon_adamw(model, **kwargs)

_UPSTREAM = "transformers issue #48805"


def _checkpoint_files(checkpoint: str) -> dict[str, str] | None:
    """Each weight of ``checkpoint`` (a ``save_pretrained`` directory) -> the file holding it, in the order
    Trainer reads them (one safetensors file, one .bin, a safetensors index, a .bin index); None: no model weights
    there (an adapter-only or FSDP checkpoint)."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt") as f:
                    keys = list(f.keys())
            else:
                keys = list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            return dict.fromkeys(keys, path)
    for name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            return {k: os.path.join(checkpoint, v) for k, v in weight_map.items()}
    return None


def _read_tensors(files: Mapping[str, str], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    by_file: dict[str, list[str]] = {}
    for k in keys:
        by_file.setdefault(files[k], []).append(k)
    out = {}
    for path, names in by_file.items():
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in names})
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            out.update({k: state[k] for k in names})
    return out


def _refusal(checkpoint: str, detail: str) -> RuntimeError:
    return RuntimeError(
        f"checkpoint {checkpoint!r}: {detail}. transformers saves these weights under its checkpoint conversion "
        f"mapping and Trainer's resume_from_checkpoint does not convert them back ({_UPSTREAM}), so resuming would "
        "restart them from their initial values while the optimizer state is restored. Load the model with "
        "`model = AutoModelForCausalLM.from_pretrained(checkpoint)` (or the model's own class) before "
        "`Trainer(model=model, ...).train(resume_from_checkpoint=checkpoint)`."
    )


def load_converted_weights(model: nn.Module, checkpoint: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Load into ``model``, in place, the weights that the ``save_pretrained`` directory ``checkpoint`` holds
    only under transformers' saved names (its checkpoint conversion mapping, e.g. Qwen3-MoE's fused experts saved
    one ``gate_proj`` / ``up_proj`` / ``down_proj`` per expert), which ``model.load_state_dict`` and Trainer's
    ``resume_from_checkpoint`` leave at their current values. Returns ``(model_keys, checkpoint_keys)``: the
    model's state-dict keys loaded and the checkpoint's keys they came from; both empty when every weight of the
    model is in the checkpoint under its own name (nothing to convert) or ``checkpoint`` holds no model weights.

    The mapping is transformers' own (``revert_weight_conversion``, what ``save_pretrained`` applies), run on
    tensors of element indices: each missing weight (grouped by module) is traced to the saved elements it became,
    and those are gathered back, exactly (no arithmetic). Raises ``RuntimeError`` (naming the upstream issue and the
    ``from_pretrained`` workaround) when a missing weight maps to saved names the checkpoint lacks, or when the
    conversion is not a pure rearrangement. Weights missing under both names are left alone (Trainer warns).
    Call it before ``trainer.train(resume_from_checkpoint=checkpoint)`` with a stock Trainer; the Trainers with
    :class:`ResumeConversionMixin` call it themselves.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path, got {type(checkpoint).__name__}")
    checkpoint = os.fspath(checkpoint)
    if not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint must be a directory written by save_pretrained, got {checkpoint!r}")
    files = _checkpoint_files(checkpoint)
    if files is None:
        return [], []
    state = {k: t for k, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    present = {id(t) for k, t in state.items() if k in files}
    # a weight tied to one that the checkpoint holds (lm_head to the embedding) is not missing
    missing = [k for k, t in state.items() if k not in files and id(t) not in present]
    if not missing:
        return [], []
    from transformers.core_model_loading import revert_weight_conversion

    groups: dict[str, list[str]] = {}
    for k in missing:
        groups.setdefault(k.rpartition(".")[0], []).append(k)
    loaded: dict[str, torch.Tensor] = {}
    used: list[str] = []
    for keys in groups.values():
        sizes = [state[k].numel() for k in keys]
        total = sum(sizes)
        index_dtype = torch.int32 if total < 2**31 else torch.int64
        starts, probe, at = [], {}, 0
        for k, n in zip(keys, sizes):
            starts.append(at)
            probe[k] = torch.arange(at, at + n, dtype=index_dtype).view(state[k].shape)
            at += n
        try:
            saved = revert_weight_conversion(model, dict(probe))
        except Exception as exc:  # a conversion that cannot run on index tensors (quantized, arithmetic)
            raise _refusal(checkpoint, f"the saved form of {keys} could not be traced ({exc})") from exc
        renamed = {s: t for s, t in saved.items() if not (s in probe and torch.equal(t, probe[s]))}
        if not renamed:
            continue  # missing under its own name and not converted: Trainer's own warning
        absent = sorted(s for s in renamed if s not in files)
        if absent:
            raise _refusal(checkpoint, f"{keys} are saved as {absent[:4]}{' ...' if len(absent) > 4 else ''}, "
                                       "which it does not hold")
        values = _read_tensors(files, list(renamed))
        starts_t = torch.tensor(starts, dtype=torch.int64)
        flat = [torch.empty(n, dtype=state[k].dtype) for k, n in zip(keys, sizes)]
        seen = torch.zeros(total, dtype=torch.int32)
        for s, ids in renamed.items():
            value = values[s]
            if tuple(value.shape) != tuple(ids.shape):
                raise _refusal(checkpoint, f"{s!r} has shape {tuple(value.shape)}, the model saves "
                                           f"{tuple(ids.shape)}")
            ids = ids.reshape(-1).long()
            value = value.reshape(-1)
            seen.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            owner = torch.searchsorted(starts_t, ids, right=True) - 1
            for j in owner.unique().tolist():
                sel = owner == j
                flat[j][ids[sel] - starts[j]] = value[sel].to(flat[j].dtype)
        converted = [j for j, k in enumerate(keys) if k not in saved or not torch.equal(saved[k], probe[k])]
        for j in converted:
            if not bool((seen[starts[j]:starts[j] + sizes[j]] == 1).all()):
                raise _refusal(checkpoint, f"the saved form of {keys[j]!r} is not a rearrangement of its elements")
            loaded[keys[j]] = flat[j].view(state[keys[j]].shape)
        used += list(renamed)
    with torch.no_grad():
        for k, v in loaded.items():
            state[k].copy_(v)
    return list(loaded), used


class ResumeConversionMixin:
    """For a ``transformers.Trainer`` subclass (``class MyTrainer(ResumeConversionMixin, Trainer)``; part of
    :class:`MuonClipMixin` and ``MuonClipTrainer``): ``resume_from_checkpoint`` and ``load_best_model_at_end``
    also load the weights the checkpoint holds under transformers' saved names (fused MoE experts saved per
    expert), converted back by :func:`load_converted_weights`, where Trainer alone leaves them at their current
    values (transformers issue #48805), or raise when they cannot be. Trainer's warnings about missing and
    unexpected keys leave out the ones converted. DeepSpeed, FSDP and SageMaker model parallelism load through their
    engines and are left as they are.
    """

    _converted_keys: Any = None

    def _plain_model_load(self) -> bool:
        from transformers.utils import is_sagemaker_mp_enabled

        return not (getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
                    or is_sagemaker_mp_enabled())

    def _with_converted(self, checkpoint: str, load):
        from transformers import PreTrainedModel

        converted = None
        if checkpoint and isinstance(self.model, PreTrainedModel) and self._plain_model_load():
            converted = load_converted_weights(self.model, checkpoint)
        self._converted_keys = converted
        try:
            return load()
        finally:
            self._converted_keys = None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):  # Trainer's hook (transformers 5.x)
        if model is not None and model is not self.model:  # FSDP / SageMaker: their engine's state dict
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return self._with_converted(resume_from_checkpoint,
                                    lambda: super(ResumeConversionMixin, self)._load_from_checkpoint(
                                        resume_from_checkpoint, model))

    def _load_best_model(self):  # Trainer's hook (transformers 5.x)
        return self._with_converted(self.state.best_model_checkpoint,
                                    lambda: super(ResumeConversionMixin, self)._load_best_model())

    def _issue_warnings_after_load(self, load_result):
        if self._converted_keys and hasattr(load_result, "_replace"):
            model_keys, checkpoint_keys = (set(k) for k in self._converted_keys)
            load_result = load_result._replace(
                missing_keys=[k for k in load_result.missing_keys if k not in model_keys],
                unexpected_keys=[k for k in load_result.unexpected_keys if k not in checkpoint_keys],
            )
        return super()._issue_warnings_after_load(load_result)


class MuonClipMixin(ResumeConversionMixin):
    """Muon-aware gradient clipping for a ``transformers.Trainer`` subclass:
    ``class MyTrainer(MuonClipMixin, Trainer)``, or ``MuonClipTrainer``.

    Trainer's clip (``_clip_grad_norm``, called when ``args.max_grad_norm > 0``) becomes
    :func:`megatron_eopt.clip_grad_norm_` over the optimizer's parameters with
    ``policy=muon_clip_policy`` (a class attribute, ``"adamw"`` by default; ``"global"`` is
    Trainer's own clip, ``"separate"`` clips each part by its own norm) at ``args.max_grad_norm``.
    Its return value, the norm of all gradients before clipping, is what Trainer logs as
    ``grad_norm``; the parts of the last clip are kept as ``self.grad_norm_parts``
    (:class:`megatron_eopt.GradNorms`, tensors). fp16 gradients are unscaled by accelerate's
    ``unscale_gradients`` first, as accelerate's own clip does. DeepSpeed, FSDP1 and SageMaker
    model parallelism keep Trainer's own clip (their gradients are the engine's). Resuming converts
    the weights transformers saves under other names back (:class:`ResumeConversionMixin`).
    """

    muon_clip_policy: str = DEFAULT_CLIP_POLICY
    grad_norm_parts: Any = None

    def _clip_grad_norm(self, model):  # Trainer's hook (transformers 5.x)
        from ..clipping import clip_grad_norm_

        accelerator = self.accelerator
        distributed = str(getattr(accelerator, "distributed_type", ""))
        if "DEEPSPEED" in distributed or ("FSDP" in distributed and not getattr(accelerator, "is_fsdp2", False)) \
                or getattr(self.args, "sagemaker_mp_enabled", False) or not hasattr(self, "optimizer"):
            return super()._clip_grad_norm(model)
        optimizer = self.optimizer
        while type(optimizer).__name__ == "AcceleratedOptimizer":
            optimizer = optimizer.optimizer  # accelerate's wrapper: the classes tell Muon's parameters
        accelerator.unscale_gradients()
        parts = clip_grad_norm_(optimizer, self.args.max_grad_norm, policy=self.muon_clip_policy, return_parts=True)
        self.grad_norm_parts = parts
        return parts.total


def __getattr__(name: str) -> Any:
    if name == "MuonClipTrainer":  # built on first use, so that importing this module needs no transformers
        import transformers

        cls = type("MuonClipTrainer", (MuonClipMixin, transformers.Trainer), {
            "__doc__": "``transformers.Trainer`` with :class:`MuonClipMixin`'s Muon-aware gradient clipping "
                       "and :class:`ResumeConversionMixin`'s resume of the weights saved under other names.",
            "__module__": __name__,
        })
        globals()["MuonClipTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
