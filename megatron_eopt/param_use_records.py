"""The records :mod:`megatron_eopt.param_use_tracer` keeps while it follows a forward: the dims of
each tensor derived from a parameter as atoms of the parameter's dims, the products and lookups each
parameter meets, and what :func:`megatron_eopt.param_use.trace_parameter_uses` returns
(:class:`ParamUse`, :class:`ParameterUses`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .model_views import MatrixView

__all__ = ["ParamUse", "ParameterUses"]

# An atom: (root dim, stride, size): ``size`` consecutive indices of the root's dim ``root dim``,
# ``stride`` apart. A tensor derived from a root maps each of its dims to atoms, outer to inner.
# Root dim -1: not from the root (a broadcast or a new dim).
Atom = tuple[int, int, int]


def _normalize(atoms) -> tuple[Atom, ...]:
    """Size-1 atoms dropped, consecutive atoms of one root dim that tile merged."""
    out: list[Atom] = []
    for a in atoms:
        if a[2] == 1:
            continue
        if out and out[-1][0] == a[0] and a[0] >= 0 and out[-1][1] == a[1] * a[2]:
            d, _, n = out.pop()
            out.append((d, a[1], n * a[2]))
        else:
            out.append(a)
    return tuple(out)


def _reshape(dims, shape, new_shape) -> list[tuple[Atom, ...]] | None:
    """The atoms of a view of a tensor of ``shape`` (dims ``dims``) as ``new_shape``; None when an
    atom would have to split unevenly."""
    new_shape = list(new_shape)
    if -1 in new_shape:
        known = 1
        for s in new_shape:
            known *= s if s != -1 else 1
        total = 1
        for s in shape:
            total *= s
        new_shape[new_shape.index(-1)] = total // known if known else 0
    queue = [a for d in dims for a in d if a[2] != 1]
    out = []
    for size in new_shape:
        need, atoms = int(size), []
        while need > 1:
            if not queue:
                return None
            d, s, n = queue[0]
            if n <= need:
                if need % n:
                    return None
                atoms.append(queue.pop(0))
                need //= n
            else:
                if n % need:
                    return None
                atoms.append((d, s * (n // need), need))
                queue[0] = (d, s, n // need)
                need = 1
        out.append(_normalize(atoms))
    return out if not queue else None


class _Lookup:
    """A parameter indexed by an integer tensor: a lookup table unless the rows reach a product."""

    def __init__(self, what: str):
        self.what = what
        self.reached_product = False


@dataclass
class _Root:
    """A parameter, or the output of a product with one."""

    shape: tuple[int, ...]
    param: str = ""  # the parameter (of a product: the one multiplied)
    out_dim: int = -1  # a product's output-feature dim
    router: bool = False
    loss: bool = False
    # pieces: {(atom, piece key)}; per atom the (start, length) pieces seen, and their fate
    pieces: dict = field(default_factory=dict)
    rejoined: set = field(default_factory=set)
    parents: dict = field(default_factory=dict)  # {(atom, start)}: the piece a refined part came from
    glu: set = field(default_factory=set)
    same_as: "_Root | None" = None  # one output with another product's (concatenated with it)

    def resolved(self) -> "_Root":
        root = self
        while root.same_as is not None:
            root = root.same_as
        return root


@dataclass
class _Derived:
    root: _Root
    dims: list
    removed: tuple = ()  # atoms indexed away: one matrix per index
    lookup: _Lookup | None = None
    pieces: frozenset = frozenset()  # {(atom, start)}: the product-output pieces this tensor comes from
    partial: tuple = ()  # (atom, start, length) slices of a parameter


@dataclass
class _ProductUse:
    roles: dict  # {atom of the param: "out" | "in" | "batch"}
    product: _Root
    partial: tuple


@dataclass
class _ParamRecord:
    name: str
    root: _Root
    products: list = field(default_factory=list)
    lookups: list = field(default_factory=list)
    elementwise: set = field(default_factory=set)
    other: set = field(default_factory=set)  # other ops that read it (reductions, ...)
    lost: set = field(default_factory=set)  # what the trace could not follow


@dataclass(frozen=True)
class ParamUse:
    """What the traced forward did with one parameter.

    ``kind``: ``"matrix"`` (multiplied: ``view`` holds its matrices), ``"router"``, ``"head"``,
    ``"embedding"`` (an index lookup), ``"tied"`` (a lookup table also multiplied: a tied
    embedding / output head), ``"not_matrix"`` (elementwise only), ``"unused"`` or ``"unknown"``
    (seen, but not understood: ``seen`` says what)."""

    name: str
    kind: str
    seen: str
    view: MatrixView | None = None


@dataclass
class ParameterUses:
    """The result of :func:`trace_parameter_uses`: ``uses[id(param)]``, how the forward ran
    (``"meta"`` or ``"real"``), and the problems met (a failed forward sets ``error``)."""

    uses: dict[int, ParamUse]
    ran_on: str = ""
    error: str | None = None
    problems: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> ParamUse:
        for use in self.uses.values():
            if use.name == name:
                return use
        raise KeyError(f"no parameter named {name!r} in the trace")
