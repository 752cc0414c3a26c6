"""The whole optimizer step under torch.compile(fullgraph=True) and in a CUDA graph."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelMuon
from optim_helpers import clone_params, make_grads, make_params, max_delta_err, run_steps
from reference import TOLERANCE

SHAPES = [(8, 12), (12, 8), (8, 12), (1, 5)]
CASES = {
    "muon": lambda ps, lr: Muon(ps, lr=lr, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest"),
    "normuon": lambda ps, lr: AdaptiveMuon(ps, lr, 0.9, 0.1, moment2_method="normuon", fp32_matmul_prec="highest"),
    "tp_muon_qkv": lambda ps, lr: TensorParallelMuon(
        ps,
        lr=lr,
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
        ("tp_muon_qkv", "tensor", "cpu"),
        pytest.param("muon", "tensor", "cuda", marks=pytest.mark.gpu),
        pytest.param("normuon", "float", "cuda", marks=pytest.mark.gpu),
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


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["muon", "normuon"])
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


@pytest.mark.gpu
def test_python_float_lr_during_cuda_graph_capture_is_refused(gen):
    # A captured graph would replay the lr of capture time forever: refuse it with a clear error.
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES, gen, scale=0.1)]
    opt = CASES["muon"](params, 0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # warm-up outside capture (plans, state)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="lr'\\] is a Python number while a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            opt.step()
