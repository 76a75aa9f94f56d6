"""The window end as a transaction: what it changes, taken before it and put back if it fails.

Why not torch's state dicts: ``optimizer.step()`` writes in place and creates state
lazily, and a ``state_dict()`` aliases live tensors. Every tensor the optimizers may
write is cloned and their dicts kept as objects, so a failed window end,
KeyboardInterrupt included, leaves the accumulator as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipesched.runtime import deferred_interrupts
from pipesched.train.state import rng_state, set_rng_state

if TYPE_CHECKING:
    from pipesched.train.accumulator import GradientAccumulator

__all__ = ["GradientsAside", "WindowSnapshot"]


class GradientsAside:
    """Each parameter's ``.grad`` object as the window end found it (nothing is copied).

    The window end replaces ``.grad`` (the sum over replicas, then the
    normalized gradient) and never writes into these tensors.
    """

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.grads = [(p, p.grad) for p in parameters]

    def tensors(self) -> list[torch.Tensor]:
        """The gradients set aside (not None)."""
        return [g for _, g in self.grads if g is not None]

    def restore(self) -> None:
        """Puts every ``.grad`` back."""
        for p, grad in self.grads:
            p.grad = grad


class WindowSnapshot:
    """What ``optimizer.step()``, the schedulers and the loss scale may change, cloned.

    Memory: a copy of every parameter of the optimizers and of their state
    tensors, held for the optimizer and scheduler steps only.

    Args:
        acc: the accumulator whose window is about to be stepped.
        stepping: whether the optimizers will step (else only the loss
            scale changes: nothing of the optimizers is copied).
    """

    def __init__(self, acc: GradientAccumulator, stepping: bool = True) -> None:
        self.acc = acc
        optimizers = acc.optimizers if stepping else []
        params = {
            id(p): p
            for o in optimizers
            for g in o.param_groups
            for p in g["params"]
            if isinstance(p, torch.Tensor) and not p.is_meta
        }
        with torch.no_grad():
            self.params = [(p, p.detach().clone()) for p in params.values()]
        self.optimizers = [_OptimizerState(o) for o in optimizers]
        self.schedulers = [
            (s.__dict__, {k: _clone(v) for k, v in s.__dict__.items()}) for s in acc.schedulers
        ]
        self.loss_scale = _clone(acc.loss_scale.state_dict())
        self.growth_tracker = acc.loss_scale.growth_tracker
        self.rng = rng_state()

    def restore(self) -> None:
        """Puts parameters, optimizers, schedulers, loss scale and generators back (Ctrl-C held)."""
        acc = self.acc
        with deferred_interrupts():
            with torch.no_grad():
                for p, value in self.params:
                    p.copy_(value)
            for optimizer in self.optimizers:
                optimizer.restore()
            for attributes, saved in self.schedulers:  # around load_state_dict: it may differ
                attributes.clear()
                attributes.update({k: _clone(v) for k, v in saved.items()})
            acc.loss_scale.load_state_dict(_clone(self.loss_scale))
            acc.loss_scale.growth_tracker = self.growth_tracker
            set_rng_state(self.rng)


class _OptimizerState:
    """One optimizer's state and param groups, its tensors cloned, its dicts kept as objects."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state_object = optimizer.state
        self.state = dict(optimizer.state)  # parameter -> its (live) dict
        self.entries = {
            p: {k: (v, _clone(v)) for k, v in entry.items()} for p, entry in self.state.items()
        }
        self.groups_object = optimizer.param_groups
        self.groups = list(optimizer.param_groups)
        self.contents = [
            {k: (v if k == "params" else _clone(v)) for k, v in g.items()} for g in self.groups
        ]
        self.defaults = _clone(optimizer.defaults)

    def restore(self) -> None:
        optimizer = self.optimizer
        with torch.no_grad():
            for p, entry in self.state.items():
                entry.clear()
                for key, (live, saved) in self.entries[p].items():
                    entry[key] = _put_back(live, saved)
        self.state_object.clear()
        self.state_object.update(self.state)
        optimizer.state = self.state_object
        for group, content in zip(self.groups, self.contents, strict=True):
            group.clear()
            group.update({k: _clone(v) if k != "params" else v for k, v in content.items()})
        self.groups_object[:] = self.groups
        optimizer.param_groups = self.groups_object
        optimizer.defaults.clear()
        optimizer.defaults.update(_clone(self.defaults))


def _clone(value: Any) -> Any:
    """A copy that in-place writes to ``value`` cannot reach.

    Tensors are cloned, lists, tuples, dicts and sets copied through; any
    other object (a number, a string, a function, the optimizer a scheduler
    holds, a user's own object) is kept as the same object.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple, set):
        return type(value)(_clone(v) for v in value)
    if type(value) is dict:
        return {k: _clone(v) for k, v in value.items()}
    return value


def _put_back(live: Any, saved: Any) -> Any:
    """``live`` holding ``saved`` again: written into when it is a tensor of the same kind."""
    if (
        isinstance(live, torch.Tensor)
        and isinstance(saved, torch.Tensor)
        and live.shape == saved.shape
        and live.dtype == saved.dtype
        and live.device == saved.device
    ):
        live.copy_(saved)
        return live
    return _clone(saved)
