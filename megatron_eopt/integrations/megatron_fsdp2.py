"""Megatron-LM's Torch-FSDP2 path with megatron-eopt's optimizer: the training script's argument
check lifted for our optimizer names (:func:`allow_torch_fsdp2`), and a clear error where
megatron-core's ``torch_dist`` optimizer checkpoint cannot map FSDP2's DTensor parameters
(installed by ``install()``; docs/megatron.md, "Torch-FSDP2")."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ._megatron_patches import installed, set_global


# The checkpoint format Megatron-LM's training script can use for an emerging optimizer under
# Torch-FSDP2: torch.distributed.checkpoint of the module's and optimizer's state dicts.
FSDP2_CKPT_FORMAT = "torch_dcp"


def _torch_dist_under_fsdp2_error(original: Any) -> Any:
    """``get_param_id_to_sharded_param_map`` that fails clearly where megatron-core cannot map FSDP2 parameters.

    megatron-core keys the optimizer's parameters by ``id(param.to_local())`` and the model's sharded
    tensors by the id of their local shard; where ``to_local()`` makes a new view on each call
    (torch 2.14) nothing matches, for every optimizer, and the save stops at "Param id 0 does not
    match any model sharded param". Where some DTensor parameter is left unmapped this raises first,
    saying what to use instead; elsewhere it is megatron-core's function.
    """

    def get_param_id_to_sharded_param_map(model_sharded_state_dict: Any, optim_params_iter: Any) -> Any:
        params = list(optim_params_iter)
        mapped = original(model_sharded_state_dict, params)
        unmapped = [i for i, p in enumerate(params) if hasattr(p, "device_mesh") and i not in mapped]
        if unmapped:
            raise ValueError(
                f"Megatron's torch_dist optimizer checkpoint cannot find {len(unmapped)} Torch-FSDP2 (DTensor) "
                f"parameters among the model's sharded tensors (torch {torch.__version__} makes a new local view "
                "on each to_local(); this happens with every optimizer). Save with torch.distributed.checkpoint "
                f"instead: --ckpt-format {FSDP2_CKPT_FORMAT} in Megatron-LM's training script, or dcp.save of the "
                "module's and the optimizer's state_dict() (docs/megatron.md, \"Torch-FSDP2\")"
            )
        return mapped

    get_param_id_to_sharded_param_map._megatron_eopt = True
    return get_param_id_to_sharded_param_map


def guard_torch_dist_under_fsdp2() -> None:
    module = importlib.import_module("megatron.core.optimizer.optimizer")
    original = getattr(module, "get_param_id_to_sharded_param_map", None)
    if original is not None and not getattr(original, "_megatron_eopt", False):
        set_global(module, "get_param_id_to_sharded_param_map", _torch_dist_under_fsdp2_error(original))


def allow_torch_fsdp2() -> None:
    """Lets Megatron-LM's training script take ``--use-torch-fsdp2`` with megatron-eopt's optimizer.

    megatron-core's ``get_megatron_optimizer`` builds an emerging optimizer over FSDP2 (DTensor)
    parameters, and ours keep every layout option there (or refuse it with an error); Megatron-LM's
    argument check (``megatron.training.arguments.validate_args``) still refuses the combination
    ("Emerging optimizer does not support Torch-FSDP2 for now"). After this call that one refusal
    is lifted for an optimizer name whose entry is megatron-eopt's (see :func:`installed`); every
    other check runs as before. Under FSDP2 the run must use ``--ckpt-format torch_dcp`` (its
    ``torch_dist`` optimizer checkpoint cannot find FSDP2's parameters, for any optimizer), and
    ``--use-distributed-optimizer`` / ``dist_muon`` stay refused (FSDP2 shards the state already):
    both are a ValueError from the check. :func:`uninstall` puts the check back.
    """
    arguments = importlib.import_module("megatron.training.arguments")
    original = arguments.validate_args
    if getattr(original, "_megatron_eopt", False):
        return

    def validate_args(args: Any, defaults: dict | None = None) -> Any:
        name = getattr(args, "optimizer", None)
        if not (getattr(args, "use_torch_fsdp2", False) and name in installed()):
            return original(args, {} if defaults is None else defaults)
        if getattr(args, "use_distributed_optimizer", False):
            raise ValueError(
                f"--optimizer {name} with --use-torch-fsdp2 takes no --use-distributed-optimizer: FSDP2 "
                "already shards the optimizer state"
            )
        if getattr(args, "ckpt_format", None) != FSDP2_CKPT_FORMAT:
            raise ValueError(
                f"--optimizer {name} with --use-torch-fsdp2 needs --ckpt-format {FSDP2_CKPT_FORMAT} (got "
                f"{getattr(args, 'ckpt_format', None)!r}): megatron-core's torch_dist optimizer checkpoint "
                "cannot match FSDP2's DTensor parameters"
            )
        # Megatron-LM's check refuses every optimizer but sgd / adam with FSDP2; it reads the name in
        # three places only (that refusal, dist_muon's conversion, Megatron-FSDP's refusal), so
        # validating under "adam" lifts the refusal and nothing else.
        args.optimizer = "adam"
        try:
            return original(args, {} if defaults is None else defaults)
        finally:
            args.optimizer = name

    validate_args._megatron_eopt = True
    set_global(arguments, "validate_args", validate_args)
