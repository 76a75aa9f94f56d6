"""The warning that a forward updates buffers once per micro-batch, issued once per pipeline.

A module that updates a buffer in its forward (spectral norm's power-iteration
vector, a step counter, a running average) updates it once per micro-batch, as
under gradient accumulation, where the plain model on the batch updates it once:
its value, and what later forwards read from it, differ. BatchNorm's running
statistics are told apart (:mod:`~pipesched.pipeline.checks.micro_batch_norm`,
with its own fix). Why a warning and not an error: it is what GPipe does.
"""

from __future__ import annotations

import threading
import weakref

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import PipeschedWarning, warn_user

__all__ = ["BufferWatch", "warn_buffer_updates", "watch_buffers"]

_SHOWN_NAMES = 5
_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


class BufferWatch:
    """The versions of a model's buffers (BatchNorms' apart) before a step."""

    def __init__(self, model: nn.Module) -> None:
        norms = {id(b) for m in model.modules() if isinstance(m, _BatchNorm) for b in m.buffers()}
        self.before = {
            name: (buffer, buffer._version)
            for name, buffer in model.named_buffers()
            if id(buffer) not in norms
        }

    def updated(self, model: nn.Module) -> list[str]:
        """The buffers written (or reassigned) since, by name."""
        now = dict(model.named_buffers())
        return [
            name
            for name, (buffer, version) in self.before.items()
            if now.get(name) is not buffer or buffer._version != version
        ]


def watch_buffers(pipe: nn.Module, model: nn.Module, num_microbatches: int) -> BufferWatch | None:
    """A watch for this step of ``pipe``, where it runs micro-batches and has not told yet."""
    if num_microbatches < 2 or pipe in _warned:
        return None
    return BufferWatch(model)


def warn_buffer_updates(
    pipe: nn.Module, watch: BufferWatch | None, model: nn.Module, num_microbatches: int
) -> None:
    """Warns once per ``pipe`` naming the buffers the step's forwards updated."""
    if watch is None:
        return
    names = watch.updated(model)
    with _lock:
        if pipe in _warned:
            return
        _warned.add(pipe)
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
    more = f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
    warn_user(
        f"the model's forward updated buffer{'s' if len(names) > 1 else ''} {shown}{more}: "
        f"once per micro-batch ({num_microbatches} times this step), where the plain model "
        "on the whole batch updates them once, so their values, and what later forwards "
        "read from them, differ from its (spectral norm's power iteration runs "
        f"{num_microbatches} iterations a step; a step counter counts micro-batches). As "
        "under gradient accumulation; where it matters, update them once per step outside "
        "the forward, or use chunks=1. Shown once per Pipeline",
        PipeschedWarning,
    )
