"""Ranks that differ get one clear error on every rank (docs/sharded.md "Ranks that differ"): a table
of cases, each making one rank of a mesh differ from the others in one thing that changes a
collective or a result (rank_mismatch_worker), with ``rank_checks="every_step"`` and, for the cases a
step decides, ``"riding"``. Every rank must raise the same ValueError, naming
the field and each rank's value, within seconds (the workers' collectives time out after 20 s, so
a hang fails the test rather than stalling the suite), with its parameters and state unchanged."""

import re

import pytest

from dist_harness import run_workers

EVERY_RANK = "every rank raises this"
# case -> what the error must name
CASES = {
    "extra_param": r"param_groups\[0\]\['params'\]\[3\]: \(absent\) on rank\(s\) \[0, 2\]; \(6, 4\) torch.float32",
    "extra_group": r"param_groups\[1\]",
    "block_period": r"differ in block_period: 2 on rank\(s\) \[0\]; None on rank\(s\) \[1, 2\]",
    "moment2_method": r"differ in moment2_method: 'adamuon' on rank\(s\) \[0\]; 'normuon' on rank\(s\) \[1, 2\]",
    "replica_work": r"differ in replica_work: 'split' on rank\(s\) \[0\]; 'auto' on rank\(s\) \[1, 2\]",
    "overlap_backward": r"differ in overlap_backward: True on rank\(s\) \[0\]; False on rank\(s\) \[1, 2\]",
    "num_ns_steps": r"differ in num_ns_steps: 6 on rank\(s\) \[0\]; 5 on rank\(s\) \[1, 2\]",
    "precision": r"differ in fp32_matmul_prec: 'medium' on rank\(s\) \[0\]; 'highest' on rank\(s\) \[1, 2\]",
    "coefficient_type": r"differ in coefficient_type: 'polar_express' on rank\(s\) \[0\]; 'quintic' on rank\(s\) \[1, 2\]",
    "bf16_params": r"params'\]\[0\]: .*float32.* on rank\(s\) \[0, 1\]; .*bfloat16.* on rank\(s\) \[2\]",
    "swapped_named": r"params'\]\[0\]: 'q' .* on rank\(s\) \[0, 2\]; 'k' .* on rank\(s\) \[1\]",
    "grad_missing": r"params'\]\[1\]: .*grad torch.float32 on rank\(s\) \[0, 1\]; .*no grad on rank\(s\) \[2\]",
    "grad_missing_overlap": r"params'\]\[1\]: .*no grad on rank\(s\) \[2\]",
    "refused_on_one_rank": r"weight_decay.*refused on rank\(s\) \[0\]",
    "lr_scheduled_on_one_rank": r"differ in param_groups\[0\]\['lr'\]: 0.02 on rank\(s\) \[0, 2\]; 0.01 on rank\(s\) \[1\]",
    "lr_tensor": r"differ in param_groups\[0\]\['lr'\]: 0.0099.* on rank\(s\) \[0\]; 0.0199.* on rank\(s\) \[1, 2\]",
    "nesterov_written": r"differ in nesterov: False on rank\(s\) \[0, 1\]; True on rank\(s\) \[2\]",
    "extra_scale_factor_written": r"differ in extra_scale_factor: 1.0 on rank\(s\) \[0, 1\]; 0.5 on rank\(s\) \[2\]",
    "loaded_other_checkpoint": r"differ in param_groups\[0\]\['momentum'\]: 0.9 on rank\(s\) \[0, 2\]; 0.5 on rank\(s\) \[1\]",
    "alike": None,
    "tensor_parallel_option": r"differ in num_ns_steps: 5 on rank\(s\) \[0, 2\]; 6 on rank\(s\) \[1\]",
    "tensor_parallel_grad_missing": r"params'\]\[0\]: .*no grad on rank\(s\) \[0\]; .*grad torch.float32 on rank\(s\) \[1, 2\]",
    "workspace_mib_on_one_rank": r"differ in workspace_mib: 0.0005 on rank\(s\) \[0\]; 'auto' on rank\(s\) \[1, 2\]",
    "sharded_mode_on_one_rank": r"differ in sharded_mode: 'owner' on rank\(s\) \[0, 2\]; 'gather' on rank\(s\) \[1\]",
    "rank_checks_on_one_rank":
        r"differ in rank_checks: '(every_step|riding)' on rank\(s\) \[0, 1\]; 'construction' on rank\(s\) \[2\]",
    "params_replaced_on_one_rank": r"differ in param_groups\[0\]\['params'\]\[0\]",
}
# The cases decided at a step, with rank_checks="riding": the second step rides its first exchange
# (the tensor-parallel case cannot ride, and agrees as "every_step" does).
RIDING_CASES = {f"riding:{case}": CASES[case] for case in (
    "grad_missing", "refused_on_one_rank", "lr_scheduled_on_one_rank", "lr_tensor", "nesterov_written",
    "extra_scale_factor_written", "loaded_other_checkpoint", "alike", "tensor_parallel_grad_missing",
    "workspace_mib_on_one_rank", "sharded_mode_on_one_rank", "rank_checks_on_one_rank")}
RIDING_CASES["riding:params_replaced_on_one_rank"] = (
    r"differ in step plan rebuilt: no on rank\(s\) \[0, 2\]; yes on rank\(s\) \[1\]")
CANNOT_RIDE = ("riding:tensor_parallel_grad_missing",)  # (and the HSDP cases: a 2-D mesh agrees by all-reduce)
HSDP_CASES = {
    "hsdp_replica_work": r"differ in replica_work: 'repeat' on rank\(s\) \[0\]; 'auto' on rank\(s\) \[1, 2, 3, 4, 5\]",
    "hsdp_grad_missing": r"params'\]\[1\]: .*no grad on rank\(s\) \[2\]",
    "hsdp_alike": None,
}
HSDP_CASES.update({f"riding:{case}": HSDP_CASES[case] for case in ("hsdp_grad_missing", "hsdp_alike")})


def _check(records, cases):
    failures = []
    for case, pattern in cases.items():
        got = [r.get(case) for r in records]
        if any(g is None for g in got):
            failures.append(f"{case}: not run on every rank (an earlier case hung or aborted)")
            continue
        errors = [g["error"] for g in got]
        if pattern is None:
            if any(e is not None for e in errors):
                failures.append(f"{case}: ranks alike raised {errors}")
            continue
        if any(e is None for e in errors):
            failures.append(f"{case}: not every rank raised: {errors}")
            continue
        if len(set(errors)) != 1:
            failures.append(f"{case}: the ranks raised different errors: {errors}")
            continue
        kind, message = errors[0]
        if kind != "ValueError" or EVERY_RANK not in message or not re.search(pattern, message):
            failures.append(f"{case}: {kind}: {message}\n  expected /{pattern}/\n{got[0].get('traceback', '')}")
        if not all(g["unchanged"] for g in got):
            failures.append(f"{case}: parameters or state changed on rank(s) "
                            f"{[r for r, g in enumerate(got) if not g['unchanged']]}")
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_ranks_that_differ_raise_alike_on_three_ranks(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    records = run_workers("rank_mismatch_worker.py", tmp_path, 3, seed, ",".join(CASES), timeout=600)
    _check(records, CASES)


@pytest.mark.distributed
def test_ranks_that_differ_raise_alike_when_riding(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    records = run_workers("rank_mismatch_worker.py", tmp_path, 3, seed, ",".join(RIDING_CASES), timeout=600)
    _check(records, RIDING_CASES)
    # the step that differs rides its first exchange (a ticket held on every rank), where it can
    held = {case: [bool(r[case]["ticket"]) for r in records] for case in RIDING_CASES}
    assert {c: t for c, t in held.items() if t != [c not in CANNOT_RIDE] * 3} == {}


@pytest.mark.distributed
def test_ranks_that_differ_raise_alike_on_hsdp(tmp_path, gen):
    seed = gen.initial_seed() % (2**31)
    records = run_workers("rank_mismatch_worker.py", tmp_path, 6, seed, ",".join(HSDP_CASES), timeout=600)
    _check(records, HSDP_CASES)
