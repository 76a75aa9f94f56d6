"""Activation checkpointing: recompute a stage's forward during its backward.

Why torch's non-reentrant checkpoint and not torchgpipe's reentrant one: parameters
get gradients whatever the inputs (token ids), and autocast and RNG are replayed.
Why a buffer guard: recomputation repeats side effects (BatchNorm's running stats),
so each buffer the module uses is swapped for a throwaway clone, of its value as
the forward read it (:class:`_ForwardBuffers`), while it runs.
Buffers a traced stage reads by name are swapped for its thread only
(:func:`throwaway_buffers`; see :class:`_Recomputation`).
Other modules with side effects can ask :func:`is_recomputing`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, Final

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from pipesched.errors import ConfigError, ConfigTypeError

__all__ = [
    "CHECKPOINT_MODES",
    "buffer_slots",
    "check_checkpoint",
    "checkpoint",
    "checkpoint_stop",
    "is_recomputing",
    "stage_stops",
    "throwaway_buffers",
]

CHECKPOINT_MODES: Final = ("always", "except_last", "never")
"""Which micro-batches a stage checkpoints; see :func:`checkpoint_stop`."""

# Where a buffer lives, ``(holder, key)``: ``holder[key]`` is the tensor a forward reads.
_Slot = tuple[dict[str, Any], str]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.recomputing = False
        # The clones this thread's recomputations read in place of the buffers that
        # traced stages read by name, by (id(holder), key).
        self.throwaway: dict[tuple[int, str], Tensor] = {}


_state = _ThreadState()


def is_recomputing() -> bool:
    """Whether the current thread is recomputing a checkpointed forward.

    Modules with side effects in their forward (counters, statistics) check
    it to act once per micro-batch, not twice.

    Example:
        >>> is_recomputing()
        False
    """
    return _state.recomputing


def throwaway_buffers() -> Mapping[tuple[int, str], Tensor]:
    """The throwaway copies this thread's recomputation reads, by ``(id(holder), key)``.

    A module that reads buffers by their slot (a traced stage: ``holder[key]``)
    reads ``throwaway_buffers().get((id(holder), key), holder[key])``: the
    copy only in the thread that recomputes, the buffer itself in every other.
    Empty outside a recomputation.

    Example:
        >>> dict(throwaway_buffers())
        {}
    """
    return _state.throwaway


class _Recomputation:
    """Entered around each recomputation of ``module``: sets the flag, guards the buffers.

    Why two ways to swap: a traced stage reads the model's buffers by name from
    the model's own ``_buffers`` dicts, which other stages, run by other
    threads, read too (a root-level counter, a mask every block reads).
    Swapping the dict's entry there would hand this thread's clone to another
    stage's forward (its update lost) and, with two recomputations interleaved,
    could leave a clone in the model for good; so those are this thread's only
    (:func:`throwaway_buffers`). A module that reads its buffers as attributes
    (BatchNorm, a stage of an ``nn.Sequential``) belongs to one stage, and its
    dict entries are swapped as torch would.

    A class and not a ``@contextmanager`` generator because torch enters the
    same object once per backward pass over the graph (``retain_graph=True``
    gives two), and a generator can only be entered once. Exits run even when
    the recomputation raises, including torch's own early-stop exception,
    which ends every recomputation as soon as the last saved tensor is rebuilt.
    """

    def __init__(self, module: nn.Module, seen: Mapping[tuple[int, str], Tensor]) -> None:
        self.module = module
        self.seen = seen  # a buffer's value as the forward saw it, where the forward wrote it
        self._saved: list[
            tuple[bool, dict[tuple[int, str], Tensor], list[tuple[dict[str, Any], str, Tensor]]]
        ] = []

    def __enter__(self) -> None:
        # Clone everything first: if a clone fails, nothing has changed yet. One clone
        # per tensor, so a buffer two modules share stays shared.
        by_name, owned = _slots(self.module)
        outer, seen = _state.throwaway, self.seen
        named = [
            (holder, key, outer.get((id(holder), key), holder[key])) for holder, key in by_name
        ]
        slots = [(holder, key, holder[key]) for holder, key in owned]
        clones: dict[int, Tensor] = {}
        for holder, key, buffer in (*named, *slots):
            if id(buffer) not in clones:
                clones[id(buffer)] = seen.get((id(holder), key), buffer).clone()
        self._saved.append((_state.recomputing, outer, slots))
        _state.recomputing = True
        # This thread's copies only (see the module's docstring): the dicts stay as they are.
        _state.throwaway = {
            **outer,
            **{(id(holder), key): clones[id(buffer)] for holder, key, buffer in named},
        }
        for holder, key, buffer in slots:
            holder[key] = clones[id(buffer)]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        previous, outer, slots = self._saved.pop()
        _state.recomputing = previous
        _state.throwaway = outer
        for holder, key, buffer in slots:
            holder[key] = buffer


def buffer_slots(module: nn.Module) -> list[_Slot]:
    """Where every buffer ``module``'s forward uses lives, once each.

    A module with a ``buffer_slots()`` method (a traced stage, which reads the
    model's buffers by name) gives those in place of its own ``_buffers``
    (constants); any other gives its ``_buffers`` entries; then their children
    (a traced stage's BatchNorm and Dropout layers, called as modules).
    """
    by_name, owned = _slots(module)
    slots = {(id(holder), key): (holder, key) for holder, key in (*by_name, *owned)}
    return list(slots.values())


def _slots(module: nn.Module) -> tuple[list[_Slot], list[_Slot]]:
    """:func:`buffer_slots` in two: the slots read by name (``buffer_slots()``), the rest."""
    by_name: dict[tuple[int, str], _Slot] = {}
    owned: dict[tuple[int, str], _Slot] = {}
    stack = [module]
    while stack:
        m = stack.pop()
        own = getattr(m, "buffer_slots", None)
        if callable(own):
            found: list[_Slot] = own()
            into = by_name
        else:
            found = [(m._buffers, k) for k, t in m._buffers.items() if t is not None]
            into = owned
        stack.extend(m.children())
        for holder, key in found:
            into[id(holder), key] = (holder, key)
    return list(by_name.values()), list(owned.values())


def checkpoint(module: nn.Module, *inputs: Any, preserve_rng_state: bool = True) -> Any:
    """Runs ``module(*inputs)`` without keeping its activations; backward recomputes them.

    Built on :func:`torch.utils.checkpoint.checkpoint` with
    ``use_reentrant=False``. The recomputation replays the forward's RNG state
    (Dropout draws the same mask) and autocast state, runs with
    :func:`is_recomputing` True in the thread that runs it, and leaves every
    buffer ``module`` uses (BatchNorm's running statistics, a counter) as
    the forward left it. The recomputation runs the whole forward: torch's early stop
    (at the last tensor backward needs) saved RReLU's noise before RReLU
    filled it in, and backward then read uninitialized memory.

    Under grad mode off (``torch.no_grad()``, evaluation) this is a plain call.

    Args:
        module: the stage (or part of it) to checkpoint.
        *inputs: passed to ``module`` as they are; they need not require grad.
        preserve_rng_state: replay the forward's RNG state in the
            recomputation. Without it, Dropout draws a new mask there and the
            gradients no longer match the forward. torch replays it by
            setting and afterwards restoring the process-wide CPU generator
            (and the device's), unlocked: another thread drawing from it
            meanwhile gets, and loses, numbers from the replayed state. Where
            random layers seed themselves per micro-batch
            (:mod:`pipesched.runtime.stage.rng`), pass False.

    Returns:
        What ``module(*inputs)`` returns.

    Raises:
        ConfigError: ``module`` is not an ``nn.Module``.

    Example:
        >>> layer = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> checkpoint(layer, x).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 3])
    """
    if not isinstance(module, nn.Module):
        raise ConfigTypeError(
            f"checkpoint(module=...) needs an nn.Module, got {type(module).__name__}; "
            "wrap a plain function in an nn.Module so its buffers can be found"
        )

    seen = _ForwardBuffers(module) if torch.is_grad_enabled() else None

    def context_fn() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return nullcontext(), _Recomputation(module, {} if seen is None else seen.values)

    call: Callable[..., Any] = torch.utils.checkpoint.checkpoint
    try:
        output = call(
            module,
            *inputs,
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            context_fn=context_fn,
            # torch saves an operation's inputs before running it, and stopping early
            # raises right there: an input the operation fills in place (RReLU's
            # noise) is then saved unfilled, and backward reads uninitialized memory.
            early_stop=False,
        )
    except RuntimeError as error:
        # torch runs the forward inside a generator, where Python (PEP 479) turns a
        # StopIteration the module raised into this RuntimeError: the module's own is raised.
        if isinstance(error.__cause__, StopIteration) and "raised StopIteration" in str(error):
            raise error.__cause__ from None
        raise
    if seen is not None:
        seen.keep_written()
    return output


_written: set[tuple[int, str]] = set()  # slots some checkpointed forward wrote
_known: set[tuple[int, str]] = set()  # slots a checkpointed forward has run with


class _ForwardBuffers:
    """The buffers a checkpointed forward writes, as they were before it: what its
    recomputation reads (a spectral norm's power-iteration vector, a step counter).

    Why: the recomputation runs in backward, after this forward (and later
    micro-batches') updated them, and torch's checkpoint reads them as they are
    then, so it recomputed another forward (gradients off by 3e-4 to 5e-3 with
    ``spectral_norm``). A slot's first checkpointed forward keeps a copy of every
    buffer; from then on only of those a forward was seen to write.
    """

    def __init__(self, module: nn.Module) -> None:
        by_name, owned = _slots(module)
        self.slots = [*by_name, *owned]
        self.before: dict[tuple[int, str], tuple[Tensor, int]] = {}
        self.values: dict[tuple[int, str], Tensor] = {}
        outer = _state.throwaway
        for holder, key in self.slots:
            slot = (id(holder), key)
            buffer = outer.get(slot, holder[key])
            self.before[slot] = (buffer, buffer._version)
            if slot in _written or slot not in _known:
                self.values[slot] = buffer.detach().clone()

    def keep_written(self) -> None:
        """After the forward: keeps the copies of the buffers it wrote, drops the others."""
        outer = _state.throwaway
        for holder, key in self.slots:
            slot = (id(holder), key)
            was, version = self.before[slot]
            now = outer.get(slot, holder[key])
            if now is not was or now._version != version:
                _written.add(slot)
            elif slot not in _written:
                self.values.pop(slot, None)
            _known.add(slot)


def checkpoint_stop(mode: str, num_microbatches: int) -> int:
    """How many leading micro-batches a stage checkpoints: micro-batch ``i`` iff ``i < stop``.

    ``"except_last"`` keeps the last micro-batch's activations because its
    backward comes right after its forward, where recomputing it saves no
    memory.

    Args:
        mode: one of :data:`CHECKPOINT_MODES`.
        num_microbatches: micro-batches in the mini-batch.

    Returns:
        ``num_microbatches`` for ``"always"``, one less for ``"except_last"``
        (never below 0), 0 for ``"never"``.

    Raises:
        ConfigError: ``mode`` is not one of :data:`CHECKPOINT_MODES`, or
            ``num_microbatches`` is negative.

    Example:
        >>> [checkpoint_stop(mode, 4) for mode in CHECKPOINT_MODES]
        [4, 3, 0]
    """
    valid = ", ".join(repr(m) for m in CHECKPOINT_MODES)
    if not isinstance(mode, str):
        raise ConfigTypeError(
            f"checkpoint mode must be a str, got {type(mode).__name__} {mode!r}; use one of {valid}"
        )
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(f"checkpoint mode {mode!r} is not known; use one of {valid}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ConfigTypeError(
            f"num_microbatches must be an int, got {num_microbatches!r}; "
            "pass the number of micro-batches the batch was split into"
        )
    if num_microbatches < 0:
        raise ConfigError(
            f"num_microbatches must be 0 or more, got {num_microbatches}; "
            "pass the number of micro-batches the batch was split into"
        )
    if mode == "always":
        return num_microbatches
    if mode == "except_last":
        return max(num_microbatches - 1, 0)
    return 0


def check_checkpoint(checkpoint: Any, *, planned: bool) -> str | tuple[str, ...] | None:
    """``Pipeline``'s ``checkpoint=``, checked: None, a mode, or one mode per stage (a tuple).

    Args:
        checkpoint: as given.
        planned: the planner picks the rest (``schedule="auto"``): it searches
            modes per stage itself (and the number of stages).

    Raises:
        ConfigTypeError: neither a str nor a list or tuple of str.
        ConfigError: an unknown mode; or modes per stage under the planner.
    """
    if checkpoint is None or isinstance(checkpoint, str):
        checkpoint_stop(checkpoint or "never", 1)  # checks the mode's name
        return checkpoint
    if not isinstance(checkpoint, list | tuple) or not checkpoint:
        raise ConfigTypeError(
            f"checkpoint must be a mode ({', '.join(map(repr, CHECKPOINT_MODES))}) or a "
            f"non-empty list of one mode per stage, got {checkpoint!r}"
        )
    for mode in checkpoint:
        checkpoint_stop(mode, 1)
    if planned:
        raise ConfigError(
            f"checkpoint={list(checkpoint)!r} gives a mode per stage, but schedule='auto' "
            "chooses the stages (and, under a memory_budget, modes per stage) itself: give "
            "one mode or none, or pick the schedule and balance yourself to give one per stage"
        )
    return tuple(checkpoint)


def stage_stops(
    checkpoint: str | Sequence[str], num_stages: int, num_microbatches: int
) -> tuple[int, ...]:
    """Per stage, how many leading micro-batches it checkpoints (:func:`checkpoint_stop`).

    Args:
        checkpoint: one mode for every stage, or one mode per stage.
        num_stages: the pipeline's stages.
        num_microbatches: micro-batches in the mini-batch.

    Raises:
        ConfigError: as :func:`checkpoint_stop`, or modes for another number of stages.

    Example:
        >>> stage_stops(["always", "never"], 2, 4)
        (4, 0)
    """
    if isinstance(checkpoint, str):
        return (checkpoint_stop(checkpoint, num_microbatches),) * num_stages
    if len(checkpoint) != num_stages:
        raise ConfigError(
            f"checkpoint={list(checkpoint)!r} gives {len(checkpoint)} modes for a pipeline of "
            f"{num_stages} stages: give one mode per stage (or one mode for all)"
        )
    return tuple(checkpoint_stop(mode, num_microbatches) for mode in checkpoint)
