"""The window end as a transaction: what it changes, taken before it and put back if it fails.

Why not torch's state dicts: ``optimizer.step()`` writes in place and creates state
lazily, and a ``state_dict()`` aliases live tensors. Every tensor the optimizers may
write is cloned (or, under ``grad_backup="host"``/``"disk"``, copied off the device
with the gradients) and their dicts kept as objects, so a failed window end,
KeyboardInterrupt included, leaves the accumulator as it was.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from pipesched.runtime import copies_for, deferred_interrupts, in_place, read_back
from pipesched.train.state import rng_state, set_rng_state

if TYPE_CHECKING:
    from pipesched.train.accumulator import GradientAccumulator

__all__ = ["GradientsAside", "WindowSnapshot"]

_LOST = (
    "the window end failed, and the window's gradients, or the parameters and optimizer "
    "state, are lost; load the last checkpoint"
)


class GradientsAside:
    """Each parameter's gradient as the window end found it.

    Set aside as the object (nothing copied), or under ``grad_backup`` "host" or
    "disk" copied off the device, so that the window end may scale it in place
    and its reductions replace it. The window end never writes into one set aside.

    Args:
        parameters: the pipeline's parameters.
        backup: the pipeline's ``grad_backup``.
    """

    def __init__(self, parameters: list[torch.nn.Parameter], backup: str = "device") -> None:
        copied = [p for p in parameters if p.grad is not None and in_place(backup, p.grad)]
        grads = [p.grad for p in copied]
        self.copies = copies_for(backup, grads, "the window end's gradients")  # type: ignore[arg-type]
        ids = {id(p) for p in copied}
        self.grads = [(p, p.grad) for p in parameters if id(p) not in ids]
        # Held weakly: a reduction that replaces a .grad frees the old one.
        self.copied = [(p, weakref.ref(p.grad), _like(p.grad)) for p in copied]  # type: ignore[arg-type]

    def tensors(self) -> list[torch.Tensor]:
        """The gradients set aside (not None): the window end scales them out of place."""
        return [g for _, g in self.grads if g is not None]

    def restore(self) -> None:
        """Puts every ``.grad`` back."""
        for p, grad in self.grads:
            p.grad = grad
        if self.copies is None:
            return
        targets = []
        for p, ref, like in self.copied:
            grad = ref()
            p.grad = grad if grad is not None else like()
            targets.append(p.grad)
        read_back(self.copies, targets, _LOST)

    def close(self) -> None:
        """Drops the copies (the window end succeeded)."""
        if self.copies is not None:
            self.copies.close()


class WindowSnapshot:
    """What ``optimizer.step()``, the schedulers and the loss scale may change, cloned.

    Memory: a copy of every parameter of the optimizers and of their state
    tensors, held for the optimizer and scheduler steps only.

    Args:
        acc: the accumulator whose window is about to be stepped.
        stepping: whether the optimizers will step (else only the loss
            scale changes: nothing of the optimizers is copied).
    """

    def __init__(
        self, acc: GradientAccumulator, stepping: bool = True, backup: str = "device"
    ) -> None:
        self.acc = acc
        optimizers = acc.optimizers if stepping else []
        params = {
            id(p): p
            for o in optimizers
            for g in o.param_groups
            for p in g["params"]
            if isinstance(p, torch.Tensor) and not p.is_meta
        }
        values = {id(p): p.detach() for p in params.values()}
        states = [
            (entry, key, value)
            for o in optimizers
            for entry in o.state.values()
            for key, value in entry.items()
        ]
        # Copied where grad_backup says: read back into each parameter as it is then (an
        # optimizer may have rebound its .data) and into the state tensors kept as objects.
        self.copied_params = [p for p in params.values() if in_place(backup, values[id(p)])]
        self.copied_state = [
            v for _, _, v in states if isinstance(v, torch.Tensor) and in_place(backup, v)
        ]
        off = [values[id(p)] for p in self.copied_params] + self.copied_state
        self.copies = copies_for(backup, off, "the parameters and optimizer state")
        copied = {id(t) for t in off}
        with torch.no_grad():
            self.params = [
                (p, values[id(p)].clone())
                for p in params.values()
                if id(values[id(p)]) not in copied
            ]
        self.optimizers = [_OptimizerState(o, copied) for o in optimizers]
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
            if self.copies is not None:  # last: if it fails, all the rest is back
                targets = [p.detach() for p in self.copied_params] + self.copied_state
                with torch.no_grad():
                    read_back(self.copies, targets, _LOST)

    def close(self) -> None:
        """Drops the copies (the window end succeeded)."""
        if self.copies is not None:
            self.copies.close()


class _OptimizerState:
    """One optimizer's state and param groups, its tensors cloned, its dicts kept as objects."""

    def __init__(self, optimizer: torch.optim.Optimizer, copied: set[int]) -> None:
        self.optimizer = optimizer
        self.state_object = optimizer.state
        self.state = dict(optimizer.state)  # parameter -> its (live) dict
        # A tensor in ``copied`` is kept as the object only: its values come back from the copy.
        self.entries = {
            p: {k: (v, v if id(v) in copied else _clone(v)) for k, v in entry.items()}
            for p, entry in self.state.items()
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
                    entry[key] = live if saved is live else _put_back(live, saved)
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


def _like(t: torch.Tensor) -> Any:
    """Makes an empty tensor of ``t``'s shape, strides, dtype and device (not holding ``t``)."""
    shape, stride, dtype, device = t.shape, t.stride(), t.dtype, t.device
    return lambda: torch.empty_strided(shape, stride, dtype=dtype, device=device)
