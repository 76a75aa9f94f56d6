"""A step as a transaction: what a step changes, taken before it and put back if it raises.

Why: a step adds every micro-batch's gradients into ``.grad`` as it goes (the
fused accumulation writes there inside the GEMM). When micro-batch 3 of a stage
raises, micro-batches 0-2 are already in; a retry of the same batch (inside an
accumulation window, or after a Ctrl-C) would count them twice, silently.
torch's own ``backward`` has the same property, but a pipeline step is many
backwards, and a user cannot tell how far it got. So a step remembers, before
it starts, what it may change: the gradients (a copy of each existing ``.grad``;
nothing to copy where ``.grad`` is None, as on a window's first step), the
BatchNorm running statistics, the deferred BatchNorm accumulators, and torch's
default generators; on failure it puts them back, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.batchnorm import DeferredBatchNorm

__all__ = ["Snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """What a step may change, as it was before the step.

    Attributes:
        grads: each parameter with its ``.grad`` before the step (a copy, or None).
        buffers: each BatchNorm's running statistics (copies).
        deferred: the deferred BatchNorm layers (their accumulators start empty).
        rng: the CPU generator's state, and each initialized CUDA device's.
    """

    grads: tuple[tuple[nn.Parameter, torch.Tensor | None], ...]
    buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    deferred: tuple[DeferredBatchNorm, ...]
    rng: tuple[torch.Tensor, list[torch.Tensor] | None]

    @classmethod
    def take(cls, module: nn.Module) -> Snapshot:
        """Remembers ``module``'s gradients, BatchNorm state and the generators."""
        grads = tuple(
            (p, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()
        )
        buffers = []
        deferred = []
        for layer in module.modules():
            if isinstance(layer, DeferredBatchNorm):
                deferred.append(layer)
            if isinstance(layer, _BatchNorm):
                for name in ("running_mean", "running_var", "num_batches_tracked"):
                    buffer = getattr(layer, name, None)
                    if isinstance(buffer, torch.Tensor):
                        buffers.append((buffer, buffer.clone()))
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            cuda = torch.cuda.get_rng_state_all()
        return cls(grads, tuple(buffers), tuple(deferred), (torch.get_rng_state(), cuda))

    def restore(self) -> None:
        """Puts everything back as it was when the snapshot was taken."""
        with torch.no_grad():
            for p, grad in self.grads:
                if grad is None:
                    p.grad = None
                elif p.grad is None or p.grad.shape != grad.shape:
                    p.grad = grad
                else:
                    p.grad.copy_(grad)  # keep the tensor: optimizers and hooks may hold it
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for layer in self.deferred:
            layer._reset_accumulators()
        cpu, cuda = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
