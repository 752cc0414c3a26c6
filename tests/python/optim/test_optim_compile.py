"""The whole optimizer step under torch.compile(fullgraph=True) and in a CUDA graph."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelAdaptiveMuon, TensorParallelMuon
from optim_helpers import clone_params, make_grads, make_params, max_delta_err, run_steps
from reference import TOLERANCE

SHAPES = [(8, 12), (12, 8), (8, 12), (1, 5)]
CASES = {
    "muon": lambda ps, lr: Muon(ps, lr=lr, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest"),
    "normuon": lambda ps, lr: AdaptiveMuon(ps, lr, 0.9, 0.1, moment2_method="normuon", fp32_matmul_prec="highest"),
    # one matrix per chunk: the NS inputs are views of one flat buffer reused by every chunk
    "muon_chunked": lambda ps, lr: Muon(ps, lr=lr, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest",
                                        workspace_mib=1e-9),
    # the 2026 recipe: cautious decay, MuonEq, Muon+, ||X|| + eps with a divisor, nanochat's normuon
    "recipe": lambda ps, lr: AdaptiveMuon(ps, lr, 0.9, 0.1, moment2_method="normuon", eps=1e-10,
                                          weight_decay_method="cautious", row_equilibration=True,
                                          frobenius_renorm=True, ns_eps_mode="add", ns_norm_divisor=1.01,
                                          fp32_matmul_prec="highest"),
    # model-routing views: a Conv1D-like fused QKV split along columns, a Conv1D-like plain weight
    "muon_views": lambda ps, lr: Muon([{"params": ps[:1], "matrix_layout": "in_out", "split_shapes": [2, 1, 1]},
                                       {"params": ps[1:2], "matrix_layout": "in_out"}, {"params": ps[2:]}],
                                      lr=lr, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest"),
    "tp_muon_qkv": lambda ps, lr: TensorParallelMuon(
        ps,
        lr=lr,
        split_qkv=True,
        is_qkv_fn=lambda p: p.shape[0] == 12,
        qkv_split_shapes=[2, 1, 1],
        fp32_matmul_prec="highest",
    ),
    "tp_adaptive_muon_qkv": lambda ps, lr: TensorParallelAdaptiveMuon(
        ps,
        lr=lr,
        momentum=0.9,
        weight_decay=0.1,
        moment2_method="adamuon",
        split_qkv=True,
        is_qkv_fn=lambda p: p.shape[0] == 12,
        qkv_split_shapes=[2, 1, 1],
        fp32_matmul_prec="highest",
    ),
}


@pytest.mark.parametrize(
    "case,lr_kind,device",
    [
        ("muon", "tensor", "cpu"),
        ("muon", "float", "cpu"),
        ("normuon", "tensor", "cpu"),
        ("recipe", "tensor", "cpu"),
        ("muon_views", "tensor", "cpu"),
        ("tp_muon_qkv", "tensor", "cpu"),
        ("tp_adaptive_muon_qkv", "tensor", "cpu"),
        pytest.param("muon", "tensor", "cuda", marks=pytest.mark.gpu),
        pytest.param("normuon", "float", "cuda", marks=pytest.mark.gpu),
        pytest.param("recipe", "tensor", "cuda", marks=pytest.mark.gpu),
        pytest.param("muon_chunked", "tensor", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_compiled_step_matches_eager_without_recompiling_on_lr_change(case, lr_kind, device, gen):
    torch._dynamo.reset()
    counters.clear()
    params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(SHAPES, gen, scale=0.1)]
    eager_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    lr0 = torch.tensor(0.02, device=device) if lr_kind == "tensor" else 0.02
    opt = CASES[case](params, lr0)
    eager = CASES[case](eager_params, 0.02)
    opt.init_state()
    step = torch.compile(opt.step, fullgraph=True)
    lrs = [0.02, 0.015, 0.01, 0.005, 0.0025]
    graphs = []
    for t, grads in enumerate(make_grads(params, gen, len(lrs))):
        grads = [g.to(device) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if lr_kind == "tensor":
            opt.param_groups[0]["lr"].fill_(lrs[t])  # in place, as LRScheduler does for tensor lrs
        else:
            opt.param_groups[0]["lr"] = lrs[t]
        step()
        graphs.append(counters["stats"]["unique_graphs"])
        run_steps(eager, eager_params, [grads], lrs=[lrs[t]])
    if lr_kind == "tensor":
        assert graphs == [1] * len(lrs), graphs
    else:
        # A Python float is a constant of the first graph; dynamo turns it into a graph input on
        # its first change (one recompile) and never recompiles for it again.
        assert graphs[-1] == graphs[1] <= 2, graphs
    assert max_delta_err(params, eager_params, start) <= TOLERANCE["highest"]


def _float_specializations():
    """The float symbols torch.compile has decided to make constants in this process (None where
    this torch keeps no such record)."""
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        return None
    return sorted(TensorifyState.force_specializations)


def test_a_float_lr_per_group_changed_every_step_compiles_twice(gen):
    # One group per layer, each with its own Python-float lr that a schedule rewrites every step,
    # stepped from a training-step function compiled with cold caches (where dynamo's float pass
    # runs). The float symbols of a graph are named by a hash of their source (two digits), and
    # torch.compile keeps, for the process, the names of the float symbols it could not turn into
    # tensor math as ones to make constants: a 0-dim fp64 CPU tensor input is such a symbol. The
    # optimizer's per-group hyper-parameter buffers used to be such inputs; here group 4's lr got
    # one of their names, became a constant of the graph and every step recompiled.
    torch._dynamo.reset()
    counters.clear()
    shapes = [(8, 12), (12, 8), (5, 7), (1, 5), (12, 12)]
    params = make_params(shapes, gen, scale=0.1)
    eager_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    base = [0.01 * (i + 1) for i in range(len(params))]

    def build(ps):
        return Muon([{"params": [p], "lr": lr} for p, lr in zip(ps, base)], lr=0.02, weight_decay=0.1,
                    fp32_matmul_prec="highest")

    opt, eager = build(params), build(eager_params)
    opt.init_state()

    def train_step():
        opt.step()

    step = torch.compile(train_step, fullgraph=True)
    graphs = []
    with torch._inductor.config.patch(force_disable_caches=True):
        for t, grads in enumerate(make_grads(params, gen, 5)):
            for o, ps in ((opt, params), (eager, eager_params)):
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                for group, lr in zip(o.param_groups, base):
                    group["lr"] = lr * (1.0 - 0.15 * t)
            step()
            eager.step()
            graphs.append(counters["stats"]["unique_graphs"])
    # the lrs are constants of the first graph and inputs of the second, which every later step runs
    assert graphs == [1, 2, 2, 2, 2], graphs
    assert _float_specializations() in (None, []), _float_specializations()
    assert max_delta_err(params, eager_params, start) <= TOLERANCE["highest"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["muon", "normuon", "muon_chunked"])
def test_cuda_graph_capture_of_the_step(case, gen):
    # lr lives in a device tensor the graph reads at replay; state exists before capture.
    shapes = [(64, 96), (96, 64), (64, 96), (1, 33)]
    params = [p.cuda() for p in make_params(shapes, gen, scale=0.1)]
    params = [torch.nn.Parameter(p) for p in params]
    eager_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    lr = torch.tensor(0.02, device="cuda")
    opt = CASES[case](params, lr)
    eager = CASES[case](eager_params, 0.02)
    grads = [[g.cuda() for g in step] for step in make_grads(params, gen, 4)]
    static_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static_grads):
        p.grad = g
    opt.init_state()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (lazy allocations, kernel selection)
        saved = (
            [p.detach().clone() for p in params],
            {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params},
        )
        opt.step()
        for p, v in zip(params, saved[0]):
            p.data.copy_(v)
        for p in params:
            for k, v in saved[1][p].items():
                opt.state[p][k].copy_(v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    lrs = [0.02, 0.01, 0.005, 0.001]
    for t, step_grads in enumerate(grads):
        for s, g in zip(static_grads, step_grads):
            s.copy_(g)
        lr.fill_(lrs[t])
        graph.replay()
        run_steps(eager, eager_params, [step_grads], lrs=[lrs[t]])
    torch.cuda.synchronize()
    assert max_delta_err(params, eager_params, start) <= TOLERANCE["highest"]


def _assert_capture_refused(opt):
    """Capturing opt.step() raises the clear host-lr error (after a warm-up outside capture)."""
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="lr'\\] is a Python number while a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            opt.step()


@pytest.mark.gpu
def test_python_float_lr_during_cuda_graph_capture_is_refused(gen):
    # A captured graph would replay the lr of capture time forever: refuse it with a clear error.
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES, gen, scale=0.1)]
    opt = CASES["muon"](params, 0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # warm-up outside capture (plans, state)
    _assert_capture_refused(opt)


@pytest.mark.gpu
def test_cpu_tensor_lr_is_refused_during_capture_and_never_synchronizes(gen):
    # A CPU tensor lr is a host value: read on the host (no pageable copy, which would synchronize
    # with the device on every step) and, like a Python number, refused during capture.
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES, gen, scale=0.1)]
    ref_params = clone_params(params)
    lr = torch.tensor(0.02)  # float32: the reference gets the same value
    opt = CASES["muon"](params, lr)
    ref = CASES["muon"](ref_params, float(lr))
    for p, r in zip(params, ref_params):
        p.grad = torch.randn(p.shape, generator=gen).cuda()
        r.grad = p.grad.clone()
    opt.step()  # warm-up: plans and state
    ref.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref.step()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    _assert_capture_refused(opt)


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_gradscaler_step_with_fp16_params_and_an_overflow(gen):
    # scaler.step + scaler.update captured once and replayed: a replay whose gradients hold an inf
    # leaves params and momentum untouched and halves the scale, the others step as eager does.
    shapes = [(64, 96), (96, 64), (1, 33)]
    params = [torch.nn.Parameter(p.detach().cuda().half()) for p in make_params(shapes, gen, scale=0.1)]
    eager_params = clone_params(params)
    lr = torch.tensor(0.02, device="cuda")
    opt = CASES["muon"](params, lr)
    eager = CASES["muon"](eager_params, 0.02)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1000)
    eager_scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1000)
    for s in (scaler, eager_scaler):
        s.scale(torch.ones((), device="cuda"))  # creates the scale tensor (a loss would be scaled here)
    static_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static_grads):
        p.grad = g
    steps = [[(torch.randn(p.shape, generator=gen) * 1024.0).cuda().half() for p in params] for _ in range(4)]
    steps[2][0][3, 5] = float("inf")  # the overflow step
    # Warm-up outside capture on a side stream, then restore params, state and scaler.
    opt.init_state()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        saved_p = [p.detach().clone() for p in params]
        saved_s = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
        for s, g in zip(static_grads, steps[0]):
            s.copy_(g)
        scaler.step(opt)
        scaler.update()
        for p, v in zip(params, saved_p):
            p.data.copy_(v)
        for p in params:
            for k, v in saved_s[p].items():
                opt.state[p][k].copy_(v)
        scaler._scale.fill_(1024.0)
        scaler._growth_tracker.zero_()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scaler.step(opt)
        scaler.update()
    for t, grads in enumerate(steps):
        before = [p.detach().clone() for p in params]
        state_before = [opt.state[p]["momentum_buffer"].clone() for p in params]
        for s, g in zip(static_grads, grads):
            s.copy_(g)
        graph.replay()
        for p, g in zip(eager_params, grads):
            p.grad = g.clone()
        eager_scaler.step(eager)
        eager_scaler.update()
        torch.cuda.synchronize()
        assert float(scaler._scale) == float(eager_scaler._scale)
        if t == 2:
            assert float(scaler._scale) == 512.0
            for p, b, s_b in zip(params, before, state_before):
                assert torch.equal(p, b) and torch.equal(opt.state[p]["momentum_buffer"], s_b)
        for p, r in zip(params, eager_params):
            assert torch.isfinite(p).all()
            assert torch.equal(p, r), f"step {t}"


def test_host_values_reach_a_device_buffer_by_a_fill_not_a_host_copy():
    # A Python number or CPU tensor is read on the host and filled in; a copy_ from pageable host
    # memory would synchronize with the device on every step. (A meta buffer stands in for a GPU.)
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_eopt.optim.step.fused import _host_value, _write_scalar

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    buf = torch.empty((), dtype=torch.float64, device="meta")
    for value in (0.5, torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64)):
        with Ops() as ops:
            _write_scalar(buf, value)
        assert "fill_" in ops.names and "copy_" not in ops.names, ops.names
    with Ops() as ops:
        _write_scalar(buf, torch.tensor(0.5, device="meta"))  # a device tensor: copied on the device
    assert "copy_" in ops.names
    cpu_buf = torch.empty((), dtype=torch.float64)
    _write_scalar(cpu_buf, torch.tensor(0.25))
    assert float(cpu_buf) == 0.25
    assert _host_value(3) == 3.0 and _host_value(torch.tensor(0.5)) == 0.5
    assert _host_value(torch.tensor(0.5, device="meta")) is None
