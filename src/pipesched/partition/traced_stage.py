"""One stage of a traced model: its share of the graph, run on the model's own parameters.

A stage takes one object and returns one: later stages take a dict of the values
they need, including values that only pass through to a later stage (a U-Net's
skip). Why parameters are looked up at every call: the stage then uses the model's
very Parameters (tied weights accumulate into one ``.grad``) and any buffer a
recomputation guard has swapped in (for the recomputing thread only: see
:func:`~pipesched.runtime.stage.recompute.throwaway_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.partition.trace import TracedModel
from pipesched.runtime.compat.internals import pytree
from pipesched.runtime.stage.recompute import throwaway_buffers
from pipesched.runtime.stage.tree import tensors

__all__ = ["ModeCheck", "RandomOp", "Switch", "TracedStage", "ValueName"]


@dataclass(frozen=True)
class ValueName:
    """An output of the model that is a value of the graph, by its name.

    Why not the name itself: an output may be a string constant (a tag the
    model returns), which must come back as the string, not as the value that
    happens to bear that name.
    """

    name: str


@dataclass(frozen=True)
class ModeCheck:
    """A module whose training mode the trace baked in, and the mode it had then.

    Args:
        module: the module, ``name`` its name in the model.
        training: its mode at tracing time.
        reason: what depends on it, for the error message.
    """

    module: nn.Module
    name: str
    training: bool
    reason: str


@dataclass(frozen=True)
class Switch:
    """The argument of a dropout that the mode turns on or off.

    Args:
        position: its index in the positional arguments, or None (a keyword).
        name: its name (``"train"`` or ``"dropout_p"``).
        on, off: its value in training and in eval mode.
    """

    position: int | None
    name: str
    on: Any
    off: Any


class RandomOp(nn.Dropout):
    """A random operation of a traced graph (functional dropout, attention dropout).

    Why a module: :mod:`pipesched.runtime.stage.rng` keys every draw by the module path it
    happens in; as a module named after its graph node, the operation has a
    place of its own that does not depend on the cut (and a Dropout
    subclass, it follows ``train()``/``eval()`` like one).

    Args:
        op: the operation.
        owner: the module whose code ran it; its mode drives ``switch``. Held
            outside the module tree (its own Dropouts are seeded by the pipeline).
        switch: the argument that turns the dropout off in eval mode, if any.
    """

    def __init__(
        self, op: Callable[..., Any], owner: nn.Module | None = None, switch: Switch | None = None
    ) -> None:
        super().__init__()
        self.op = op
        self._owner = (owner,)  # a tuple: not registered as a submodule
        self._switch = switch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the operation, its dropout switched by its owner's mode."""
        owner, switch = self._owner[0], self._switch
        if switch is not None and owner is not None:
            value = switch.on if owner.training else switch.off
            if switch.position is not None and switch.position < len(args):
                args = (*args[: switch.position], value, *args[switch.position + 1 :])
            else:
                kwargs = {**kwargs, switch.name: value}
        return self.op(*args, **kwargs)


class TracedStage(nn.Module):
    """Stage ``index`` of ``num_stages``: a graph module fed from the model's state.

    Args:
        traced: the trace the stage was cut from.
        index, num_stages: which stage.
        graph: its operations; called as ``graph(device, *inputs, *state)``
            and returning the values of ``produced``.
        inputs: names of the values ``graph`` takes (user inputs on stage 0).
        state: per state placeholder of ``graph``, the dict and key holding the
            tensor now (``owner._parameters``, ``owner._buffers`` or this stage's
            constants).
        owners: modules owning the parameters and buffers used, for ``.to()``.
        produced: names of the values ``graph`` returns.
        sends: names of the values the next stage receives (None: last stage).
        snapshots: those of ``sends`` this stage makes that share a buffer's data
            (``self.n += 1`` returns the buffer itself): sent as copies.
        outputs: last stage, the model's flattened outputs: values (:class:`ValueName`)
            or constants.
        mode_checks: modules whose mode must stay as traced.
        constants: tensors export lifted out of the code, held here.
    """

    def __init__(
        self,
        traced: TracedModel,
        index: int,
        num_stages: int,
        graph: fx.GraphModule,
        *,
        inputs: Sequence[str],
        state: Sequence[tuple[dict[str, Any] | None, str]],
        owners: Sequence[nn.Module],
        produced: Sequence[str],
        sends: Sequence[str] | None,
        outputs: Sequence[Any],
        mode_checks: Sequence[ModeCheck],
        constants: dict[str, torch.Tensor],
        snapshots: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.graph = graph
        for name, tensor in constants.items():
            self.register_buffer(name, tensor, persistent=False)
        self._traced = traced
        self._inputs = tuple(inputs)
        self._state: list[tuple[dict[str, Any], str]] = [
            (self._buffers if d is None else d, key) for d, key in state
        ]
        self._owners = tuple(owners)
        self._produced = tuple(produced)
        self._sends = None if sends is None else tuple(sends)
        self._snapshots = frozenset(snapshots)
        self._outputs = tuple(outputs)
        self._mode_checks = tuple(mode_checks)
        named = {v.name for v in self._outputs if isinstance(v, ValueName)}
        # Outputs that are the model's own state (``return out, self.scale``): read at each call.
        self._state_outputs = {n.name: ref for n, ref in traced.state.items() if n.name in named}

    @property
    def random_ops(self) -> nn.Module | None:
        """The stage's :class:`RandomOp` modules (a container), or None."""
        found: nn.Module | None = getattr(self.graph, "random", None)
        return found

    @property
    def sends(self) -> tuple[str, ...] | None:
        """The keys of the dict this stage returns, in order (None: the last stage)."""
        return self._sends

    @property
    def traced(self) -> TracedModel:
        """The trace the stage was cut from."""
        return self._traced

    @property
    def owners(self) -> tuple[nn.Module, ...]:
        """The modules owning the parameters and buffers this stage uses."""
        return self._owners

    def buffer_slots(self) -> list[tuple[dict[str, Any], str]]:
        """Where each of the model's buffers this stage reads lives (for the checkpoint guard).

        The stage reads them as ``holder[key]`` at each call, or the guard's copy
        while this thread recomputes it.
        """
        holders = [owner._buffers for owner in self._owners]
        return [(d, k) for d, k in self._state if any(d is h for h in holders)]

    def modes_hold(self) -> bool:
        """Whether every module whose mode the trace fixed is in that mode now."""
        return all(c.module.training == c.training for c in self._mode_checks)

    def used_parameters(self) -> list[nn.Parameter]:
        """The model's Parameters this stage computes with (it registers none itself)."""
        found = {
            id(v): v for holder, key in self._state if isinstance(v := holder[key], nn.Parameter)
        }
        return list(found.values())

    def extra_repr(self) -> str:
        """Which stage, and how much it receives and sends."""
        sends = "output" if self._sends is None else f"{len(self._sends)} values"
        return f"stage {self.index} of {self.num_stages}: receives {self._inputs}, sends {sends}"

    def forward(self, x: Any) -> Any:
        """Runs the stage on ``x``: the model's input (stage 0) or the previous stage's dict."""
        for check in self._mode_checks:
            if check.module.training != check.training:
                _mode_error(check)
        if self.index == 0:
            env = dict(zip((n for n in self._first_inputs()), self._leaves(x), strict=True))
        elif isinstance(x, dict):
            env = x
        else:
            raise ConfigTypeError(
                f"stage {self.index} of a traced model takes the dict stage {self.index - 1} "
                f"returns, got {type(x).__name__}"
            )
        device = next(iter(tensors(list(env.values()))), None)
        # Not the dicts' entries alone: a recomputation in this thread reads its own copies,
        # while other stages' threads go on reading (and updating) the model's buffers.
        throwaway = throwaway_buffers()
        state = (
            (throwaway.get((id(holder), key), holder[key]) for holder, key in self._state)
            if throwaway
            else (holder[key] for holder, key in self._state)
        )
        values = self.graph(
            device.device if device is not None else self._state_device(),
            *(env[name] for name in self._inputs),
            *state,
        )
        env = {**env, **dict(zip(self._produced, values, strict=True))}
        if self._sends is None:
            leaves = [
                self._output(env, v) if isinstance(v, ValueName) else v for v in self._outputs
            ]
            return pytree.tree_unflatten(leaves, self._traced.out_spec)
        # Why copies of values sharing a buffer's data: this stage updates the buffer again
        # for the next micro-batch, maybe before the next stage reads this one's value.
        return {
            name: _snapshot(env[name]) if name in self._snapshots else _carry(env[name])
            for name in self._sends
        }

    def _output(self, env: dict[str, Any], value: ValueName) -> Any:
        """An output's value: computed here, or the model's own parameter, buffer or
        constant (the object itself, as the plain model returns it)."""
        ref = self._state_outputs.get(value.name)
        if ref is None or value.name in env:
            return env[value.name]
        if ref.kind == "parameter":
            return self._traced.model.get_parameter(ref.name)
        if ref.kind == "buffer":
            return self._traced.model.get_buffer(ref.name)
        return self._traced.constant(ref.name)

    def _first_inputs(self) -> Iterator[str]:
        return (node.name for node in self._traced.inputs)

    def _leaves(self, x: Any) -> list[Any]:
        leaves = self._traced.input_leaves(x)
        batch = self._traced.traced_batch
        first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1), None)
        if batch is not None and first is not None and first.shape[0] != batch:
            raise ConfigError(
                f"{type(self._traced.model).__name__} was traced with a batch of {batch} and "
                f"its code fixes that size (export could not keep dim 0 dynamic), but this "
                f"micro-batch has {first.shape[0]} rows; give batches of chunks x {batch} rows"
            )
        return leaves

    def _state_device(self) -> torch.device:
        for holder, key in self._state:
            return torch.device(holder[key].device)
        return torch.device("cpu")

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> TracedStage:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for owner in self._owners:
            owner._apply(fn, recurse=False)  # type: ignore[no-untyped-call]
        return self


def _carry(value: Any) -> Any:
    """A value passing through: a view, so its gradient flows back through this stage."""
    return value.view_as(value) if isinstance(value, torch.Tensor) else value


def _snapshot(value: Any) -> Any:
    """A value sharing a buffer's data, copied as it is now (the gradient flows through)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _mode_error(check: ModeCheck) -> None:
    now = "training" if check.module.training else "eval"
    then = "training" if check.training else "eval"
    raise ConfigError(
        f"module {check.name!r} ({type(check.module).__name__}) is in {now} mode but was "
        f"traced in {then} mode, which fixed its {check.reason}. Build the Pipeline with "
        f"the model in {now} mode (model.{'train' if now == 'training' else 'eval'}() "
        "before Pipeline(...)), or run the plain model for this, sharing the parameters"
    )
