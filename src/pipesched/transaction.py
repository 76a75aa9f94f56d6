"""A step as a transaction: what a step changes, taken before it and put back if it raises.

Why: a step adds every micro-batch's gradients into ``.grad`` as it goes (the
fused accumulation writes there inside the GEMM). When micro-batch 3 of a stage
raises, micro-batches 0-2 are already in; a retry of the same batch (inside an
accumulation window, or after a Ctrl-C) would count them twice, silently.
torch's own ``backward`` has the same property, but a pipeline step is many
backwards, and a user cannot tell how far it got. So a step sets aside what
it may change before it starts and commits at its end:

- gradients: each existing ``.grad`` is set aside (not copied: a copy of
  every gradient cost a fifth of a step) and the step accumulates into fresh
  ones; a successful step adds them into the set-aside tensors (one add per
  parameter, as many adds as accumulating in place would have done) and puts
  those back; a failed step just puts them back;
- BatchNorm running statistics (copies: they are small), and the deferred
  BatchNorm accumulators;
- torch's default generators.
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
        aside: each parameter whose ``.grad`` existed, with that ``.grad``
            (the parameter's ``.grad`` is None until :meth:`commit`).
        fresh: the parameters whose ``.grad`` was None.
        buffers: each BatchNorm running statistic, with a copy.
        deferred: the deferred BatchNorm layers (their accumulators start empty).
        rng: the CPU generator's state, and each initialized CUDA device's.
    """

    aside: dict[nn.Parameter, torch.Tensor]
    fresh: tuple[nn.Parameter, ...]
    buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    deferred: tuple[DeferredBatchNorm, ...]
    rng: tuple[torch.Tensor, list[torch.Tensor] | None]

    @classmethod
    def take(cls, parameters: list[nn.Parameter], layers: list[_BatchNorm]) -> Snapshot:
        """Sets the gradients aside and remembers ``layers``' statistics and the generators."""
        aside, fresh = {}, []
        for p in parameters:
            if p.grad is None:
                fresh.append(p)
            else:
                aside[p], p.grad = p.grad, None
        buffers = [
            (buffer, buffer.clone())
            for layer in layers
            for buffer in (layer.running_mean, layer.running_var, layer.num_batches_tracked)
            if isinstance(buffer, torch.Tensor)
        ]
        deferred = tuple(layer for layer in layers if isinstance(layer, DeferredBatchNorm))
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            cuda = torch.cuda.get_rng_state_all()
        return cls(aside, tuple(fresh), tuple(buffers), deferred, (torch.get_rng_state(), cuda))

    def commit(self, parameters: list[nn.Parameter] | None = None) -> None:
        """Adds the step's gradients into the set-aside ones (of ``parameters``; None: all).

        Idempotent per parameter: a parameter committed early (its gradients
        are read mid-step, e.g. by a replica's all-reduce) is not added twice.
        """
        with torch.no_grad():
            for p in list(self.aside) if parameters is None else parameters:
                before = self.aside.pop(p, None)
                if before is None:
                    continue
                if p.grad is not None:
                    if before.layout == torch.strided:
                        before.add_(p.grad)
                    else:  # sparse: as AccumulateGrad adds
                        before = before + p.grad
                p.grad = before

    def restore(self) -> None:
        """Puts everything back as it was when the snapshot was taken."""
        for p, grad in self.aside.items():
            p.grad = grad
        for p in self.fresh:
            p.grad = None
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for layer in self.deferred:
            layer._reset_accumulators()
        cpu, cuda = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
