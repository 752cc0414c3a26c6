"""Weights split along their input side, read by the trace (megatron_eopt.param_use).

The param-group keys split a matrix's output rows only (``split_shapes``). A weight whose consumers
slice its columns (``W[:, :k]`` with one input, ``W[:, k:]`` with another; the rows of an (in, out)
weight) cannot be described by them: it must be named in a warning and routed whole by its shape,
never read as a split of its rows. A product whose input is a concatenation multiplies one matrix
by the whole input (``W @ [a; b]``): one matrix, its columns whole, its output split where the
output is."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_eopt import route_parameters
from megatron_eopt.param_use import trace_parameter_uses

NO_NAMES = dict(embedding_patterns=(), head_patterns=())
OUT, K = 6, 4  # w is (OUT, 2K) as nn.Linear stores it; v (2K, OUT), multiplied as x @ v


class InputSides(nn.Module):
    """Two inputs a, b of K features each meet w (or v) in the way ``mode`` says; a last product
    (``back``) gives the output, so that w and v are hidden matrices."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.w = nn.Parameter(torch.randn(OUT, 2 * K) / 3)
        self.v = nn.Parameter(torch.randn(2 * K, OUT) / 3)
        glu = mode == "concatenated_input_split_output"  # its hidden output: the gate/up product, OUT / 2
        self.back = nn.Parameter(torch.randn(OUT, OUT // 2 if glu else OUT) / 3)

    def hidden(self, a, b):
        w, v, mode = self.w, self.v, self.mode
        if mode == "column_slices":
            return F.linear(a, w[:, :K]) + F.linear(b, w[:, K:])
        if mode == "column_split":
            left, right = w.split(K, dim=1)
            return F.linear(a, left) + F.linear(b, right)
        if mode == "column_narrow_mm":
            return a @ w.narrow(1, 0, K).t() + b @ w.narrow(1, K, K).t()
        if mode == "in_out_row_slices":  # an (in, out) weight: its rows are its input side
            return a @ v[:K] + b @ v[K:]
        if mode == "column_strided":
            return F.linear(a, w[:, ::2]) + F.linear(b, w[:, 1::2])
        if mode == "column_halves_viewed":
            left, right = w.view(OUT, 2, K).unbind(1)
            return F.linear(a, left) + F.linear(b, right)
        if mode == "one_column_slice":
            return F.linear(a, w[:, :K])
        if mode == "concatenated_input":
            return F.linear(torch.cat([a, b], -1), w)
        if mode == "concatenated_input_split_output":
            gate, up = F.linear(torch.cat([a, b], -1), w).chunk(2, -1)
            return F.silu(gate) * up
        raise AssertionError(mode)

    def forward(self, a, b):
        return F.linear(F.gelu(self.hidden(a, b)), self.back)


INPUTS = (torch.randn(2, 3, K), torch.randn(2, 3, K))


def _route(mode):
    model = InputSides(mode)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table, _ = route_parameters(model, example_inputs=INPUTS, **NO_NAMES)
    return model, table, [str(w.message) for w in seen]


@pytest.mark.parametrize("mode", ["column_slices", "column_split", "column_narrow_mm", "in_out_row_slices"])
def test_columns_multiplied_apart_are_named_and_routed_whole(mode):
    name = "v" if mode == "in_out_row_slices" else "w"
    model, table, seen = _route(mode)
    use = trace_parameter_uses(model, INPUTS)[name]
    assert use.kind == "unknown" and "input side" in use.seen, use
    route = table[name]
    assert route.optimizer == "muon" and route.source == "shape"
    assert "split_shapes" not in dict(route.group_keys)  # one matrix, never its rows in parts
    assert route.view == ("6x8" if name == "w" else "8x6"), route.view
    assert any(f"{name}: multiplied in slices [(0, {K}), ({K}, {K})]" in m and "input side" in m for m in seen), seen


def test_strided_columns_are_named_and_routed_whole():
    _, table, seen = _route("column_strided")
    assert table["w"].optimizer == "muon" and "split_shapes" not in dict(table["w"].group_keys)
    assert any("w: used by a strided slice" in m for m in seen), seen


def test_one_column_slice_is_named():
    _, table, seen = _route("one_column_slice")
    assert "split_shapes" not in dict(table["w"].group_keys)
    assert any(f"w: multiplied in slices [(0, {K})] of its dim 1" in m for m in seen), seen


def test_column_halves_viewed_apart_go_to_adamw_named():
    # w.view(out, 2, k).unbind(1): matrices stacked along their input dim, as DBRX's w2 experts
    _, table, seen = _route("column_halves_viewed")
    assert table["w"].optimizer == "adamw" and "input dim" in table["w"].reason
    assert any("w: matrices stacked along their input dim" in m and "given to AdamW" in m for m in seen), seen


def test_a_product_of_a_concatenation_is_one_matrix():
    _, table, seen = _route("concatenated_input")
    route = table["w"]
    assert route.optimizer == "muon" and route.source == "use" and route.view == "6x8"
    assert "split_shapes" not in dict(route.group_keys) and dict(route.group_keys).get("matrix_layout",
                                                                                         "out_in") == "out_in"
    assert not [m for m in seen if "'w" in m or "w:" in m], seen


def test_a_product_of_a_concatenation_split_along_its_output_splits_rows_only():
    _, table, seen = _route("concatenated_input_split_output")
    route = table["w"]
    assert route.optimizer == "muon" and route.source == "use"
    assert tuple(dict(route.group_keys)["split_shapes"]) == (OUT // 2, OUT // 2)  # rows in parts, columns whole
    assert "fused gate/up" in route.reason
    assert not [m for m in seen if "w:" in m], seen
