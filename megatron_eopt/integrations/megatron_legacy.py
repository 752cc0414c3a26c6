"""Megatron-LM's older ``muon.py`` names (served by ``megatron_eopt.muon``)."""

from __future__ import annotations

import copy
from typing import Any

from ..compat._deprecation import _warn_once


def get_megatron_muon_optimizer(
    config: Any,
    model_chunks: list,
    config_overrides: dict | None = None,
    use_gloo_process_groups: bool = True,
    layer_wise_distributed_optimizer: bool = False,
    pg_collection: Any = None,
    **kwargs: Any,
) -> Any:
    """Megatron-LM's older Muon factory: installs megatron-eopt's entries, then builds with
    ``megatron.core.optimizer.get_megatron_optimizer``.

    ``layer_wise_distributed_optimizer=True`` (the old argument) becomes the config's
    ``use_layer_wise_distributed_optimizer``; a ``dist_muon`` optimizer name keeps working.
    """
    _warn_once("get_megatron_muon_optimizer")
    from . import megatron as megatron_integration

    megatron_integration.install()
    from megatron.core.optimizer import get_megatron_optimizer

    if layer_wise_distributed_optimizer and not getattr(config, "use_layer_wise_distributed_optimizer", False):
        config = copy.copy(config)
        config.use_layer_wise_distributed_optimizer = True
    return get_megatron_optimizer(
        config,
        model_chunks,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
        **kwargs,
    )
