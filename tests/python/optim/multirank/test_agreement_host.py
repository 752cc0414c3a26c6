"""The host side of the ranks' agreement (multirank.agreement): the fields a step compares and their
digest, and where the agreement's integers are reduced (stand-in groups in one process; gloo ranks,
and NCCL ranks with and without a CPU backend: agreement_device_worker.py)."""

import types

import pytest
import torch

from dist_harness import run_workers
from megatron_eopt.optim import Muon
from megatron_eopt.optim.multirank import agreement


def _bf16_grad(p):
    p.grad_dtype = None  # (torch >= 2.10 refuses a gradient of another dtype unless told)
    p.grad = p.grad.to(torch.bfloat16)


def _optimizer():
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 4), (6, 4), (5, 7)]]
    groups = [{"params": params[:2], "param_names": ["q", "k"]}, {"params": params[2:], "param_names": ["o"], "lr": 0.01}]
    opt = Muon(groups, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt, params


def _step_fields(opt):
    plan = opt._current_plan()
    active = [e.param.grad is not None for e in plan.entries]
    return opt._agreement_fields(active, plan)


def test_step_fields_name_each_parameter_its_dtype_and_grad():
    opt, params = _optimizer()
    fields = dict(_step_fields(opt))
    assert fields["param_groups[0]['params'][0]"] == "'q' (6, 4) torch.float32, grad torch.float32"
    assert fields["param_groups[0]['params'][1]"] == "'k' (6, 4) torch.float32, grad torch.float32"
    assert fields["param_groups[1]['params'][0]"] == "'o' (5, 7) torch.float32, grad torch.float32"
    assert fields["param_groups[1]['lr']"] == "0.01"
    params[1].grad = None
    _bf16_grad(params[2])
    fields = dict(_step_fields(opt))
    assert fields["param_groups[0]['params'][1]"] == "'k' (6, 4) torch.float32, no grad"
    assert fields["param_groups[1]['params'][0]"] == "'o' (5, 7) torch.float32, grad torch.bfloat16"
    # Outside a step (construction, add_param_group) no grad is compared.
    assert dict(opt._agreement_fields())["param_groups[0]['params'][1]"] == "'k' (6, 4) torch.float32"


@pytest.mark.parametrize("change", ["same", "grad_missing", "grad_dtype", "lr", "option", "swapped_names"])
def test_step_digest_differs_exactly_when_a_field_does(change):
    opt, params = _optimizer()
    before = _step_fields(opt)
    if change == "grad_missing":
        params[0].grad = None
    elif change == "grad_dtype":
        _bf16_grad(params[0])
    elif change == "lr":
        opt.param_groups[0]["lr"] = 0.019
    elif change == "option":
        opt.workspace_mib = 1
    elif change == "swapped_names":
        opt.param_groups[0]["param_names"] = ["k", "q"]
        opt._rebuild_plan()
    after = _step_fields(opt)
    assert (before == after) == (change == "same")
    digest = agreement.digest_value
    assert (digest(agreement.fields_bytes(before)) == digest(agreement.fields_bytes(after))) == (change == "same")


def test_fields_bytes_keep_names_and_values_apart():
    bytes_of = agreement.fields_bytes
    assert bytes_of([("a", "bc")]) != bytes_of([("ab", "c")])
    assert bytes_of([("a", "b"), ("c", "d")]) != bytes_of([("a", "b"), ("c", "e")])
    assert bytes_of([("a", "b")]) != bytes_of([("a", "b"), ("c", "d")])


class _Mesh:
    """A mesh of ``configs`` (one group per dim, each dim of two ranks), on ``device_type``."""

    def __init__(self, device_type, configs):
        self.device_type, self.ndim, self._configs = device_type, len(configs), configs

    def size(self, dim=None):
        return 2

    def get_group(self, dim=0):
        return types.SimpleNamespace(config=self._configs[dim])


@pytest.mark.parametrize("configs, where", [
    (["cuda:nccl,cpu:gloo"], "cpu"),
    (["cpu:gloo,cuda:gloo", "cuda:nccl,cpu:gloo"], "cpu"),
    (["cuda:nccl"], "cuda"),
    (["cuda:nccl,cpu:gloo", "cuda:nccl"], "cuda"),  # one dim without a host backend: all on the device
])
def test_agreement_reduces_on_the_host_where_every_group_can(monkeypatch, configs, where):
    monkeypatch.setattr(agreement.dist, "get_backend_config", lambda group: group.config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert agreement._device(_Mesh("cuda", configs)).type == where
    assert agreement._device(_Mesh("cpu", configs)).type == "cpu"


def _check_ranks(records, where):
    """Every agreement of every rank reduced on ``where``; the first step agreed, the second (rank
    1's lr written alone) raised the same error on both ranks, naming the field, state unchanged."""
    for rank, record in enumerate(records):
        assert record["places"] and set(record["places"]) == {where}, (rank, record["places"])
        first, second = record["errors"]
        assert first is None, first
        assert second is not None and "param_groups[0]['lr']" in second and agreement.EVERY_RANK in second, second
        assert record["unchanged"], rank
    assert records[0]["errors"] == records[1]["errors"]


@pytest.mark.distributed
def test_a_cpu_mesh_agrees_on_the_host(tmp_path, gen):
    records = run_workers("agreement_device_worker.py", tmp_path, 2, gen.initial_seed() % 2**31, "cpu", timeout=300)
    _check_ranks(records, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL ranks)")
@pytest.mark.parametrize("setup, where", [("nccl", "cuda"), ("gloo+nccl", "cpu")])
def test_a_cuda_mesh_agrees_on_the_host_where_its_groups_can(tmp_path, gen, setup, where):
    records = run_workers("agreement_device_worker.py", tmp_path, 2, gen.initial_seed() % 2**31, setup, timeout=300)
    _check_ranks(records, where)
