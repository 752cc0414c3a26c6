"""The one-time ``DeprecationWarning`` of each legacy name, naming what replaces it."""

from __future__ import annotations

import threading
import warnings

_REPLACEMENTS = {
    "zeropower_via_newtonschulz5": 'megatron_eopt.newton_schulz(G.float(), steps, coefficient_type="simple")',
    "Muon": (
        'megatron_eopt.optim.Muon(params, lr=0.02, weight_decay=0.0, nesterov=True, coefficient_type="simple", '
        'scale_mode="shape_scaling")'
    ),
    "DistMuon": (
        "megatron_eopt.optim.Muon under DistributedDataParallel / FSDP2, or Megatron-LM's "
        "use_layer_wise_distributed_optimizer"
    ),
    "get_megatron_muon_optimizer": (
        "megatron_eopt.integrations.megatron.install() then megatron.core.optimizer.get_megatron_optimizer "
        '(OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=...))'
    ),
    "TensorParallelMuon": "megatron_eopt.optim.TensorParallelMuon",
    "MotifMuon": (
        "megatron_eopt.optim.HybridMuon (groups flagged use_muon, clip_config, cpu_offload; its own EMA "
        "momentum and exact per-head QK-clip, see docs/compatibility.md for how they differ from Motif's)"
    ),
    "MuonWithAuxAdam": "megatron_eopt.optim.HybridMuon (groups flagged use_muon)",
    "SingleDeviceMuonWithAuxAdam": "megatron_eopt.optim.HybridMuon (groups flagged use_muon)",
    "get_default_muon_param_groups": "param groups flagged use_muon for megatron_eopt.optim.HybridMuon",
}
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(name: str, stacklevel: int = 3) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(
        f"megatron_eopt.muon.{name} is deprecated; use {_REPLACEMENTS[name]}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


