"""Our Muon as the inner optimizer of Megatron-LM's FsdpMuon (Megatron-FSDP v2), and install()'s
answer to Megatron-FSDP v2's own Muon path."""

import importlib
import os
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp

import megatron_cpu
import megatron_fsdp_v2_worker


def _has_megatron_fsdp_v2():
    try:
        import typing

        if not hasattr(typing, "override"):
            import typing_extensions

            typing.override = typing_extensions.override
        from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.distributed
@pytest.mark.skipif(not _has_megatron_fsdp_v2(), reason="megatron-core without Megatron-FSDP v2 (experimental)")
def test_muon_as_fsdp_muon_inner_optimizer_on_megatron_fsdp_v2_shards(tmp_path, gen):
    # 2 gloo ranks, megatron-core's own v2 fully_shard (all-Flat placements, shards cut through a
    # matrix's rows): driven as FsdpMuon drives its inner optimizer, 3 steps equal our Muon on the
    # whole matrices within 1e-6, orthogonalize given the parameter or None.
    seed = gen.initial_seed() % (2**31)
    mp.spawn(megatron_fsdp_v2_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous"), seed), nprocs=2,
             join=True)


FAKE_FSDP_MUON = '''
class FsdpMuon:
    """Stands for Megatron-LM's FsdpMuon (PR #6425): keeps its inner optimizer."""

    def __init__(self, params, inner_optimizer, dp_mesh=None):
        self.inner = inner_optimizer
        self.num_ns_steps = inner_optimizer.num_ns_steps
'''


@pytest.fixture
def fake_megatron_fsdp(tmp_path, monkeypatch):
    """A package laid out like Megatron-FSDP with a module defining FsdpMuon, among the ones install() scans."""
    from megatron_eopt.integrations import megatron_fsdp_v2

    root = tmp_path / "fake_mfsdp"
    (root / "experimental").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "experimental" / "__init__.py").write_text("")
    (root / "experimental" / "other.py").write_text("raise ImportError('never imported: no FsdpMuon here')\n")
    (root / "experimental" / "orthogonal.py").write_text(FAKE_FSDP_MUON)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(megatron_fsdp_v2, "FSDP_PACKAGES", ("fake_mfsdp",))
    yield importlib.import_module("fake_mfsdp.experimental.orthogonal").FsdpMuon
    for name in [n for n in sys.modules if n.startswith("fake_mfsdp")]:
        del sys.modules[name]


def test_install_makes_fsdp_muon_refuse_an_inner_muon_that_is_not_ours(fake_megatron_fsdp):
    from megatron_eopt.integrations import megatron as integration
    from megatron_eopt.optim import Muon

    if megatron_cpu.megatron_optimizer_module() is None:
        pytest.skip("megatron-core is not installed")
    params = [torch.nn.Parameter(torch.randn(6, 4))]
    stock = types.SimpleNamespace(num_ns_steps=5)  # any inner optimizer that is not ours
    integration.uninstall()
    assert fake_megatron_fsdp(params, inner_optimizer=stock).inner is stock  # before install(): untouched
    try:
        integration.install()
        with pytest.raises(ValueError, match=r"inner_optimizer=megatron_eopt\.optim\.Muon"):
            fake_megatron_fsdp(params, inner_optimizer=stock)
        ours = Muon(params, lr=0.02, num_ns_steps=7)
        assert fake_megatron_fsdp(params, inner_optimizer=ours).num_ns_steps == 7
        integration.install(["adaptive_muon"])  # a second install() does not wrap twice
        with pytest.raises(ValueError, match="uninstall"):
            fake_megatron_fsdp(params, stock)
    finally:
        integration.uninstall()
    assert fake_megatron_fsdp(params, inner_optimizer=stock).inner is stock


def test_megatron_core_0_19_has_no_fsdp_muon_to_guard():
    from megatron_eopt.integrations import megatron_fsdp_v2

    if megatron_cpu.megatron_optimizer_module() is None:
        pytest.skip("megatron-core is not installed")
    # the scan finds the classes of megatron-core's Megatron-FSDP (v1's module, v2's DBuffer)
    assert megatron_fsdp_v2._module_names_defining("megatron.core.distributed.fsdp.src.megatron_fsdp", "MegatronFSDP")
    assert megatron_fsdp_v2._module_names_defining("megatron.core.distributed.fsdp.src.megatron_fsdp", "DBuffer")
    names = megatron_fsdp_v2._module_names_defining("megatron.core.distributed.fsdp.src.megatron_fsdp", "FsdpMuon")
    assert names == [] or all(hasattr(importlib.import_module(n), "FsdpMuon") for n in names)
