"""megatron_eopt.nanochat against float64 re-expressions of nanochat's optimizers (single process):
the step, the state layout, checkpoints in both directions, bad input. Distributed runs:
test_nanochat_distributed.py."""

import copy
import pickle
import re

import pytest
import torch

import megatron_eopt.nanochat as nanochat
from nanochat_reference import POLAR, RefMuon2201, RefMuonAdamW, assert_fp32_close
from reference import TOLERANCE, bf16_input_tolerance, rel_err

# several params per shape, tall / wide / square / 1 x n, a lone shape
MUON_SHAPES = [(8, 4), (5, 7), (8, 4), (12, 12), (8, 4), (5, 7), (1, 9), (33, 6)]
ADAMW_SHAPES = [(11, 6), (6,), (1,)]


def _params(shapes, gen, dtype=torch.float32):
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in shapes]


def _copies(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, gen, steps):
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(steps)]


def _run(opt, params, grads, schedule=None):
    for t, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        if schedule is not None:
            schedule(opt, t)
        opt.step()


def _delta_err(params, refs, start, storage_steps=0):
    """The largest relative difference of the parameters' updates. ``storage_steps``: steps after
    which both runs round the parameters to fp32 storage, so that they may differ by an ulp of the
    parameter per step whatever the size of the update (an update that nearly cancels over the steps,
    as a one-element AdamW parameter's can: 1.7e-3 over four steps of lr 0.01, apart by one ulp)."""
    errors = []
    for p, r, s in zip(params, refs, start):
        p, r, s = p.detach().double(), r.detach().double(), s.double()
        floor = storage_steps * torch.finfo(torch.float32).eps * float(r.norm()) / TOLERANCE["highest"]
        errors.append(float((p - r).norm()) / max(float((r - s).norm()), floor, 1e-300))
    return float("inf") if any(e != e for e in errors) else max(errors)  # NaN never passes


def _warmup(opt, t):
    # nanochat's training loop writes lr, momentum and weight decay into the groups every step
    for group in opt.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * (1.0 - 0.2 * t)
        if "momentum" in group:
            group["momentum"] = 0.85 + 0.03 * t
            group["weight_decay"] = 0.2 * (1.0 - 0.3 * t)


def _muonadamw_groups(params, muon_params):
    groups = [dict(kind="adamw", params=params, lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05)]
    for shape in sorted({p.shape for p in muon_params}):
        groups.append(dict(kind="muon", params=[p for p in muon_params if p.shape == shape], lr=0.02,
                           momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=0.2))
    return groups


@pytest.mark.parametrize("beta2", [0.95, None])
def test_muon_22a71aa_step_logic_matches_float64_reference(beta2, gen):
    # 22a71aa iterates in bf16 on every device; with the fused iteration switched to fp32 the whole
    # step (momentum, Polar Express and its 1.02 divisor, variance reduction, cautious decay,
    # schedules) must meet the fp32 tolerance against float64
    params = _params(MUON_SHAPES, gen)
    start, refs = [p.detach().clone() for p in params], _copies(params)
    grads = _grads(params, gen, 3)
    ours = nanochat.Muon(params, lr=0.02, momentum=0.9, beta2=beta2, weight_decay=0.2)
    ours._muon.precision = "highest"
    ref = RefMuon2201(refs, lr=0.02, momentum=0.9, beta2=beta2, weight_decay=0.2)
    _run(ours, params, grads, _warmup)
    _run(ref, refs, grads, _warmup)
    assert_fp32_close(params, refs, start, grads, ref.ties)
    _assert_same_layout(ours, ref)
    for gi, group in enumerate(ours.param_groups):
        for key in ("momentum_buffer", "second_momentum_buffer"):
            got = ours.state[group["params"][0]][key]
            want = ref.state[ref.param_groups[gi]["params"][0]][key]
            assert rel_err(got, want) <= (1e-6 if key == "momentum_buffer" else 1e-4), key  # v: squares


def test_muon_22a71aa_in_bf16_is_within_bf16_rounding_of_float64(gen):
    # one step: the Newton–Schulz input is a multiple of the grad, and bf16 rounding of it is
    # magnified by the Polar Express rows as much as that input's spectrum lets them
    params = _params(MUON_SHAPES, gen)
    start, refs = [p.detach().clone() for p in params], _copies(params)
    grads = _grads(params, gen, 1)
    _run(nanochat.Muon(params, lr=0.02, momentum=0.9, weight_decay=0.2), params, grads)
    _run(RefMuon2201(refs, lr=0.02, momentum=0.9, weight_decay=0.2), refs, grads)
    for p, r, s, g in zip(params, refs, start, grads[0]):
        if min(p.shape) == 1:
            # a rank-1 input: Polar Express's first row maps sigma ~ 1 through a·X + B·X, two terms
            # of size 8 cancelling to ~1, so one bf16 rounding there moves the result by ~20%
            # (nanochat's own bf16 iteration as much); the fp32 test above covers its logic
            continue
        tol = 2 * bf16_input_tolerance(g, "custom", 5, POLAR)  # the input and the iterates rounded
        assert rel_err(p.detach() - s, r.detach() - s) <= tol, tuple(p.shape)


def test_muonadamw_matches_float64_reference_in_fp32(gen):
    # on a CPU nanochat computes in fp32: the fp32 tolerance against float64
    assert nanochat.compute_dtype() == torch.float32
    adam_params, muon_params = _params(ADAMW_SHAPES, gen), _params(MUON_SHAPES, gen)
    params = adam_params + muon_params
    start, refs = [p.detach().clone() for p in params], _copies(params)
    grads = _grads(params, gen, 3)
    ours = nanochat.MuonAdamW(_muonadamw_groups(params[:3], params[3:]))
    ref = RefMuonAdamW(_muonadamw_groups(refs[:3], refs[3:]))
    _run(ours, params, grads, _warmup)
    _run(ref, refs, grads, _warmup)
    assert_fp32_close(params, refs, start, grads, ref.ties)
    _assert_same_layout(ours, ref)
    assert all(ours.state[p]["step"] == 3 and isinstance(ours.state[p]["step"], int) for p in params[:3])


def test_muonadamw_keeps_bf16_embeddings_in_bf16_with_fp32_math(gen):
    emb = torch.nn.Parameter(torch.randn(16, 8, generator=gen).bfloat16())
    ref = torch.nn.Parameter(emb.detach().clone())
    grads = [[torch.randn(16, 8, generator=gen).bfloat16()] for _ in range(2)]
    ours = nanochat.MuonAdamW([dict(kind="adamw", params=[emb], lr=0.1, betas=(0.8, 0.95), eps=1e-10,
                                    weight_decay=0.1)])
    theirs = RefMuonAdamW([dict(kind="adamw", params=[ref], lr=0.1, betas=(0.8, 0.95), eps=1e-10,
                                weight_decay=0.1)])
    _run(ours, [emb], grads)
    _run(theirs, [ref], grads)
    assert emb.dtype == torch.bfloat16 and ours.state[emb]["exp_avg"].dtype == torch.bfloat16
    assert rel_err(emb.detach().float(), ref.detach().float()) <= 2**-8  # one bf16 rounding


def _assert_same_layout(ours, ref):
    a, b = ours.state_dict(), ref.state_dict()
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert sorted(a["state"]) == sorted(b["state"])
    for index, s in b["state"].items():
        assert sorted(a["state"][index]) == sorted(s)
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                assert a["state"][index][key].shape == value.shape and a["state"][index][key].dtype == value.dtype
            else:
                assert type(a["state"][index][key]) is type(value)
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert sorted(ga) == sorted(gb)


def _build(kind, cls, params, adam_count=3):
    if kind != "muon":
        return cls(_muonadamw_groups(params[:adam_count], params[adam_count:]))
    opt = cls(params, lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.2)
    if isinstance(opt, nanochat.Muon):
        opt._muon.precision = "highest"  # fp32 iteration: the comparison with float64 isolates the state
    return opt


@pytest.mark.parametrize("kind", ["muon", "muonadamw"])
@pytest.mark.parametrize("direction", ["ours_to_nanochat", "nanochat_to_ours"])
def test_checkpoints_cross_and_continue(kind, direction, gen):
    ours_cls = nanochat.Muon if kind == "muon" else nanochat.MuonAdamW
    ref_cls = RefMuon2201 if kind == "muon" else RefMuonAdamW
    first_cls, second_cls = (ours_cls, ref_cls) if direction == "ours_to_nanochat" else (ref_cls, ours_cls)
    shapes = MUON_SHAPES if kind == "muon" else ADAMW_SHAPES + MUON_SHAPES
    params = _params(shapes, gen)
    grads = _grads(params, gen, 3)
    first = _build(kind, first_cls, params)
    _run(first, params, grads[:2])
    saved = copy.deepcopy(first.state_dict())  # as if written to disk
    other = _copies(params)
    second = _build(kind, second_cls, other)
    for group in second.param_groups:
        group["lr"] = 123.0  # the checkpoint's values replace these
    second.load_state_dict(saved)
    start = [p.detach().clone() for p in params]
    _run(first, params, grads[2:])
    _run(second, other, grads[2:])
    reference = first if isinstance(first, ref_cls) else second
    assert_fp32_close(other, params, start, grads[2:], reference.ties)


def _copy_through(how, opt):
    if how == "deepcopy":
        return copy.deepcopy(opt)
    return pickle.loads(pickle.dumps(opt))


def _params_of(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def _assert_bitwise_same_optimizers(a, b):
    pa, pb = _params_of(a), _params_of(b)
    assert len(pa) == len(pb)
    for p, q in zip(pa, pb):
        assert p is not q and torch.equal(p.detach(), q.detach())
        assert (p in a.state) == (q in b.state)
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == sb[key].dtype and torch.equal(value, sb[key]), key
            else:
                assert type(value) is type(sb[key]) and value == sb[key], key
    for ga, gb in zip(a.param_groups, b.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", ["muon", "distmuon", "muonadamw"])
def test_a_copied_optimizer_steps_bit_for_bit_as_the_original(kind, how, gen):
    # torch.optim.Optimizer copies defaults, state and param_groups only: the inner fused
    # optimizers, the Muon recipe (precision set on the instance included) and MuonAdamW's compute
    # dtype must survive copy.deepcopy and pickle, so the copy's next step equals the original's
    import torch.distributed as dist

    own_group = False
    if kind == "distmuon":
        if not dist.is_available() or dist.is_initialized():
            pytest.skip("needs torch.distributed and no process group of its own")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        own_group = True
    try:
        shapes = ADAMW_SHAPES + MUON_SHAPES if kind == "muonadamw" else MUON_SHAPES
        params = _params(shapes, gen)
        grads = _grads(params, gen, 3)
        if kind == "muonadamw":
            opt = nanochat.MuonAdamW(_muonadamw_groups(params[: len(ADAMW_SHAPES)], params[len(ADAMW_SHAPES):]))
        else:
            cls = nanochat.Muon if kind == "muon" else nanochat.DistMuon
            opt = cls(params, lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.2)
        opt._muon.precision = "highest"  # not the class's default: the copy must keep it
        _run(opt, params, grads[:2], _warmup)
        twin = _copy_through(how, opt)
        assert type(twin) is type(opt)
        assert twin._muon.precision == "highest"
        if kind == "muonadamw":
            assert twin.compute_dtype == opt.compute_dtype
        _assert_bitwise_same_optimizers(opt, twin)
        _run(opt, params, grads[2:], _warmup)
        order = [next(i for i, q in enumerate(params) if q is p) for p in _params_of(opt)]
        _run(twin, _params_of(twin), [[grads[2][i] for i in order]], _warmup)
        _assert_bitwise_same_optimizers(opt, twin)
    finally:
        if own_group:
            dist.destroy_process_group()


def test_a_stacked_buffer_of_another_layout_is_refused(gen):
    params = _params(MUON_SHAPES, gen)
    opt = nanochat.Muon(params)
    _run(opt, params, _grads(params, gen, 1))
    saved = copy.deepcopy(opt.state_dict())
    index = saved["param_groups"][-1]["params"][0]  # the (33, 6) group
    saved["state"][index]["second_momentum_buffer"] = saved["state"][index]["second_momentum_buffer"].mT
    before = {k: v.clone() for k, v in opt.state[opt.param_groups[-1]["params"][0]].items()}
    with pytest.raises(ValueError, match=re.escape("'second_momentum_buffer'") + ".*" + re.escape("(1, 1, 33)")):
        opt.load_state_dict(saved)
    for k, v in opt.state[opt.param_groups[-1]["params"][0]].items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("build, match", [
    (lambda ps: nanochat.Muon(ps + [torch.nn.Parameter(torch.randn(4))]), r"params\[8\] has shape \(4,\)"),
    (lambda ps: nanochat.MuonAdamW([dict(kind="sgd", params=ps)]), "kind"),
    (lambda ps: nanochat.MuonAdamW([dict(kind="muon", params=ps, lr=0.02, momentum=0.95, ns_steps=5,
                                         beta2=0.9, weight_decay=0.0)]), "one shape"),
    (lambda ps: nanochat.MuonAdamW([dict(kind="adamw", params=ps, lr=0.02)]), "lacks"),
    (lambda ps: nanochat.DistMuon(ps), "init_process_group"),
    (lambda ps: nanochat.Muon(ps, lr=-0.1), r"\['lr'\]"),
    (lambda ps: nanochat.Muon(ps, momentum=1.0), r"\['momentum'\]"),
    (lambda ps: nanochat.Muon(ps, ns_steps=0), r"\['ns_steps'\]"),
    (lambda ps: nanochat.MuonAdamW([dict(kind="adamw", params=ps[:1], lr=0.01, betas=(0.8, 1.5), eps=1e-10,
                                         weight_decay=0.0)]), r"param_groups\[0\]\['betas'\]"),
    (lambda ps: nanochat.MuonAdamW([dict(kind="muon", params=ps[:1], lr=0.02, momentum=0.95, ns_steps=5,
                                         beta2=2.0, weight_decay=0.0)]), r"param_groups\[0\]\['beta2'\]"),
])
def test_bad_input_is_refused_with_a_clear_error(build, match, gen):
    with pytest.raises((ValueError, RuntimeError), match=match):
        build(_params(MUON_SHAPES, gen))


def test_compute_dtype_follows_nanochat(monkeypatch):
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    assert nanochat.compute_dtype() == torch.bfloat16
    monkeypatch.setenv("NANOCHAT_DTYPE", "fp8")
    with pytest.raises(ValueError, match="NANOCHAT_DTYPE"):
        nanochat.compute_dtype()
    monkeypatch.delenv("NANOCHAT_DTYPE")
    want = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) \
        else torch.float32
    assert nanochat.compute_dtype() == want


def test_muonadamw_with_bf16_matrices_keeps_stacks_in_their_dtype(gen):
    # the fused statistics are fp32: a bf16 stack is stepped through an fp32 copy and written back
    params = _params([(8, 4), (8, 4), (4, 8)], gen, dtype=torch.bfloat16)
    refs = _copies(params)
    start = [p.detach().clone() for p in params]
    grads = _grads(params, gen, 2)
    ours = nanochat.MuonAdamW(_muonadamw_groups([], params))
    theirs = RefMuonAdamW(_muonadamw_groups([], refs))
    _run(ours, params, grads)
    _run(theirs, refs, grads)
    for group, ref_group in zip(ours.param_groups[1:], theirs.param_groups[1:]):
        got = ours.state[group["params"][0]]
        want = theirs.state[ref_group["params"][0]]
        for key in ("momentum_buffer", "second_momentum_buffer"):
            assert got[key].dtype == torch.bfloat16
            # the second moment averages O^2: a bf16 relative error e of O is 2e there
            tol = TOLERANCE["medium"] * (2 if key == "second_momentum_buffer" else 1)
            assert rel_err(got[key].float(), want[key].float()) <= tol, key
    for p, s in zip(params, start):
        # a step of ~2% of a bf16 weight is a few ulps of it, rounded on both sides: the states above
        # carry the comparison; here only that every weight was stepped and stayed bf16
        assert p.dtype == torch.bfloat16 and not torch.equal(p.detach(), s)


@pytest.mark.parametrize("kind", ["muon", "muonadamw"])
def test_init_state_creates_the_layout_a_step_creates(kind, gen):
    shapes = MUON_SHAPES if kind == "muon" else ADAMW_SHAPES + MUON_SHAPES
    params = _params(shapes, gen)
    stepped = _build(kind, nanochat.Muon if kind == "muon" else nanochat.MuonAdamW, params)
    _run(stepped, params, _grads(params, gen, 1))
    fresh = _build(kind, nanochat.Muon if kind == "muon" else nanochat.MuonAdamW, _copies(params))
    fresh.init_state()
    a, b = fresh.state_dict()["state"], stepped.state_dict()["state"]
    assert sorted(a) == sorted(b)
    for index, s in b.items():
        assert sorted(a[index]) == sorted(s)
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                assert a[index][key].shape == value.shape and not a[index][key].any()
            else:
                assert a[index][key] == 0
    fresh.load_state_dict(copy.deepcopy(stepped.state_dict()))  # and a checkpoint loads over it


# ---------------------------------------------------------------- torch.compile(fullgraph=True)

def _compiled_vs_eager(build, params, grads, schedule, init_state=True):
    """Steps a compiled optimizer and an eager one on copies of ``params``; returns the compiled
    params, the eager ones, the starting values, both optimizers and the graph count after each step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    refs = _copies(params)
    start = [p.detach().clone() for p in params]
    ours, eager = build(params), build(refs)
    if init_state:
        ours.init_state()
    step = torch.compile(ours.step, fullgraph=True)
    graphs = []
    for t, step_grads in enumerate(grads):
        for p, r, g in zip(params, refs, step_grads):
            p.grad, r.grad = g.clone(), g.clone()
        schedule(ours, eager, t)
        step()
        eager.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return refs, start, ours, eager, graphs


def _float_schedule(ours, eager, t):
    _warmup(ours, t)
    _warmup(eager, t)


def _tensor_lr_schedule(ours, eager, t):
    # 0-dim tensor lrs updated in place (as torch's schedulers do for tensor lrs); the eager
    # optimizer gets the same values as floats
    for g, e in zip(ours.param_groups, eager.param_groups):
        lr = g.setdefault("initial_lr", float(g["lr"])) * (1.0 - 0.2 * t)
        if not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(lr, dtype=torch.float64)
        g["lr"].fill_(lr)
        e.setdefault("initial_lr", g["initial_lr"])
        e["lr"] = lr


def _assert_same_stacks(ours, eager, tol):
    for group, ref_group in zip(ours.param_groups, eager.param_groups):
        for p, r in zip(group["params"], ref_group["params"]):
            assert (p in ours.state) == (r in eager.state)  # (membership tests add no entries)
            for key, value in eager.state.get(r, {}).items():
                got = ours.state[p][key]
                if isinstance(value, torch.Tensor):
                    assert got.shape == value.shape and got.dtype == value.dtype, key
                    assert rel_err(got.float(), value.float()) <= tol, key
                else:
                    assert type(got) is type(value) and got == value, key


def _assert_float_schedule_graphs(graphs):
    """Graph counts of a compiled step whose schedule writes Python floats every step: dynamo makes
    the floats graph inputs on their first change (one recompile), then never recompiles."""
    assert graphs == [1] + [2] * (len(graphs) - 1), graphs


def _float_lr_schedule(ours, eager, t):
    # nanochat's loop: lr, momentum and weight decay rewritten as Python floats every step
    for opt in (ours, eager):
        for group in opt.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * (1.0 - 0.15 * t)
            if "momentum" in group:
                group["momentum"] = 0.85 + 0.02 * t
                group["weight_decay"] = 0.2 * (1.0 - 0.15 * t)


def test_muonadamw_float_schedule_compiles_twice_with_cold_compile_caches(gen):
    # Cold caches: dynamo's float pass runs. It names float symbols by a hash of their source (two
    # digits) and keeps, for the process, the names of those it could not turn into tensor math
    # (a 0-dim fp64 CPU tensor input is one) as ones to make constants. The fused optimizers'
    # hyper-parameter buffers used to be such inputs; a group's lr that got one of their names
    # became a constant of the graph and every step recompiled ([1, 2, 3, 4, 5]).
    from torch._dynamo.symbolic_convert import TensorifyState

    assert nanochat.compute_dtype() == torch.float32
    params = _params(ADAMW_SHAPES[:1] + MUON_SHAPES, gen)
    with torch._inductor.config.patch(force_disable_caches=True):
        refs, start, ours, eager, graphs = _compiled_vs_eager(
            lambda ps: nanochat.MuonAdamW(_muonadamw_groups(ps[:1], ps[1:])), params, _grads(params, gen, 5),
            _float_lr_schedule)
    # the floats (and AdamW's int step) become graph inputs on their first change, then no recompile
    assert graphs == [1, 2, 2, 2, 2], graphs
    assert not TensorifyState.force_specializations, sorted(TensorifyState.force_specializations)
    assert _delta_err(params, refs, start) <= TOLERANCE["highest"]
    _assert_same_stacks(ours, eager, TOLERANCE["highest"])


def _muon_2201(ps):
    opt = nanochat.Muon(ps, lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.2)
    opt._muon.precision = "highest"  # fp32 iteration: compiled and eager within fp32 rounding
    return opt


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_muon_22a71aa_compiled_step_matches_eager(lr_kind, gen):
    params = _params(MUON_SHAPES, gen)
    schedule = _float_schedule if lr_kind == "float" else _tensor_lr_schedule
    refs, start, ours, eager, graphs = _compiled_vs_eager(_muon_2201, params, _grads(params, gen, 4), schedule)
    if lr_kind == "tensor":
        assert graphs == [1] * 4, graphs
    else:  # nanochat's loop writes floats (lr, momentum, weight decay) every step
        _assert_float_schedule_graphs(graphs)
    assert _delta_err(params, refs, start) <= TOLERANCE["highest"]
    _assert_same_stacks(ours, eager, TOLERANCE["highest"])


@pytest.mark.parametrize("lr_kind, init_state", [("float", True), ("tensor", True), ("float", False)])
def test_muonadamw_compiled_step_matches_eager(lr_kind, init_state, gen):
    assert nanochat.compute_dtype() == torch.float32  # CPU: the fp32 iteration
    params = _params(ADAMW_SHAPES + MUON_SHAPES, gen)
    schedule = _float_schedule if lr_kind == "float" else _tensor_lr_schedule
    refs, start, ours, eager, graphs = _compiled_vs_eager(
        lambda ps: nanochat.MuonAdamW(_muonadamw_groups(ps[:3], ps[3:])), params, _grads(params, gen, 4), schedule,
        init_state=init_state)
    if init_state and lr_kind == "tensor":
        # AdamW's step count is an int in the state (nanochat's layout): dynamo recompiles once when
        # it first changes, then takes it as an input
        assert graphs == [1] + [2] * (len(graphs) - 1), graphs
    elif init_state:
        _assert_float_schedule_graphs(graphs)
    assert _delta_err(params, refs, start, storage_steps=len(graphs)) <= TOLERANCE["highest"]
    _assert_same_stacks(ours, eager, TOLERANCE["highest"])
    _assert_same_layout(ours, eager)
    assert all(ours.state[p]["step"] == 4 for p in params[:3])


def test_compiled_step_follows_params_and_state_replaced_between_steps(gen):
    params = _params(MUON_SHAPES, gen)
    grads = _grads(params, gen, 4)
    refs, start, ours, eager, _ = _compiled_vs_eager(_muon_2201, params, grads[:1], _float_schedule)
    step = torch.compile(ours.step, fullgraph=True)
    # a parameter swapped into a group (same shape): the traced step regroups the fused optimizers
    gi = next(i for i, g in enumerate(ours.param_groups) if len(g["params"]) > 1)
    new = torch.nn.Parameter(torch.randn(ours.param_groups[gi]["params"][1].shape, generator=gen))
    new_ref = torch.nn.Parameter(new.detach().clone())
    ours.param_groups[gi]["params"][1] = new
    eager.param_groups[gi]["params"][1] = new_ref
    params = [p for g in ours.param_groups for p in g["params"]]
    refs = [p for g in eager.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in params]
    grads = _grads(params, gen, 3)

    def run(t):
        for p, r, g in zip(params, refs, grads[t]):
            p.grad, r.grad = g.clone(), g.clone()
        step()
        eager.step()

    run(0)
    assert not torch.equal(new.detach(), next(s for p, s in zip(params, start) if p is new))
    # a checkpoint loaded between compiled steps replaces the stacks: the step follows the new ones
    ours.load_state_dict(copy.deepcopy(eager.state_dict()))
    for p, r in zip(params, refs):
        p.data.copy_(r.detach())
    start = [p.detach().clone() for p in params]
    run(1)
    run(2)
    assert _delta_err(params, refs, start) <= TOLERANCE["highest"]
    _assert_same_stacks(ours, eager, TOLERANCE["highest"])


def test_a_new_ns_steps_inside_a_compiled_step_asks_for_init_state(gen):
    params = _params(MUON_SHAPES, gen)
    _, _, ours, eager, _ = _compiled_vs_eager(_muon_2201, params, _grads(params, gen, 1), _float_schedule)
    step = torch.compile(ours.step, fullgraph=True)
    for opt in (ours, eager):
        opt.param_groups[0]["ns_steps"] = 3  # a value no fused optimizer was built for
    params = [p for g in ours.param_groups for p in g["params"]]
    refs = [p for g in eager.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in params]
    for p, r, g in zip(params, refs, _grads(params, gen, 1)[0]):
        p.grad, r.grad = g.clone(), g.clone()
    with pytest.raises(Exception, match="init_state"):
        step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)  # refused before anything changed
    ours.init_state()  # outside the compiled region: builds the optimizer for ns_steps=3
    # regrouped fused optimizers hold other per-parameter scales at the same attribute paths, which
    # dynamo's automatic dynamic would turn into symbolic floats the fused ops refuse: compile anew
    torch._dynamo.reset()
    step = torch.compile(ours.step, fullgraph=True)
    step()
    eager.step()
    assert _delta_err(params, refs, before) <= TOLERANCE["highest"]


def test_muonadamw_compiled_with_bf16_matrices_keeps_stacks_in_their_dtype(gen):
    # the fp32 copy of a bf16 second-moment stack is a buffer of the compiled step, written back
    params = _params([(8, 4), (8, 4), (4, 8)], gen, dtype=torch.bfloat16)
    refs, start, ours, eager, graphs = _compiled_vs_eager(
        lambda ps: nanochat.MuonAdamW(_muonadamw_groups([], ps)), params, _grads(params, gen, 3), _float_schedule)
    _assert_float_schedule_graphs(graphs)
    for group in ours.param_groups[1:]:
        assert all(v.dtype == torch.bfloat16 for v in ours.state[group["params"][0]].values())
    _assert_same_stacks(ours, eager, TOLERANCE["medium"])
    for p, r in zip(params, refs):
        assert rel_err(p.detach().float(), r.detach().float()) <= 2**-8  # one bf16 rounding


def test_distmuon_on_one_rank_compiled_step_matches_eager(gen):
    # DistMuon constructs only with a process group; on one rank it takes Muon's single-process step
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def build(ps):
            opt = nanochat.DistMuon(ps, lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.2)
            opt._muon.precision = "highest"
            return opt

        params = _params(MUON_SHAPES, gen)
        refs, start, ours, eager, graphs = _compiled_vs_eager(build, params, _grads(params, gen, 4), _float_schedule)
        _assert_float_schedule_graphs(graphs)
        assert _delta_err(params, refs, start) <= TOLERANCE["highest"]
        _assert_same_stacks(ours, eager, TOLERANCE["highest"])
        _assert_same_layout(ours, eager)
    finally:
        dist.destroy_process_group()
