"""Tracing a model whose parameters are DTensors (:func:`megatron_eopt.param_use.trace_parameter_uses`).

The trace runs the forward on meta tensors of each parameter's global shape (a DTensor's ``shape``),
so it reads the uses of the unsharded model, and the routes are those of the unsharded model:

- FSDP2 (``fully_shard``): its forward hooks all-gather the shards before a module's forward and
  free them after; around the traced forward they are set aside (no collective runs, nothing is
  gathered), and the forward they wrap is the unsharded module's own;
- a parameter made a DTensor by hand (``distribute_tensor``) on a module without forward hooks: a
  DTensor computes as its global tensor does.

A DTensor parameter under forward hooks that are not FSDP2's is refused, named: tensor parallelism's
``parallelize_module`` / ``distribute_module`` hooks turn the inputs into DTensors and the outputs
into local shards, and the code after them (a head count divided by the TP degree, say) computes on
those shards; what that forward does on unsharded tensors is not what it does sharded.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["is_sharded", "sharded_trace_problem", "fsdp_hooks_set_aside"]


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor."""
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def _is_fsdp_hook(hook) -> bool:
    """A hook of FSDP2's (its state's bound methods, bare or wrapped for a group of modules)."""
    seen = set()
    while hook is not None and id(hook) not in seen:  # a bound method's __wrapped__ loses __self__: each level
        seen.add(id(hook))
        owner = getattr(hook, "__self__", None)
        if owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp"):
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


def _hook_names(module: nn.Module) -> list[str]:
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    return [getattr(h, "__qualname__", type(h).__name__) for h in hooks if not _is_fsdp_hook(h)]


def sharded_trace_problem(model: nn.Module) -> str | None:
    """Why the forward of ``model``, whose parameters are DTensors, cannot be traced on unsharded
    meta tensors (the first DTensor parameter under a forward hook that is not FSDP2's), or None."""
    owners = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            if hasattr(p, "device_mesh"):
                owners.setdefault(id(p), (f"{path}.{pname}" if path else pname, path, p))
    for name, path, p in owners.values():
        parts = path.split(".") if path else []
        for depth in range(len(parts), -1, -1):
            where = ".".join(parts[:depth])
            hooks = _hook_names(model.get_submodule(where))
            if hooks:
                return (f"parameter {name!r} is a DTensor ({', '.join(map(repr, p.placements))} on a "
                        f"{p.device_mesh.ndim}-D mesh) under forward hooks that are not FSDP2's (module "
                        f"{where or type(model).__name__!r}: {', '.join(hooks[:3])}), as tensor parallelism "
                        "(parallelize_module, distribute_module) adds: the forward they shape computes on local "
                        "shards, so its trace on unsharded meta tensors would not read what the sharded model "
                        "does. Route the model before parallelizing it (the same parameter names), or pass "
                        "example_inputs=False and views= for what the tables do not know")
    return None


@contextlib.contextmanager
def fsdp_hooks_set_aside(model: nn.Module):
    """FSDP2's forward hooks removed from every module of ``model`` for the block (no all-gather,
    no reshard, no state change), and back in place, in their order, after it."""
    saved = []
    for module in model.modules():
        pre, post = module._forward_pre_hooks, module._forward_hooks
        if any(_is_fsdp_hook(h) for h in list(pre.values()) + list(post.values())):
            saved.append((module, pre, post))
            module._forward_pre_hooks = type(pre)((k, h) for k, h in pre.items() if not _is_fsdp_hook(h))
            module._forward_hooks = type(post)((k, h) for k, h in post.items() if not _is_fsdp_hook(h))
    try:
        yield
    finally:
        for module, pre, post in saved:  # the same dicts: the hooks' handles still remove them
            module._forward_pre_hooks, module._forward_hooks = pre, post
