"""Layer-sharded homes over a GTP × TP domain (tp_mode "layer_sharded", after Megatron-LM PR #6683).

A matrix whose pieces lie on the ranks of a tensor-parallel group and of a GTP weight-
rematerialization group (Megatron-LM's ``is_gtp_weight_remat``: the rows of the TP-local matrix,
padded by ``pad_length`` zero rows, split over ``gtp_remat``) is orthogonalized once in the whole
domain: one *home* among its TP × GTP ranks receives every piece, strips the padding, orthogonalizes
the real matrix and sends each rank its piece of the result (padding rows zero). A matrix replicated
over the TP group (``partition_dim`` -1: an MLA down-projection, a router) or over the GTP group (not
``is_gtp_weight_remat``: its gradients are reduced over GTP, so the copies agree) gets one home too:
only the ranks on the home's TP (GTP) line send their pieces, and every rank receives its piece of
the one result, so the ranks holding copies no longer each orthogonalize theirs.

Over TP and GTP together the pieces hop over the TP group, then the GTP group (a relay route of
:mod:`.owner_exchange`: two all-to-alls each way), unless the model's ``pg_collection`` holds a group
of the whole domain (PR #6683's ``tp_gtp_remat`` / ``expt_tp_gtp_remat``): then one all-to-all over it
(``combined_peers`` reads each member's rank in it, in whatever order the group lists them). A domain
of one group (GTP alone, or a TP-replicated matrix without GTP) exchanges over that group directly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import _collectives as collectives
from ..matrix_view import newton_schulz_in_batches
from .owner_exchange import ITEMS_PER_RANK, OwnerExchange, OwnerRoute, assign_owners, ns_flops


@dataclass(frozen=True)
class HomeDomain:
    """The ranks among which each matrix of a layer-sharded stack gets one home: the TP group
    (``tp_size`` ranks, this one ``tp_rank``; ``partition_dim`` 0 / 1 shards the TP-local matrix's
    rows / columns over it, -1 replicates it) times the GTP group (``gtp_size`` ranks, this one
    ``gtp_rank``; ``gtp_pad`` None: the matrix is replicated over it, else its TP-local rows, padded
    by ``gtp_pad`` zero rows, are split over it)."""

    tp_group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int
    partition_dim: int
    gtp_group: dist.ProcessGroup | None
    gtp_size: int
    gtp_rank: int
    gtp_pad: int | None
    ns_batch_size: int
    # A process group of the whole domain and each member's rank in it (combined_peers), or None: relay.
    combined: tuple | None = None

    @property
    def size(self) -> int:
        return self.tp_size * self.gtp_size

    @property
    def key(self) -> tuple:
        return ("homes", id(self.tp_group), self.tp_size, self.partition_dim, id(self.gtp_group), self.gtp_size,
                self.gtp_pad, self.ns_batch_size, None if self.combined is None else id(self.combined[0]))

    def coordinates(self, member: int) -> tuple[int, int]:
        """(TP rank, GTP rank) of a member (members are numbered TP-major)."""
        return divmod(member, self.gtp_size)

    def route(self) -> OwnerRoute:
        """The route of the domain's exchanges: one group, or a relay over the TP then the GTP group."""
        if self.gtp_size == 1:
            return OwnerRoute(self.tp_group, tuple(range(self.tp_size)), self.tp_rank, ("tp", id(self.tp_group)))
        if self.tp_size == 1:
            return OwnerRoute(self.gtp_group, tuple(range(self.gtp_size)), self.gtp_rank, ("gtp", id(self.gtp_group)))
        grid = tuple(itertools.product(range(self.tp_size), range(self.gtp_size)))
        me = (self.tp_rank, self.gtp_rank)
        if self.combined is not None:  # one all-to-all over the domain's own group
            group, peers = self.combined
            return OwnerRoute(group, peers, grid.index(me), ("tp_gtp_group", id(group), self.tp_size, self.gtp_size))
        # Hop 0 moves a piece along this rank's TP line (same GTP rank), hop 1 along its GTP line.
        tp_line = tuple(t if g == me[1] else -1 for t, g in grid)
        gtp_line = tuple(g if t == me[0] else -1 for t, g in grid)
        return OwnerRoute(None, tuple(range(len(grid))), grid.index(me),
                          ("tp_gtp", id(self.tp_group), id(self.gtp_group), self.tp_size, self.gtp_size),
                          hops=((self.tp_group, tp_line), (self.gtp_group, gtp_line)), grid=grid,
                          member_at={c: m for m, c in enumerate(grid)})


def combined_peers(tp_group, gtp_group, combined, name: str) -> tuple[int, ...]:
    """Each domain member's rank in ``combined`` (a process group of the whole TP x GTP domain, the
    model's ``pg_collection.<name>``), members numbered TP-major as :meth:`HomeDomain.coordinates`.
    The ranks of this rank's TP line are gathered over the GTP group (one object all-gather, when the
    plan is built). ValueError naming ``name`` when the group is not exactly the domain."""
    line = tuple(dist.get_process_group_ranks(tp_group))  # global ranks of (t, my GTP rank), t in order
    lines: list = [None] * dist.get_world_size(gtp_group)
    collectives.all_gather_object(lines, line, group=gtp_group)
    members = [lines[g][t] for t in range(len(line)) for g in range(len(lines))]
    in_group = dist.get_process_group_ranks(combined)
    if sorted(members) != sorted(in_group):
        raise ValueError(f"pg_collection.{name} holds ranks {sorted(in_group)}, but the TP x GTP domain of this "
                         f"parameter is ranks {sorted(members)}: it must be exactly the domain")
    return tuple(in_group.index(r) for r in members)


def assign_homes(k: int, rows: int, cols: int, domain: HomeDomain, load: list[float]):
    """The exchange chunks and homes of a stack of k local (rows, cols) pieces over ``domain``, each
    matrix's home the least loaded by Newton–Schulz FLOPs (``load``, each member's so far; updated)."""
    pd, pad, G, T = domain.partition_dim, domain.gtp_pad, domain.gtp_size, domain.tp_size
    real = rows * G - pad if pad is not None else rows  # rows of the TP-local matrix without padding
    shape = (real * T, cols) if pd == 0 else (real, cols * T) if pd == 1 else (real, cols)
    per_home = max(ITEMS_PER_RANK, domain.ns_batch_size)
    return assign_owners([ns_flops(shape)] * k, domain.size, per_home * domain.size, load)


def home_orthogonalize(x: torch.Tensor, domain: HomeDomain, route: OwnerRoute, split, config, scaled: bool,
                       load: list[float]) -> list[torch.Tensor]:
    """Layer-sharded Newton–Schulz of a stack of k local pieces (k, rows, cols) over ``domain``:
    every matrix orthogonalized once, on its home (least loaded by FLOPs, ``load`` carried over the
    step's stacks), in batches of ``ns_batch_size``; returns this rank's k pieces of the results
    (raw, or the parts of a split matrix scaled when ``scaled``, as the other modes return them). Only distinct pieces
    travel: of a matrix replicated over TP (or GTP), the copies on the home's TP (GTP) line."""
    k, rows, cols = x.shape
    pd, pad, G, T = domain.partition_dim, domain.gtp_pad, domain.gtp_size, domain.tp_size
    gtp_rows = pad is not None  # the rows are split over GTP (else replicated over it)
    real = rows * G - pad if gtp_rows else rows  # rows of the TP-local matrix without padding
    chunks, homes = assign_homes(k, rows, cols, domain, load)
    numel = rows * cols
    outs: list[torch.Tensor | None] = [None] * k

    def sends(i, s):
        (t, g), (th, gh) = domain.coordinates(s), domain.coordinates(homes[i])
        return (pd != -1 or t == th) and (gtp_rows or g == gh)

    def tp_local(parts, t, gh):
        if not gtp_rows:
            return parts[t * G + gh].view(rows, cols)
        return torch.cat([parts[t * G + g].view(rows, cols) for g in range(G)])[:real]

    def orthogonalize(owned, pieces):
        if not owned:
            return []
        mats = []
        for i, parts in zip(owned, pieces):
            th, gh = domain.coordinates(homes[i])
            if pd == -1:
                mats.append(tp_local(parts, th, gh))
            else:
                mats.append(torch.cat([tp_local(parts, t, gh) for t in range(T)], dim=pd))
        return newton_schulz_in_batches(config, torch.stack(mats), domain.ns_batch_size, split, scaled)

    def back(i, result, s):
        t, g = domain.coordinates(s)
        piece = result if pd == -1 else result.chunk(T, dim=pd)[t]
        if gtp_rows:
            if pad:
                piece = torch.cat([piece, piece.new_zeros(pad, cols)])
            piece = piece[g * rows : (g + 1) * rows]
        return piece.contiguous()

    def deliver(i, piece):
        outs[i] = piece.view(rows, cols)

    OwnerExchange(
        route, chunks, homes,
        to_owner=lambda i, s: numel if sends(i, s) else 0,
        send=lambda i: x[i],
        compute=orthogonalize,
        from_owner=lambda i, s: numel,
        back=back,
        deliver=deliver,
        like=x,
    ).run()
    return outs


__all__ = ["HomeDomain", "home_orthogonalize"]
