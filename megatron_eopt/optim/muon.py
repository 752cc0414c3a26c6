"""Muon: momentum orthogonalized by Newton–Schulz (Emerging-Optimizers 0.3.0 ``Muon`` interface)."""

from __future__ import annotations

import types
from typing import Any, Sequence

from torch.optim.optimizer import ParamsT

from ..coefficients import NS_EPS
from ._config import ReadOnlySetting, fused_config
from ..low_memory_state import DEFAULT_BLOCK_SIZE
from .step.block_periodic import check_block_period
from .step.grouping import DEFAULT_WORKSPACE_MIB
from .weight_update_hooks import WeightUpdateHook
from .orthogonalized import OrthogonalizedOptimizer


class Muon(OrthogonalizedOptimizer):
    """Muon with the constructor, defaults, step order and state of Emerging-Optimizers' ``Muon``.

    Per 2-D parameter: weight decay (``weight_decay_method``: decoupled ``p -= lr·wd·p``,
    independent ``p -= wd·p``, l2 ``g += wd·p``, palm ``p -= lr²·wd·p``); momentum EMA
    ``M ← lerp(M, g, 1-momentum)``; Nesterov ``lerp(g, M, momentum)`` or ``M``; Newton–Schulz
    (``coefficient_type``, ``num_ns_steps``, matmuls in ``fp32_matmul_prec``); scale by
    ``scale_mode`` × ``extra_scale_factor``; ``p -= lr·update``. State: ``momentum_buffer``.

    ``use_syrk=True`` runs the Newton–Schulz ops with symmetric products (the symmetric kernel or
    lower block panels; False: chosen by measurement); ``ns_products`` (an extension: "auto",
    "symmetric", "full") chooses them directly. The same results to float rounding. ``custom_coefficient_sets`` (an extension) gives the rows of
    ``coefficient_type="custom"``. The legacy Keller Jordan / nanochat Muon is
    ``Muon(params, lr=0.02, weight_decay=0, nesterov=True, coefficient_type="simple",
    scale_mode="shape_scaling")``; ``torch.optim.Muon`` with ``adjust_lr_fn="original"`` is the
    same with its weight decay, and ``"match_rms_adamw"`` is ``scale_mode="spectral",
    extra_scale_factor=0.2``.

    ``nd_mode`` (also a param-group key) decides what happens to params with more than two dims:
    ``"error"`` refuses them at ``step()`` (ValueError, as Emerging-Optimizers 0.4; so are 0-D / 1-D
    params and an unknown ``weight_decay_method``, ``coefficient_type`` or ``scale_mode``, with
    nothing changed), ``"batch"`` treats leading dims as independent
    matrices (MoE experts ``(E, m, n)``: each expert is its own Muon matrix, scaled from ``(m, n)``),
    ``"flatten"`` views them as ``(size(0), -1)`` (convolutions). DTensor params (FSDP2, tensor
    parallel, HSDP) keep DTensor state; ``sharded_mode`` chooses how a matrix split across ranks
    is orthogonalized: ``"owner"`` (one rank per matrix, all-to-all) or ``"gather"`` (all ranks).
    ``replica_work`` (owner mode, meshes with a replicate dim such as HSDP's): ``"repeat"``
    orthogonalizes every matrix once per replica; ``"split"`` once in the whole mesh, balanced over
    the ranks of every replica, each result sent to the ranks of all of them (the same results);
    ``"auto"`` (default) picks one by the cost model the planner reports, for the device (split when
    the Newton–Schulz it saves outweighs the results it sends; ``multirank.replica_work``,
    ``multirank.cost_model``).

    ``overlap_backward`` (an extension, default False): momentum and Newton–Schulz of each chunk
    start during ``loss.backward()`` as soon as its gradients are final; ``step()`` applies the
    updates, bitwise as without overlap (``optim.step.overlap``; ``accumulating()`` for plain
    gradient-accumulation loops).

    ``block_period`` P (an extension, default None: off) selects MuonBP (arXiv 2510.16981), a
    different algorithm: on P - 1 of every P steps a matrix sharded across ranks (DTensor) is
    orthogonalized shard by shard where it lives, scaled by its shard's shape, with the step size
    ``lr·block_lr_scale``; every P-th step is a full Muon step (``optim.step.block_periodic``).

    The 2026 recipe (nanochat's ``MuonAdamW``), each off by default:

    - ``weight_decay_method="cautious"``: decoupled decay only where the update and the weight
      agree in sign, ``p -= lr·wd·p·[U·p ≥ 0]`` (Chen et al., "Cautious Weight Decay", 2025);
    - ``row_equilibration=True``: MuonEq (arXiv 2603.28254), every row of the Newton–Schulz input
      rescaled to the root-mean-square row norm before orthogonalization;
    - ``frobenius_renorm=True``: Muon+ (arXiv 2602.21545), the orthogonalized update's Frobenius
      norm set to √min(m, n) before scaling;
    - ``ns_eps_mode``: the Frobenius normalization that starts Newton–Schulz, ``"clamp"``
      ``X / max(‖X‖, ns_eps)`` (Emerging-Optimizers) or ``"add"`` ``X / (‖X‖ + ns_eps)`` (the
      snippets), ``ns_eps`` as below (nanochat uses 1e-6 since 2026);
      ``ns_norm_divisor`` s ≥ 1 divides by ``s·‖X‖`` (Polar Express's safety, arXiv 2505.16932);
    - ``polar_express_safety`` s ≥ 1 (with ``coefficient_type="polar_express"``): the Polar Express
      table for that safety factor, every row but the last evaluated at X / s (``None``: the
      table as Emerging-Optimizers ships it, which is s = 1.01 cut to four decimals).

    Cautious decay runs inside the fused update op; the Newton–Schulz options run inside the
    Newton–Schulz op (MuonEq and the normalization in the pass that writes its input, Muon+ in the
    pass that writes its result), with no elementwise pass of their own.
    NorMuon-style variance reduction as nanochat does it is :class:`AdaptiveMuon` with
    ``moment2_method="normuon", eps=1e-10``.

    ``weight_update_hook`` (Emerging-Optimizers main's protocol, see
    :mod:`~megatron_eopt.optim.weight_update_hooks`) runs around ``p -= lr·update``; the three hooks
    of that module run batched in the fused step, any other object per parameter.

    ``ns_eps`` (an extension) is the Frobenius-normalization floor of Newton–Schulz: 1e-15 as in
    Emerging-Optimizers 0.4; ``ns_eps=1e-7`` reproduces 0.3.0 (it differs only for updates of
    norm below about 1e-7, which 0.3.0 shrinks instead of orthogonalizing).

    ``state_dtype`` (an extension): how the momentum is stored between steps. ``"fp32"`` (default:
    the parameter's dtype, Emerging-Optimizers' numerics bit for bit), ``"bf16"``, ``"int8"`` or
    ``"fp8"`` (1 byte per value plus one fp32 scale per ``state_block_size`` values of a row), each
    rounded stochastically (unbiased) inside the fused momentum op; see
    :mod:`megatron_eopt.low_memory_state`. Checkpoints convert between state dtypes on load.

    ``workspace_mib`` (an extension, default ``"auto"``: 256 on GPUs, 64 on the CPU): the step's
    workspace budget in MiB. Matrices are
    stepped in chunks whose Newton–Schulz buffers fit it together, so the memory a step needs beyond
    params, grads and state is bounded by the budget (or by the largest matrix, stepped alone), not by
    the size of the model; small matrices still share one batched call. ``None``: no bound (every
    same-shape matrix in one call). Also a settable attribute, ``opt.workspace_mib``.

    Read-only properties (Emerging-Optimizers main): ``num_ns_steps``, ``coefficient_type`` and
    ``use_syrk`` (whether the Newton–Schulz ops run with symmetric products); assigning one raises
    AttributeError. ``scale_mode`` and ``extra_scale_factor`` stay settable, as in
    Emerging-Optimizers 0.4 (main makes them read-only too). ``Muon[HookState]`` subscripts the class
    by its weight-update hook's state type, as EO main's generic ``Muon`` (``Muon[None](params)``
    builds a Muon).
    """

    num_ns_steps = ReadOnlySetting("num_ns_steps")
    coefficient_type = ReadOnlySetting("coefficient_type")
    use_syrk = ReadOnlySetting(read=lambda config: config.products == "symmetric")

    def __class_getitem__(cls, item: Any) -> types.GenericAlias:
        """``Muon[T]``: the class parametrized by the weight-update hook's state type (one argument)."""
        if isinstance(item, tuple) and len(item) != 1:
            raise TypeError(f"Too many arguments for {cls.__name__}; actual {len(item)}, expected 1")
        return types.GenericAlias(cls, item)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.01,
        *,
        nesterov: bool = False,
        weight_decay_method: str = "decoupled",
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        use_syrk: bool = False,
        weight_update_hook: WeightUpdateHook | None = None,
        custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
        nd_mode: str = "error",
        sharded_mode: str = "owner",
        replica_work: str = "auto",
        row_equilibration: bool = False,
        frobenius_renorm: bool = False,
        ns_eps_mode: str = "clamp",
        ns_norm_divisor: float = 1.0,
        polar_express_safety: float | None = None,
        ns_eps: float = NS_EPS,
        ns_products: str = "auto",
        state_dtype: str = "fp32",
        state_block_size: int = DEFAULT_BLOCK_SIZE,
        workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB,
        overlap_backward: bool = False,
        block_period: int | None = None,
        block_lr_scale: float = 1.0,
    ) -> None:
        check_block_period(block_period, block_lr_scale)
        self.block_period, self.block_lr_scale = block_period, float(block_lr_scale)
        config, deferred_error = fused_config(locals())
        self._init_fused(
            params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay), config, nd_mode=nd_mode,
            sharded_mode=sharded_mode, replica_work=replica_work, weight_update_hook=weight_update_hook,
            state_dtype=state_dtype, state_block_size=state_block_size, workspace_mib=workspace_mib,
            deferred_error=deferred_error, overlap_backward=overlap_backward,
        )
