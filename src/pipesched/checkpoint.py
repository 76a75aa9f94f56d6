"""Activation checkpointing: recompute a stage's forward during its backward.

Why not torchgpipe's checkpointing: it is reentrant (a custom autograd
Function whose forward runs under ``no_grad``). Reentrant checkpoints only
reach the parameters through inputs that require grad, so a first stage fed
token ids needs torchgpipe's "phony" tensor trick, and torch's own reentrant
checkpoint silently leaves every parameter's ``.grad`` None there. torch's
non-reentrant checkpoint (saved-tensor hooks) has none of that: parameters get
gradients whatever the inputs, autocast and the RNG state of the forward are
replayed in the recomputation, and backward may come any time later (1F1B).
torchgpipe runs recomputation ahead of the gradient's arrival to overlap it
with the copy of the gradient between devices; we leave that overlap to the
runtime's streams and keep this module a thin, well-tested wrapper.

Why a BatchNorm guard: recomputing a forward repeats its side effects. A
training-mode BatchNorm updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` on every call, so a checkpointed stage would count
each micro-batch twice. During the recomputation we therefore swap each
BatchNorm's running buffers for throwaway clones and put the real ones back
afterwards. (Setting ``track_running_stats=False`` instead, the obvious guard,
does not work: BatchNorm then saves two tensors fewer for backward, and the
non-reentrant checkpoint rejects the recomputation with "A different number of
tensors was saved during the original forward and recomputation".) The output
is unchanged because training-mode BatchNorm normalizes with batch statistics.
Other modules with side effects can ask :func:`is_recomputing`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, Final

import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import ConfigError, ConfigTypeError

__all__ = ["CHECKPOINT_MODES", "checkpoint", "checkpoint_stop", "is_recomputing"]

CHECKPOINT_MODES: Final = ("always", "except_last", "never")
"""Which micro-batches a stage checkpoints; see :func:`checkpoint_stop`."""

_RUNNING_BUFFERS: Final = ("running_mean", "running_var", "num_batches_tracked")

# A BatchNorm, its running buffers, and the clones standing in for them during a recomputation.
_Swap = tuple[_BatchNorm, dict[str, Tensor], dict[str, Tensor]]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.recomputing = False


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


class _Recomputation:
    """Entered around each recomputation of ``module``: sets the flag, guards BatchNorms.

    A class and not a ``@contextmanager`` generator because torch enters the
    same object once per backward pass over the graph (``retain_graph=True``
    gives two), and a generator can only be entered once. Exits run even when
    the recomputation raises, including torch's own early-stop exception,
    which ends every recomputation as soon as the last saved tensor is rebuilt.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._saved: list[tuple[bool, list[_Swap]]] = []

    def __enter__(self) -> None:
        # Clone everything first: if a clone fails, nothing has changed yet.
        swapped = []
        for bn in self.module.modules():
            if isinstance(bn, _BatchNorm):
                originals = {
                    name: buffer
                    for name in _RUNNING_BUFFERS
                    if isinstance(buffer := getattr(bn, name, None), Tensor)
                }
                clones = {name: buffer.clone() for name, buffer in originals.items()}
                swapped.append((bn, originals, clones))
        self._saved.append((_state.recomputing, swapped))
        _state.recomputing = True
        for bn, _, clones in swapped:
            for name, clone in clones.items():
                setattr(bn, name, clone)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        previous, swapped = self._saved.pop()
        _state.recomputing = previous
        for bn, originals, _ in swapped:
            for name, buffer in originals.items():
                setattr(bn, name, buffer)


def checkpoint(module: nn.Module, *inputs: Any, preserve_rng_state: bool = True) -> Any:
    """Runs ``module(*inputs)`` without keeping its activations; backward recomputes them.

    Built on :func:`torch.utils.checkpoint.checkpoint` with
    ``use_reentrant=False``. The recomputation replays the forward's RNG state
    (Dropout draws the same mask) and autocast state, runs with
    :func:`is_recomputing` True in the thread that runs it, and leaves the
    running statistics of every BatchNorm inside ``module`` as the forward
    left them. The recomputation runs the whole forward: torch's early stop
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
            (:mod:`pipesched.rng`), pass False.

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
            "wrap a plain function in an nn.Module so its BatchNorms can be found"
        )

    def context_fn() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return nullcontext(), _Recomputation(module)

    call: Callable[..., Any] = torch.utils.checkpoint.checkpoint
    return call(
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
