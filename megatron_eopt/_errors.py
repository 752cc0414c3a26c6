"""Typed errors of the compiled ops.

The op library is built on the LibTorch stable ABI, across which one C++ exception type travels:
every failed check reaches Python as ``RuntimeError``. The C++ checks lead their message with the
Python type the mistake deserves (``"ValueError: newton_schulz: steps must be at least 1, got 0"``);
:func:`call_op`, used by every wrapper in :mod:`megatron_eopt.ops` and by the optimizers, re-raises
such an error as that ``ValueError`` / ``TypeError``. Direct ``torch.ops.megatron_eopt`` callers
see the ``RuntimeError`` with the same message.
"""

from __future__ import annotations

import re
from typing import Any, Callable

_PREFIXES = (("ValueError: ", ValueError), ("TypeError: ", TypeError))
# What the stable ABI appends when the error passed through a nested dispatcher call (the
# composite ops call newton_schulz): where in the library the call was made, not the user's news.
_CALL_SITE = re.compile(r"\s*\(originally from torch_call_dispatcher\(.*\Z", re.S)


def typed_error(error: RuntimeError) -> Exception | None:
    """The ValueError / TypeError an op's RuntimeError stands for, or None for other errors."""
    message = str(error)
    for prefix, kind in _PREFIXES:
        if message.startswith(prefix):
            return kind(_CALL_SITE.sub("", message[len(prefix):]))
    return None


def call_op(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls a ``torch.ops.megatron_eopt`` op, raising its argument errors with their Python type."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as error:
        typed = typed_error(error)
        if typed is None:
            raise
        raise typed from None
