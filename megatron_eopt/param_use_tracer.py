"""The dispatch mode behind :func:`megatron_eopt.param_use.trace_parameter_uses`: it follows every
tensor derived from a parameter (views, transposes, reshapes, dtype copies, indexing, slices) back to
it, as a map from the tensor's dims to factors of the parameter's dims, and records the products,
splits, lookups and elementwise uses each parameter meets (what they mean: :mod:`megatron_eopt.param_use`).
"""

from __future__ import annotations

import re
import weakref
from typing import Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# the records the mode keeps (param_use_records); ParamUse and ParameterUses are re-exported
from .param_use_records import ParameterUses, ParamUse, _Derived, _Lookup, _ParamRecord, _ProductUse, _reshape, _Root

__all__ = ["ParamUse", "ParameterUses"]

aten = torch.ops.aten

_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.view_copy}
_SAME = {aten.clone, aten._to_copy, aten.detach, aten.alias, aten.lift_fresh, aten.contiguous,
         aten._conj, aten.to, aten.type_as}
_PRODUCTS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm, aten.mv, aten.addmv, aten.linear}
_TOPK = {aten.topk, aten.argmax, aten.sort, aten.argsort}
# max / min over one dim give the index of the largest entry as well: a top-1 where the dim is a
# product's output features (Phi-MoE's sparsemixer), a pooling where it is not
_ARGMAX_DIM = {aten.max, aten.min}
_LOSS = {aten._log_softmax, aten.nll_loss_forward, aten.nll_loss, aten.nll_loss2d_forward,
         aten.cross_entropy_loss, aten.binary_cross_entropy_with_logits}
_SOFTMAX = {aten._softmax, aten.softmax}
_LOOKUPS = {aten.embedding, aten._embedding_bag, aten.embedding_bag, aten._embedding_bag_forward_only,
            aten.index_select}
# Ops that multiply a weight in ways the trace does not read (convolutions, fused attention, ...).
_PRODUCT_LIKE = re.compile(r"conv|mm|matmul|linear|attention|einsum|tensordot|lstm|gru|rnn|dot", re.I)
_IGNORED = {aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size,
            aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.new_empty, aten.new_zeros,
            aten.new_ones, aten.new_full, aten._local_scalar_dense, aten.copy_, aten.detach_}


class _Tracer(TorchDispatchMode):
    def __init__(self, params: Mapping[int, tuple[str, torch.Tensor]]):
        super().__init__()
        self.records: dict[int, _ParamRecord] = {}
        self.derived: dict[int, tuple[weakref.ref, _Derived]] = {}
        for key, (name, t) in params.items():
            root = _Root(tuple(t.shape), name)
            self.records[key] = _ParamRecord(name, root)
            self._track(t, _Derived(root, [((d, 1, s),) if s != 1 else () for d, s in enumerate(t.shape)]))
        self.root_record = {id(r.root): r for r in self.records.values()}
        self.unreadable = False  # a meta index the split depends on

    # -- bookkeeping
    def _track(self, t, derived: _Derived) -> None:
        if isinstance(t, torch.Tensor):
            self.derived[id(t)] = (weakref.ref(t), derived)

    def _get(self, t) -> _Derived | None:
        if not isinstance(t, torch.Tensor):
            return None
        entry = self.derived.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def _record(self, d: _Derived) -> _ParamRecord | None:
        return self.root_record.get(id(d.root))

    def _like(self, d: _Derived, dims, **changes) -> _Derived:
        fields = dict(root=d.root, dims=list(dims), removed=d.removed, lookup=d.lookup, pieces=d.pieces,
                      partial=d.partial)
        fields.update(changes)
        return _Derived(**fields)

    # -- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is aten._grouped_mm and args[0].device.type == "meta" and \
                args[0].dtype == torch.float32:  # the meta kernel takes bf16 / fp16 only; the shape is plain
            a, b = args[0], args[1]
            rows = a.shape[:-1] if a.dim() == 3 or b.dim() == 2 else a.shape[:1]
            if b.dim() == 2:
                rows = (args[2].shape[0], *a.shape[:-1]) if len(args) > 2 and args[2] is not None else rows
            out = torch.empty((*rows, b.shape[-1]), dtype=a.dtype, device="meta")
        else:
            out = func(*args, **kwargs)
        try:
            self._observe(func, args, kwargs, out)
        except Exception as exc:  # an op the bookkeeping mis-reads: said, never fatal to the forward
            for a in tree_flatten((args, kwargs))[0]:
                d = self._get(a)
                if d is not None and (rec := self._record(d)) is not None:
                    rec.lost.add(f"{func.overloadpacket.__name__} ({type(exc).__name__}: {exc})")
        return out

    def _observe(self, func, args, kwargs, out) -> None:
        flat = tree_flatten((args, kwargs))[0]
        tracked = [(i, a, d) for i, a in enumerate(flat) if (d := self._get(a)) is not None]  # (position, t, how)
        if not tracked:
            return
        packet = func.overloadpacket
        if packet in _IGNORED:
            return
        first = self._get(args[0]) if args else None
        if packet in _PRODUCTS:
            return self._product(packet, args, out)
        if first is not None and self._structural(packet, args, kwargs, first, out):
            return
        if packet in (aten.cat, aten.stack):
            return self._concat(packet, args, kwargs, out)
        if packet in _LOOKUPS:
            d = self._get(args[0])
            if d is not None and (rec := self._record(d)) is not None:
                rec.lookups.append(_Lookup(packet.__name__))
            return
        if packet is aten.index and first is not None:
            return self._index(args, first, out)
        if packet in _ARGMAX_DIM and first is not None and self._record(first) is None and len(args) > 1 \
                and isinstance(args[1], int):
            atoms = first.dims[args[1] % max(args[0].dim(), 1)]
            if any(a[0] == first.root.out_dim for a in atoms):
                first.root.router = True
            return
        if packet in _TOPK or packet in _LOSS:
            for _, _, d in tracked:
                if self._record(d) is None:
                    if packet in _TOPK:
                        d.root.router = True
                    else:
                        d.root.loss = True
            return
        if packet in _SOFTMAX and first is not None and self._record(first) is None:
            self._track(out, self._like(first, first.dims))
            return
        if torch.Tag.pointwise in func.tags:
            return self._pointwise(packet, flat, tracked, out)
        if packet is aten.convolution and self._depthwise(args, out):
            return
        results = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        for _, a, d in tracked:
            if (rec := self._record(d)) is not None:
                if any(o.numel() >= a.numel() > 1 for o in results):  # a rearranged copy, maybe multiplied later
                    rec.lost.add(f"{packet.__name__} (not followed)")
                else:  # a reduction, a comparison, ...
                    rec.other.add(packet.__name__)

    def _structural(self, packet, args, kwargs, d: _Derived, out) -> bool:
        """Views, transposes, copies, selects and slices of a tracked tensor; True when handled."""
        x = args[0]
        dims = d.dims
        if packet in _SAME:
            self._track(out, self._like(d, dims))
        elif packet in _VIEWS:
            new = _reshape(dims, tuple(x.shape), tuple(args[1]))
            if new is None:
                self._lost(d, f"{packet.__name__} to {tuple(args[1])}")
            else:
                self._track(out, self._like(d, new))
        elif packet is aten.t:
            self._track(out, self._like(d, dims[::-1]))
        elif packet is aten.transpose:
            a, b = (int(i) % max(x.dim(), 1) for i in args[1:3])
            new = list(dims)
            new[a], new[b] = new[b], new[a]
            self._track(out, self._like(d, new))
        elif packet is aten.permute:
            self._track(out, self._like(d, [dims[int(i) % x.dim()] for i in args[1]]))
        elif packet is aten.unsqueeze:
            new = list(dims)
            new.insert(int(args[1]) % (x.dim() + 1), ())
            self._track(out, self._like(d, new))
        elif packet is aten.squeeze:
            drop = set(range(x.dim())) if len(args) < 2 else {int(i) % x.dim() for i in
                                                               (args[1] if isinstance(args[1], (list, tuple))
                                                                else [args[1]])}
            self._track(out, self._like(d, [a for i, a in enumerate(dims) if i not in drop or x.shape[i] != 1]))
        elif packet is aten.expand:
            sizes = list(args[1])
            lead = len(sizes) - x.dim()
            new = [((-1, 0, int(s)),) if int(s) > 1 else () for s in sizes[:lead]]
            for i, s in enumerate(sizes[lead:]):
                new.append(((-1, 0, int(s)),) if x.shape[i] == 1 and int(s) > 1 else dims[i])  # -1: kept
            self._track(out, self._like(d, new))
        elif packet is aten.select:
            dim, index = int(args[1]) % x.dim(), int(args[2]) % x.shape[int(args[1])]
            self._take(d, dim, [(index, 1)], [out], drop=True)
        elif packet is aten.unbind:
            dim = int(args[1]) % x.dim() if len(args) > 1 else 0
            self._take(d, dim, [(i, 1) for i in range(x.shape[dim])], list(out), drop=True)
        elif packet is aten.slice:
            dim = int(args[1]) % x.dim() if len(args) > 1 else 0
            n = x.shape[dim]
            start = 0 if len(args) < 3 or args[2] is None else int(args[2])
            end = n if len(args) < 4 or args[3] is None else int(args[3])
            step = 1 if len(args) < 5 else int(args[4])
            start, end = (start + n if start < 0 else start), (end + n if end < 0 else end)
            start, end = max(0, min(start, n)), max(0, min(end, n))
            if start == 0 and end == n and step == 1:
                self._track(out, self._like(d, dims))
            elif step == 1:
                self._take(d, dim, [(start, end - start)], [out])
            else:
                self._strided(d, dim, start, end, step, out)
        elif packet in (aten.split, aten.split_with_sizes, aten.chunk, aten.tensor_split):
            dim = int(args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.dim()
            lengths = [int(p.shape[dim]) for p in out]
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            self._take(d, dim, list(zip(starts, lengths)), list(out))
        elif packet is aten.narrow:
            dim, start, length = int(args[1]) % x.dim(), int(args[2]), int(args[3])
            self._take(d, dim, [(start % x.shape[dim], length)], [out])
        else:
            return False
        return True

    def _depthwise(self, args, out) -> bool:
        """A depthwise convolution (one filter per channel: Mamba's and Qwen3-Next's conv1d) is
        elementwise across channels: its weight is not a matrix, and a product's output keeps its
        features through it. True when handled."""
        x, weight, groups = args[0], args[1], int(args[8])
        if weight.dim() < 2 or weight.shape[1] != 1 or groups != weight.shape[0] or x.dim() < 2 \
                or x.shape[1] != groups or not isinstance(out, torch.Tensor) or out.shape[1] != groups:
            return False
        w = self._get(weight)
        if w is not None and (rec := self._record(w)) is not None:
            rec.elementwise.add("convolution (depthwise)")
        for extra in args[2:3]:
            b = self._get(extra)
            if b is not None and (rec := self._record(b)) is not None:
                rec.elementwise.add("convolution (bias)")
        d = self._get(x)
        if d is not None and self._record(d) is None:
            self._track(out, self._like(d, d.dims[:2] + [((-1, 0, int(s)),) if s > 1 else () for s in out.shape[2:]]))
        return True

    def _lost(self, d: _Derived, what: str) -> None:
        if (rec := self._record(d)) is not None:
            rec.lost.add(what)

    def _take(self, d: _Derived, dim: int, pieces, outs, drop: bool = False) -> None:
        """Pieces (start, length) of dim ``dim``: a select / unbind (``drop``) or slices / a split."""
        atoms = d.dims[dim]
        rec = self._record(d)
        if rec is not None:  # a parameter: indexed away (one matrix per index) or sliced
            for (start, length), o in zip(pieces, outs):
                if drop:
                    self._track(o, self._like(d, d.dims[:dim] + d.dims[dim + 1:], removed=d.removed + atoms))
                elif len(atoms) == 1:
                    self._track(o, self._like(d, d.dims, partial=d.partial + ((atoms[0], start, length),)))
                else:
                    self._lost(d, "a slice across merged dims")
            return
        new_dims = d.dims[:dim] + d.dims[dim + 1:] if drop else d.dims
        if not drop and self._refine(d, dim, pieces, outs):
            return
        if d.pieces or len(atoms) != 1 or atoms[0][0] != d.root.out_dim:
            for (_, length), o in zip(pieces, outs):  # not along the output features, or a piece of a piece
                if not drop:
                    new_dims = d.dims[:dim] + [((-1, 0, length),) if length != 1 else ()] + d.dims[dim + 1:]
                self._track(o, self._like(d, new_dims))
            return
        atom = atoms[0]
        seen = d.root.pieces.setdefault(atom, set())
        for (start, length), o in zip(pieces, outs):
            seen.add((start, length))
            if not drop:
                new_dims = d.dims[:dim] + [((atom[0], atom[1], length),)] + d.dims[dim + 1:]
            self._track(o, self._like(d, new_dims, pieces=frozenset({(atom, start)})))

    def _refine(self, d: _Derived, dim: int, pieces, outs) -> bool:
        """One piece of a split, whole along its features, split again into parts that cover it
        (Mamba2's xBC, split into x, B and C after its convolution): the parts become pieces of the
        first split. True when handled; a later concatenation of all the parts undoes it."""
        if len(d.pieces) != 1 or len(pieces) < 2 or len(d.dims[dim]) != 1:
            return False
        ((atom, s0),) = tuple(d.pieces)
        seen = d.root.pieces.get(atom, set())
        length = next((n for start, n in seen if start == s0), None)
        if length is None or d.dims[dim][0] != (atom[0], atom[1], length) or pieces[0][0] != 0 \
                or sum(n for _, n in pieces) != length:
            return False
        seen.discard((s0, length))
        for (start, n), o in zip(pieces, outs):
            seen.add((s0 + start, n))
            d.root.parents[(atom, s0 + start)] = (s0, length)
            new_dims = d.dims[:dim] + [((atom[0], atom[1], n),) if n != 1 else ()] + d.dims[dim + 1:]
            self._track(o, self._like(d, new_dims, pieces=frozenset({(atom, s0 + start)})))
        return True

    def _unrefine(self, root: _Root, union: frozenset) -> frozenset:
        """All the parts of a refined piece together again (rotary halves of a one-head piece): the piece."""
        for atom in {a for a, _ in union}:
            starts = {start for a, start in union if a == atom}
            parents = {root.parents.get((atom, start)) for start in starts}
            if len(parents) != 1 or None in parents:
                continue
            parent = parents.pop()
            children = {start for (a, start), p in root.parents.items() if a == atom and p == parent}
            if starts != children:
                continue
            seen = root.pieces.get(atom, set())
            for start, n in list(seen):
                if start in children:
                    seen.discard((start, n))
                    del root.parents[(atom, start)]
            seen.add(parent)
            union = frozenset(p for p in union if p[0] != atom or p[1] not in children) | {(atom, parent[0])}
        return union

    def _strided(self, d: _Derived, dim: int, start: int, end: int, step: int, out) -> None:
        """x[..., start::step]: x.view(..., n // step, step)[..., start]."""
        atoms = d.dims[dim]
        count = len(range(start, end, step))
        if self._record(d) is not None or len(atoms) != 1 or atoms[0][2] % step or start >= step \
                or count != atoms[0][2] // step:
            return self._lost(d, "a strided slice")
        r, s, size = atoms[0]
        outer, inner = (r, s * step, size // step), (r, s, step)
        new = d.dims[:dim] + [(outer,)] + d.dims[dim + 1:]
        if d.pieces or r != d.root.out_dim:
            return self._track(out, self._like(d, new))
        d.root.pieces.setdefault(inner, set()).add((start, 1))
        self._track(out, self._like(d, new, pieces=frozenset({(inner, start)})))

    def _index(self, args, d: _Derived, out) -> None:
        x, indices = args[0], list(args[1])
        used = [(k, t) for k, t in enumerate(indices) if t is not None]
        rec = self._record(d)
        if len(used) != 1 or used[0][1].dtype == torch.bool:
            if rec is not None:
                rec.lookups.append(_Lookup("index"))
            return
        k, index = used[0]
        if rec is not None:
            lookup = _Lookup("index by an integer tensor")
            rec.lookups.append(lookup)
            new = d.dims[:k] + [((-1, 0, int(s)),) if int(s) > 1 else () for s in index.shape] + d.dims[k + 1:]
            self._track(out, self._like(d, new, removed=d.removed + d.dims[k], lookup=lookup))
            return
        # indexing a product's output along its features by a constant index (Falcon's qkv[..., [-2]])
        if index.dim() != 1 or index.numel() == 0:
            return
        if index.device.type == "meta":  # values unknown on meta: only a run on real tensors tells
            if not d.pieces and len(d.dims[k]) == 1 and d.dims[k][0][0] == d.root.out_dim:
                self.unreadable = True
            return
        values = [int(v) % x.shape[k] for v in index.tolist()]
        if values == list(range(values[0], values[0] + len(values))):
            self._take(d, k, [(values[0], len(values))], [out])

    def _product(self, packet, args, out) -> None:
        if packet in (aten.addmm, aten.baddbmm, aten.addmv):
            a, b = args[1], args[2]
            added = self._get(args[0])  # the term added to the product (RecurrentGemma's 2-D gate biases)
            if added is not None and (rec := self._record(added)) is not None:
                rec.elementwise.add(f"{packet.__name__} (added)")
        elif packet is aten.linear:  # where a backend keeps F.linear whole: x @ W.T
            a, b = args[0], args[1]
            d = self._get(b)
            if d is None or self._record(d) is None or self._get(a) is not None and self._record(self._get(a)):
                return
            rec = self._record(d)
            roles = {atom: role for atoms, role in zip(d.dims, ("out", "in")) for atom in atoms if atom[0] >= 0}
            roles.update({atom: "batch" for atom in d.removed if atom[0] >= 0})
            if d.lookup is not None:
                d.lookup.reached_product = True
            product = _Root(tuple(out.shape), rec.name, out.dim() - 1)
            rec.products.append(_ProductUse(roles, product, d.partial))
            self._track(out, _Derived(product, [((i, 1, s),) if s != 1 else () for i, s in enumerate(out.shape)]))
            return
        else:
            a, b = args[0], args[1]
        da, db = self._get(a), self._get(b)
        pa = da if da is not None and self._record(da) is not None else None
        pb = db if db is not None and self._record(db) is not None else None
        if pa is not None and pb is not None:
            for d in (pa, pb):
                self._lost(d, "a product of two parameters")
            return
        if pa is None and pb is None:
            return
        batched = packet in (aten.bmm, aten.baddbmm)
        if pb is not None:  # x @ W: W's first dim (of its matrix) is contracted
            d, operand = pb, b
            if packet is aten._grouped_mm:
                if operand.dim() != 3:
                    return self._lost(d, "_grouped_mm with a 2-D weight")
                roles = ("batch", "in", "out")
            else:
                roles = ("batch", "in", "out") if batched else ("in", "out")
            out_dim = out.dim() - 1
        else:  # W @ x
            d, operand = pa, a
            if packet is aten._grouped_mm:
                return self._lost(d, "_grouped_mm with the weight first")
            roles = ("batch", "out", "in") if batched else ("out", "in")
            out_dim = out.dim() - 2 if packet not in (aten.mv, aten.addmv) else 0
        rec = self._record(d)
        found: dict = {}
        for atoms, role in zip(d.dims, roles):
            for atom in atoms:
                if atom[0] >= 0:
                    found[atom] = role
        for atom in d.removed:
            if atom[0] >= 0:
                found[atom] = "batch"
        if d.lookup is not None:
            d.lookup.reached_product = True
        product = _Root(tuple(out.shape), rec.name, out_dim)
        rec.products.append(_ProductUse(found, product, d.partial))
        self._track(out, _Derived(product, [((i, 1, s),) if s != 1 else () for i, s in enumerate(out.shape)]))

    def _concat(self, packet, args, kwargs, out) -> None:
        """Pieces of one split concatenated back (rotary halves): not a fused projection. A piece
        concatenated with parts of itself (``rotate_half``) stays that piece. The outputs of one
        weight's products concatenated along another dim than their features (per-expert outputs
        put back in token order) are followed as one output."""
        tensors = args[0]
        ds = [self._get(t) for t in tensors]
        for d in ds:
            if d is not None and self._record(d) is not None:  # weights concatenated before their use
                self._lost(d, "cat / stack with other tensors")
        if not tensors or not isinstance(out, torch.Tensor):
            return
        dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
        size = int(out.shape[dim])
        new_dim = ((-1, 0, size),) if size > 1 else ()

        def dims_of(d: _Derived) -> list:
            if packet is aten.stack:
                return d.dims[:dim] + [new_dim] + d.dims[dim:]
            return d.dims[:dim] + [new_dim] + d.dims[dim + 1:]

        carried = [d for d in ds if d is not None and d.pieces]
        if not carried:
            products = [d for d in ds if d is not None and self._record(d) is None]
            if len(products) != len(ds) or len({d.root.param for d in products}) != 1:
                return
            first = products[0]
            if any(a[0] == first.root.out_dim for a in (first.dims[dim] if packet is aten.cat else ())):
                return  # outputs joined along their features: not one output
            root = first.root.resolved()
            for d in products[1:]:
                if d.root.resolved() is not root:
                    d.root.resolved().same_as = root
            self._track(out, self._like(first, dims_of(first), root=root))
            return
        roots = {id(d.root) for d in carried}
        union = frozenset().union(*(d.pieces for d in carried))
        if len(roots) == 1:
            union = self._unrefine(carried[0].root, union)
        for d in carried:
            for atom, _ in d.pieces:
                starts = {start for a, start in union if a == atom}
                # re-joined: every piece of the split back in one tensor (rotary halves); some of
                # them only (Qwen3-Next's q, k, v without z, through one convolution) stay apart
                if len(starts) > 1 and starts == {start for start, _ in d.root.pieces.get(atom, ())}:
                    d.root.rejoined.add(atom)
        if len(roots) == 1 and len(carried) == len(ds):
            self._track(out, self._like(carried[0], dims_of(carried[0]), pieces=union))

    def _pointwise(self, packet, flat, tracked, out) -> None:
        if not isinstance(out, torch.Tensor):
            return
        full = [(a, d) for _, a, d in tracked if tuple(a.shape) == tuple(out.shape)]
        for _, a, d in tracked:
            if (rec := self._record(d)) is not None:
                rec.elementwise.add(packet.__name__)
        carried = [d for _, d in full if d.pieces]
        if carried:
            # parts of one split that meet (act(gate) * up; rotary's x1 * cos - x2 * sin) are
            # followed together: a later concatenation tells rotary halves from gate and up
            union = frozenset().union(*(d.pieces for d in carried))
            for d in carried:
                for atom, _ in d.pieces:
                    if len({start for a, start in union if a == atom}) > 1:
                        d.root.glu.add(atom)
            if len({id(d.root) for d in carried}) == 1 and len(carried) == len(full) and not any(
                    isinstance(o, torch.Tensor) and o.numel() >= out.numel() and self._get(o) is None for o in flat):
                self._track(out, self._like(carried[0], carried[0].dims, pieces=union))
            return
        if len(full) > 1:
            # a sum of products' outputs (a projection plus its low-rank adapter, Zamba2's
            # gate_up_proj): one output, whose later split is each product's
            products = [d for _, d in full if self._record(d) is None]
            if packet in (aten.add, aten.sub) and len(products) == len(full) == len(tracked) and \
                    len({d.root.out_dim for d in products}) == 1 and \
                    all(d.dims == products[0].dims and not d.removed for d in products):
                root = products[0].root.resolved()
                for d in products[1:]:
                    if d.root.resolved() is not root:
                        d.root.resolved().same_as = root
                self._track(out, self._like(products[0], products[0].dims, root=root))
        if len(full) != 1:
            return
        a, d = full[0]
        # followed through a bias, a scale or an activation; not through a sum with another
        # full-size tensor (a residual)
        if any(isinstance(o, torch.Tensor) and o is not a and o.numel() >= out.numel() for o in flat):
            return
        self._track(out, self._like(d, d.dims))

    def outputs(self, result) -> None:
        """The tensors the model returned: products among them are output heads."""
        if isinstance(result, Mapping):
            leaves = list(result.values())
        elif isinstance(result, (tuple, list)):
            leaves = list(result)
        else:
            leaves = [result]
        for leaf in tree_flatten(leaves)[0]:
            d = self._get(leaf)
            if d is not None and self._record(d) is None:
                d.root.loss = True
