"""CPU offload of an optimizer's state between steps.

While on, every plain-tensor state (DTensor state stays where it is) lives between steps in one
host buffer per (device, dtype), pinned when the device is a GPU. Inside a buffer each tensor keeps
its strides (a channels-last or transposed state stays so) and starts ``ALIGN_BYTES`` (256)
aligned relative to the buffer's start. Device buffers come from the caching allocator, whose
blocks start 512-byte aligned, so every state view on the device is 256-byte aligned, as a tensor
of its own would be: the vectorized paths of the fused kernels (16-byte vectors) and of torch's
kernels take it, and cuBLASLt, whose heuristic looks at alignments up to 256 bytes, sees what it
sees without offload. The padding costs under 256 bytes per state tensor.

``bring_in`` (before a step) copies each host buffer into one fresh device buffer of the same
layout in one non-blocking transfer and points the state at views of it. ``send_out`` (after the
step) checks that every state tensor is still the view at its place in that buffer; if so the whole
buffer goes to the host buffer in one non-blocking transfer, the state points at the host views and
the device buffer is released: a step holds one device copy of the state, as it does without
offload. When the layout changed (the first offload, state created by a step or ``init_state``,
replaced by ``load_state_dict`` or by hand, params added), that (device, dtype) is laid out again
and each tensor is copied straight into its place in the (new) host buffer, one transfer per
tensor and no device-side staging copy. A state tensor replaced by hand while the state is out is
taken as it is: ``bring_in`` moves it to the device and the next ``send_out`` lays out again.

Ordering on CUDA (per device; each transfer runs on the current stream of the call that makes it):

- ``send_out``: the current stream waits for the last ``bring_in`` transfer out of the host buffer
  (it may have run on another stream), copies the device buffer into the host buffer, records an
  event after the copy, and marks the device buffer as used by that stream before releasing it.
- ``bring_in``: the current stream waits for that event (a device-side wait, no host sync), so a
  step on another stream than the previous one still reads the complete state; it then records an
  event after its own copy. Called when the state is already in (e.g. ``bring_in`` by hand on a side
  stream, then a step on the default stream), it makes the current stream wait for that event too.
- Host side: the transfers to host memory are asynchronous, so host reads must wait for them.
  ``wait()`` synchronizes the pending events (a no-op when none are pending). The optimizer calls it
  whenever its state is reached from the host (HybridMuon's ``state`` attribute), so
  ``opt.state[p]["momentum_buffer"]`` after a step, and anything that goes through ``opt.state``
  (logging, ``torch.save(opt.state)``, checkpoint helpers), sees the complete values; the step
  itself never blocks the host. A reference to a state tensor kept from before a step is not
  covered: read it again through ``opt.state``, or call ``wait()``.

The numbers are bitwise those of a run without offload. On a CPU-only model the round trip is a pair
of host copies (the same code path without events or pinning, and no memory saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Every state view starts at a multiple of this many bytes from its buffer's start.
ALIGN_BYTES = 256


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when it covers exactly ``t.numel()`` elements without overlap (a
    permutation of a contiguous layout); the contiguous strides otherwise."""
    if t.numel() == 0:
        return _contiguous_strides(t.shape)
    dims = sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride)
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return _contiguous_strides(t.shape)
        expected *= t.size(d)
    return tuple(t.stride())


@dataclass
class _Entry:
    """One state tensor: its dict and key, its layout and place (in elements) in the buffers."""

    state: dict
    key: str
    shape: torch.Size
    stride: tuple[int, ...]
    at: int
    host_view: torch.Tensor | None = None  # what the state holds while it is out


@dataclass
class _Pack:
    """The state tensors of one (device, dtype), laid out in one host buffer and, while the state
    is in, one device buffer of the same layout."""

    device: torch.device
    dtype: torch.dtype
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    host: torch.Tensor | None = None
    flat: torch.Tensor | None = None  # the device buffer, while the state is in
    out_event: torch.cuda.Event | None = None  # after the copy into `host`
    in_event: torch.cuda.Event | None = None  # after the copy out of `host`

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def in_place(self, items: list[tuple[dict, str, torch.Tensor]]) -> bool:
        """Whether ``items`` are this pack's entries, each still the view at its place in ``flat``."""
        if self.flat is None or len(items) != len(self.entries):
            return False
        base, size = self.flat.data_ptr(), self.flat.element_size()
        for (state, key, value), e in zip(items, self.entries):
            if state is not e.state or key != e.key:
                return False
            if value.shape != e.shape or value.stride() != e.stride:
                return False
            if value.numel() and value.data_ptr() != base + e.at * size:  # (empty tensors have no address)
                return False
        return True


class StateOffload:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._opt = optimizer
        self.enabled = False
        self._out = False  # the state currently lives in the host buffers
        self.pending = False  # a transfer into a pinned host buffer may still be running
        self._packs: dict[tuple[torch.device, torch.dtype], _Pack] = {}

    def refuse(self, what: str) -> None:
        if self.enabled:
            raise RuntimeError(f"{what} is not available while CPU offload is on (the state is in host buffers "
                               "between steps): call turn_off_cpu_offload() first, then turn_on_cpu_offload() again")

    def turn_on(self) -> None:
        self.enabled = True
        self.send_out()

    def turn_off(self) -> None:
        self.bring_in()
        self.enabled = False
        self._packs = {}

    def wait(self) -> None:
        """Blocks the host until the transfers into the host buffers are complete."""
        if not self.pending:
            return
        for pack in self._packs.values():
            if pack.out_event is not None:
                pack.out_event.synchronize()
        self.pending = False

    def _device_state(self, state_map) -> dict[tuple[torch.device, torch.dtype], list]:
        """The plain state tensors (DTensor state is left alone) by (device, dtype), in order."""
        found: dict[tuple[torch.device, torch.dtype], list] = {}
        for state in state_map.values():
            for key, value in state.items():
                if type(value) is torch.Tensor:
                    found.setdefault((value.device, value.dtype), []).append((state, key, value))
        return found

    def send_out(self) -> None:
        """After a step: the device state goes to the host buffers."""
        if not self.enabled or self._out:
            return
        packs: dict[tuple[torch.device, torch.dtype], _Pack] = {}
        for kind, items in self._device_state(self._opt.state).items():
            old = self._packs.get(kind)
            if old is not None and old.in_place(items):
                packs[kind] = self._send_flat(old)
            else:
                packs[kind] = self._send_laid_out(kind, items, old)
        self._packs = packs
        self._out = True
        self.pending = any(p.is_cuda for p in packs.values())

    @staticmethod
    def _before_host_write(pack: _Pack) -> torch.cuda.Stream | None:
        """The stream the copy into the host buffer runs on, after the last copy out of it."""
        if not pack.is_cuda:
            return None
        stream = torch.cuda.current_stream(pack.device)
        if pack.in_event is not None:
            stream.wait_event(pack.in_event)
        return stream

    @staticmethod
    def _after_host_write(pack: _Pack, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            pack.out_event = torch.cuda.Event()
            pack.out_event.record(stream)

    def _send_flat(self, pack: _Pack) -> _Pack:
        """The state is the device buffer's views: that buffer straight to the host buffer."""
        stream = self._before_host_write(pack)
        pack.host.copy_(pack.flat, non_blocking=True)
        self._after_host_write(pack, stream)
        if stream is not None:
            pack.flat.record_stream(stream)  # allocated on bring_in's stream; freed below
        for e in pack.entries:
            e.state[e.key] = e.host_view
        pack.flat = None
        return pack

    def _send_laid_out(self, kind, items, old: _Pack | None) -> _Pack:
        """A new layout: each tensor straight into its place in the host buffer."""
        device, dtype = kind
        pack = _Pack(device, dtype)
        if old is not None:
            pack.in_event = old.in_event
        align = max(ALIGN_BYTES // dtype.itemsize, 1)
        at = 0
        for state, key, value in items:
            at = -(-at // align) * align
            pack.entries.append(_Entry(state, key, value.shape, _dense_strides(value), at))
            at += value.numel()
        pack.numel = at
        host = old.host if old is not None else None
        if host is not None:
            storage = host.untyped_storage().data_ptr()
            if host.numel() != at or any(v.untyped_storage().data_ptr() == storage for _, _, v in items):
                host = None
        if host is None:
            host = torch.empty(at, dtype=dtype, pin_memory=pack.is_cuda)
        pack.host = host
        stream = self._before_host_write(pack)
        if stream is not None and old is not None and old.flat is not None:
            old.flat.record_stream(stream)  # the step may have used it; released below
        for e, (_, _, value) in zip(pack.entries, items):
            e.host_view = host.as_strided(e.shape, e.stride, e.at)
            e.host_view.copy_(value, non_blocking=True)
            if stream is not None and value.is_cuda:
                value.record_stream(stream)  # released below, once the state points at the host
        self._after_host_write(pack, stream)
        for e in pack.entries:
            e.state[e.key] = e.host_view
        return pack

    def bring_in(self) -> None:
        """Before a step: each host buffer back to its device in one transfer; the state views it."""
        if not self.enabled:
            return
        if not self._out:
            for pack in self._packs.values():  # brought in on another stream: order this one after it
                if pack.is_cuda and pack.in_event is not None:
                    torch.cuda.current_stream(pack.device).wait_event(pack.in_event)
            return
        for pack in self._packs.values():
            stream = None
            if pack.is_cuda:
                stream = torch.cuda.current_stream(pack.device)
                if pack.out_event is not None:
                    stream.wait_event(pack.out_event)
            flat = torch.empty(pack.numel, dtype=pack.dtype, device=pack.device)
            flat.copy_(pack.host, non_blocking=True)
            for e in pack.entries:
                value = e.state.get(e.key)
                if value is e.host_view:
                    e.state[e.key] = flat.as_strided(e.shape, e.stride, e.at)
                elif type(value) is torch.Tensor and value.device != pack.device:
                    e.state[e.key] = value.to(pack.device)  # replaced while out: taken as it is
            if stream is not None:
                pack.in_event = torch.cuda.Event()
                pack.in_event.record(stream)
            pack.flat = flat
        self._out = False
        self.pending = False
