"""CPU offload of an optimizer's state between steps.

While on, every state tensor is kept in host memory (pinned when CUDA is available) between
steps: ``send_out`` after a step packs the state of each (device, dtype)
into one flat buffer and copies it to a host buffer in one non-blocking transfer, and
``bring_in`` before the next step copies each host buffer back in one non-blocking transfer and
points the state at views of it. Transfers are ordered on the current stream, so the step's
kernels see the copied values and the copy out sees the step's results: the numbers are bitwise
those of a run without offload. On a CPU-only model the round trip is a pair of host copies (the
same code path, no memory saved). Sharded (DTensor) state stays where it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Pack:
    """The state tensors of one (device, dtype): where each one sits in the flat buffers."""

    device: torch.device
    dtype: torch.dtype
    entries: list[tuple[dict, str, torch.Size, int, int]] = field(default_factory=list)  # state, key, shape, at, n
    host: torch.Tensor | None = None


class StateOffload:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._opt = optimizer
        self.enabled = False
        self._out = False  # the state currently lives in the host buffers
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

    def _device_state(self):
        for state in self._opt.state.values():
            for key, value in state.items():
                if type(value) is torch.Tensor:  # plain tensors; DTensor state is left alone
                    yield state, key, value

    def send_out(self) -> None:
        """After a step: the device state goes to the host buffers (one transfer per device and dtype)."""
        if not self.enabled or self._out:
            return
        packs: dict[tuple[torch.device, torch.dtype], _Pack] = {}
        for state, key, value in self._device_state():
            pack = packs.setdefault((value.device, value.dtype), _Pack(value.device, value.dtype))
            at = sum(e[4] for e in pack.entries)
            pack.entries.append((state, key, value.shape, at, value.numel()))
        for (device, dtype), pack in packs.items():
            total = sum(e[4] for e in pack.entries)
            flat = torch.cat([e[0][e[1]].reshape(-1) for e in pack.entries]) if pack.entries else None
            old = self._packs.get((device, dtype))
            host = old.host if old is not None and old.host is not None and old.host.numel() == total else None
            if host is None:
                host = torch.empty(total, dtype=dtype, pin_memory=torch.cuda.is_available() and device.type == "cuda")
            host.copy_(flat, non_blocking=True)
            pack.host = host
            for state, key, shape, at, n in pack.entries:
                state[key] = host[at : at + n].view(shape)  # the device memory is released
        self._packs = packs
        self._out = True

    def bring_in(self) -> None:
        """Before a step: each host buffer back to its device in one transfer; the state views it."""
        if not self._out:
            return
        for (device, _dtype), pack in self._packs.items():
            flat = pack.host.to(device, non_blocking=True, copy=True)
            for state, key, shape, at, n in pack.entries:
                state[key] = flat[at : at + n].view(shape)
        self._out = False
