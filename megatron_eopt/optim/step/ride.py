"""The fused step with the ranks' agreement riding on its first exchange (``rank_checks="riding"``;
the mechanism, its tickets and headers: ``multirank.riding``).

A step with a ticket rides it (``_ride``): every rank enters the ticket's exchange, either with the
step itself (its first chunk's state saved first) or, where this rank cannot ride, with zeros and a
header saying so. Where every header agrees the step goes on; else every rank puts back what it
wrote and all agree over the ticket's group with an all-reduce, which raises the same error on every
rank where they differ, and run the ordinary step. The ordinary step records its first owner exchange
and leaves the next ticket (``_end_ride_record``), or none where the step cannot ride.
"""

from __future__ import annotations

from ..multirank.agreement import agree, capturing_cuda_graph, digest_value, fields_bytes, plan_fingerprint
from ..multirank.riding import FirstChunkState, FirstExchange, RideFallback, ride_key, rides
from .layout import cached_step_layouts


class RidingStep:
    """Mixin of the orthogonalizing optimizers: the riding agreement's part of the fused step."""

    def _step_fields(self, plan, active, stale: bool) -> list[tuple[str, str]]:
        """The fields a riding step compares: the agreement's (grads included), whether this rank
        must rebuild its plan (a rebuild makes collectives of its own: the ranks must agree on it
        first), and the plan's fingerprint."""
        fields = self._agreement_fields(active, plan)
        fields.insert(1, ("step plan rebuilt", "yes" if stale else "no"))
        if plan is not None:
            fields.append(("step plan", plan_fingerprint(plan)))
        return fields

    def _can_ride(self, plan, layouts) -> bool:
        return (self.block_period is None and self.__dict__.get("_overlap") is None
                and not capturing_cuda_graph(plan) and rides(plan, layouts))

    def _ride(self) -> bool:
        """Rides the ticket (see the module docstring). True: the step ran. False: every rank fell
        back alike and agreed, and the ordinary step follows. Raises, alike on every rank, where
        any rank refused the step or the ranks differ. Before anything that may rebuild the plan
        (a rebuild makes collectives of its own)."""
        ticket = self._ride_ticket
        plan = self._plan
        stale = plan is None or not self._plan_is_current(plan)
        active, error, fused = None, None, False
        if not stale:
            error = self._step_time_error() or self._spanning_matrix_error()
            fused = self._use_fused_step()
        if fused and error is None:
            active = [e.param.grad is not None for e in plan.entries]
            try:  # (as the ordinary step: everything that can reject the input, before anything is written)
                self._check_grads(plan, active)
                self._write_hyperparameters(plan, active)
            except (ValueError, TypeError, RuntimeError) as exc:
                error = exc
        fields = self._step_fields(None if stale else plan, active, stale)
        digest = digest_value(fields_bytes(fields))
        layouts = None if active is None or error is not None else cached_step_layouts(plan, active)
        saved = None
        if layouts is not None and ride_key(fields) == ticket.key and self._can_ride(plan, layouts):
            try:  # (the copy allocates: where it fails, this rank refuses the step and says so)
                saved = FirstChunkState(self, plan, layouts[0].members, self.__dict__.setdefault("_ride_copies", {}))
            except RuntimeError as exc:
                error = exc
        if saved is not None:
            counters = self._step_counters()
            run = self._engine.begin(plan, revertible=True, optimizer=self)
            self._sharded.first_exchange = FirstExchange(ticket, digest, saved)
            try:
                run.run_chunks(active)
            except RideFallback:
                saved.restore()
                run.cancel()
                self._restore_step_counters(counters)
            else:
                run.finish()
                return True
            finally:
                self._sharded.first_exchange = None
        else:
            ticket.send_changed(error is not None, digest)
        agree([ticket.scope], error, what=type(self).__name__, fields=fields)
        self._ride_ticket = None  # (every rank agreed here: the ordinary step makes the next, or none)
        return False

    def _step_counters(self) -> tuple:
        """The counters a step adds to before its first exchange (below-eps counts, the sharded
        path's matrices and bytes), as a ride that falls back puts them back."""
        counts = self.__dict__.get("_ns_below_eps_counts") or {}
        return ({device: count.clone() for device, count in counts.items()}, dict(self._sharded.matrices),
                self._sharded.bytes_sent)

    def _restore_step_counters(self, counters: tuple) -> None:
        counts, matrices, sent = counters
        for device, count in counts.items():
            self._ns_below_eps_counts[device].copy_(count)
        self._sharded.matrices.update(matrices)
        self._sharded.bytes_sent = sent

    def _record_first_exchange(self, agreed: bool) -> FirstExchange | None:
        """What the ordinary step hands its first owner exchange to record (``rank_checks="riding"``;
        ``agreed``: the step's check ran, so every rank makes a ticket alike)."""
        if not agreed or self.rank_checks != "riding":
            return None
        first = self._sharded.first_exchange = FirstExchange()
        return first

    def _end_ride_record(self, first: FirstExchange | None, plan, active) -> None:
        """After an ordinary step every rank agreed on: the next step's ticket (None: it cannot ride)."""
        self._sharded.first_exchange = None
        ticket = None
        if first is not None and self._can_ride(plan, cached_step_layouts(plan, active)):
            ticket = first.make_ticket(ride_key(self._step_fields(plan, active, False)))
        else:
            self.__dict__.pop("_ride_copies", None)  # (the host buffers of riding's copy: no ride, none kept)
        self._ride_ticket = ticket

    def _drop_ride_ticket(self) -> None:
        """Where every rank agreed on a change that makes the ticket stale (``add_param_group``)."""
        self._ride_ticket = None

    _ride_ticket = None  # (multirank.riding.Ticket) the ticket the next step rides
