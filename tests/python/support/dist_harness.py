"""The distributed test workers' process groups, and their launch as separate processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist


# The CPU products every test rank runs (megatron_eopt.set_cpu_symmetric_products /
# set_cpu_bf16_products): one full ATen GEMM for the symmetric products, fp32 GEMMs of the bf16 values
# for "medium" (both portable). A test that compares the ranks' results closely with a reference of
# its own process computes it under computing_as_the_ranks().
RANK_CPU_PRODUCTS = dict(symmetric="full", bf16="fp32")


@contextlib.contextmanager
def computing_as_the_ranks():
    """The ranks' CPU products (RANK_CPU_PRODUCTS) and their one torch thread in this process for the
    block; the measured choices and the thread count are back on the way out."""
    import megatron_eopt

    threads = torch.get_num_threads()
    megatron_eopt.set_cpu_symmetric_products(RANK_CPU_PRODUCTS["symmetric"])
    megatron_eopt.set_cpu_bf16_products(RANK_CPU_PRODUCTS["bf16"])
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        megatron_eopt.set_cpu_symmetric_products("auto")
        megatron_eopt.set_cpu_bf16_products("auto")


def _same_cpu_products_on_every_rank():
    """Pins the CPU products to RANK_CPU_PRODUCTS. Each process times its own CPU paths
    (docs/newton-schulz.md), so two ranks of one machine, loaded differently, can take different ones,
    whose results differ by summation order: an owner rank's Newton–Schulz would then differ from the
    same matrix's on another rank by rounding, and the comparisons of sharded against whole steps
    would test the measurement, not the sharding (docs/limits.md)."""
    import megatron_eopt

    megatron_eopt.set_cpu_symmetric_products(RANK_CPU_PRODUCTS["symmetric"])
    megatron_eopt.set_cpu_bf16_products(RANK_CPU_PRODUCTS["bf16"])


@contextlib.contextmanager
def gloo_world(rank, world_size, init_file):
    """A gloo process group over ``init_file`` for this rank, one torch thread, fp32 matmuls in
    full precision ("highest") and the same CPU products on every rank; the group is destroyed on
    the way out."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("highest")
        _same_cpu_products_on_every_rank()
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def counted_collectives(names):
    """Counts the calls of the named ``torch.distributed`` collectives made inside the block: yields
    ``{name: count}``; the originals are back in place on the way out."""
    calls = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def init_from_argv():
    """For a worker started as ``worker.py RANK WORLD PORT SEED OUT CASE``: joins the gloo group at
    127.0.0.1:PORT with one torch thread and the same CPU products on every rank, and returns
    ``(rank, world, seed, out, case)``."""
    rank, world, port, seed, out, case = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                          sys.argv[5], sys.argv[6])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    _same_cpu_products_on_every_rank()
    return rank, world, seed, out, case


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script, tmp_path, world, seed, case, timeout):
    """Runs ``script`` (a file beside this one) as ``world`` processes on a free port, each as
    ``script RANK WORLD PORT SEED OUT CASE`` (see :func:`init_from_argv`); returns what each rank
    saved to its OUT, in rank order."""
    import megatron_eopt

    here = os.path.dirname(os.path.abspath(__file__))
    port = str(_free_port())
    root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_eopt.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, here, env.get("PYTHONPATH", "")])
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.join(here, script), str(r), str(world), port, str(seed),
                               str(outs[r]), case], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return [torch.load(o) for o in outs]
