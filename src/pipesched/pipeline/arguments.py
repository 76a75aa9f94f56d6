"""Checks of the public API's arguments: a wrong type is a TypeError, a wrong value a ValueError.

Python's own convention (``range("4")`` is a TypeError, ``range(-1)[0]`` an
IndexError) made concrete for pipesched: :class:`~pipesched.errors.ConfigTypeError`
when an argument has the wrong type or a call the wrong number of arguments,
:class:`~pipesched.errors.ConfigError` when the type is right but the value is
not. Each check runs before any work, so a wrong argument never surfaces as an
``AttributeError`` or ``KeyError`` from deep inside a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipesched.errors import (
    ConfigError,
    ConfigTypeError,
    PipeschedWarning,
    check_number,
    check_positive_int,
    warn_user,
)
from pipesched.runtime.grad_backup import BACKUPS
from pipesched.runtime.placement import check_not_freed
from pipesched.runtime.stage.microbatch import batch_size
from pipesched.runtime.stage.tree import tensors

__all__ = [
    "check_grad_backup",
    "check_inputs",
    "check_loss",
    "check_module",
    "check_pipeline",
    "check_step",
    "warn_host_backup_on_cpu",
]


def check_module(name: str, value: object) -> nn.Module:
    """``value`` if it is an ``nn.Module``, else a ConfigTypeError naming ``name``."""
    if not isinstance(value, nn.Module):
        raise ConfigTypeError(
            f"{name} must be an nn.Module, got {type(value).__name__}; wrap a plain "
            "function in an nn.Module whose forward calls it"
        )
    return value


def check_pipeline(
    module: object,
    chunks: object,
    balance: object,
    num_stages: object,
    memory_budget: object,
) -> None:
    """The types (and ranges) of :class:`~pipesched.Pipeline`'s arguments that need no model.

    ``devices``, ``checkpoint``, ``schedule``, ``mesh``, ``split_points`` and
    ``example_inputs`` are checked where they are read.

    Raises:
        ConfigTypeError: an argument has the wrong type.
        ConfigError: ``chunks`` or ``num_stages`` is below 1, ``memory_budget``
            is not positive, or an earlier mesh Pipeline freed ``module``'s layers
            on this rank (:func:`~pipesched.runtime.placement.check_not_freed`).
    """
    checked = check_module("module", module)
    check_not_freed(checked)
    warn_sequence_first(checked)
    check_positive_int("chunks", chunks)
    if balance is not None and not isinstance(balance, str | list | tuple):
        raise ConfigTypeError(
            f"balance must be a list of layers per stage (e.g. [2, 1]) or the name of a "
            f"balancing mode ('params', 'time', 'memory', 'schedule'); got "
            f"{type(balance).__name__} {balance!r}"
        )
    if num_stages is not None:
        check_positive_int("num_stages", num_stages)
    if memory_budget is not None:
        check_number("memory_budget", memory_budget, "a number of bytes per worker")
        if not memory_budget > 0:  # type: ignore[operator]
            raise ConfigError(
                f"memory_budget must be a positive number of bytes per worker, got "
                f"{memory_budget!r}; e.g. memory_budget=8 * 2**30, or leave it out for no limit"
            )


def check_grad_backup(grad_backup: object) -> None:
    """``Pipeline(grad_backup=...)``: one of :data:`~pipesched.runtime.grad_backup.BACKUPS`.

    Raises:
        ConfigTypeError: not a string.
        ConfigError: not one of the names; the message lists them.
    """
    if not isinstance(grad_backup, str):
        raise ConfigTypeError(
            f"grad_backup must be a string, one of {', '.join(map(repr, BACKUPS))}; got "
            f"{type(grad_backup).__name__} {grad_backup!r}"
        )
    if grad_backup not in BACKUPS:
        raise ConfigError(
            f"grad_backup={grad_backup!r} is not a place pipesched keeps gradients; use "
            f"'device' (set aside, no copy), 'host' (CUDA gradients copied to pinned host "
            f"memory) or 'disk' (copied to a temporary file in TMPDIR)"
        )


def warn_host_backup_on_cpu(grad_backup: str, devices: Sequence[torch.device]) -> None:
    """Warns (:class:`~pipesched.errors.PipeschedWarning`) where ``grad_backup="host"`` is
    asked of workers that are all CPUs: their gradients are in host memory already."""
    if grad_backup == "host" and all(d.type == "cpu" for d in devices):
        warn_user(
            "grad_backup='host' copies CUDA gradients to host memory, but every worker of "
            "this Pipeline is a CPU: its gradients stay set aside as under 'device' (two "
            "buffers during a window's later steps); use grad_backup='disk' to hold one",
            PipeschedWarning,
        )


def warn_sequence_first(module: nn.Module) -> None:
    """Warns when ``module`` holds layers that take the batch in dim 1 (``batch_first=False``).

    Why: torch's ``nn.MultiheadAttention``, ``nn.Transformer*`` layers and
    ``nn.RNN``/``LSTM``/``GRU`` default to (sequence, batch, ...) inputs, and a
    pipeline cuts every input along dim 0: fed that way, a micro-batch is a
    slice of the sequence, and attention or recurrence sees only the slice.
    Nothing fails; every number differs from the plain model's. A warning,
    not an error: a model that transposes its (batch, ...) input before
    those layers is right.
    """
    names: list[str] = []
    for name, m in module.named_modules():
        if getattr(m, "batch_first", None) is False and not any(  # not inside one named
            name.startswith(f"{outer}.") for outer in names
        ):
            names.append(name)
    if not names:
        return
    names = [n or type(module).__name__ for n in names]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warn_user(
        f"module has layers built with batch_first=False ({shown}): they take (sequence, "
        "batch, ...) inputs, while a pipeline cuts every input along dim 0 into "
        "micro-batches. If dim 0 of your input is the sequence, each micro-batch is a slice "
        "of it and attention or recurrence sees only that slice: outputs and gradients "
        "differ from the plain model's. Build them with batch_first=True and pass (batch, "
        "sequence, ...) inputs; if the model transposes a (batch, ...) input before them, "
        "all is well: warnings.filterwarnings('ignore', message='module has layers built "
        "with batch_first=False')",
        PipeschedWarning,
    )


def check_step(inputs: Any, loss_fn: object, num_items: object) -> None:
    """The arguments of ``Pipeline.step`` and ``Pipeline.accumulate``.

    :func:`check_loss`, then :func:`check_inputs` on ``inputs``.

    Raises:
        ConfigTypeError: ``loss_fn`` is not callable, or ``num_items`` not a number.
        ConfigError: ``inputs`` holds no tensor with a batch dimension, or a
            tensor of it requires grad; or grad mode is off (nothing would
            get a gradient).
    """
    check_loss(loss_fn, num_items)
    check_inputs(inputs, "inputs")


def check_loss(loss_fn: object, num_items: object) -> None:
    """A training step's grad mode, ``loss_fn`` and ``num_items``.

    Raises:
        ConfigTypeError: ``loss_fn`` is not callable, or ``num_items`` not a number.
        ConfigError: grad mode is off (nothing would get a gradient).
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise ConfigError(
            "pipe.step and pipe.accumulate run backward, but grad mode is off here "
            "(inside torch.no_grad() or torch.inference_mode()): call them outside that "
            "block, or evaluate with pipe(x)"
        )
    if not callable(loss_fn):
        raise ConfigTypeError(
            f"loss_fn must be a callable returning a scalar tensor, got "
            f"{type(loss_fn).__name__} {loss_fn!r}; e.g. "
            "loss_fn=torch.nn.functional.mse_loss"
        )
    if num_items is not None and (
        isinstance(num_items, bool) or not isinstance(num_items, int | float | torch.Tensor)
    ):
        raise ConfigTypeError(
            f"num_items must be a number (or a one-element tensor) or None, got "
            f"{type(num_items).__name__} {num_items!r}"
        )


def check_inputs(inputs: Any, name: str) -> int:
    """The batch size of stage 0's input ``inputs`` (called ``name`` in errors).

    Raises:
        ConfigError: ``inputs`` holds no tensor with a batch dimension, two
            of them differ on dim 0, or one requires grad or is on the meta device.
    """
    rows = batch_size(inputs, name)  # stage 0 needs a tensor with a batch dimension to cut
    if any(t.is_meta for t in tensors(inputs)):
        raise ConfigError(
            f"{name} is on the meta device: it has a shape but no values to train on; "
            "pass the batch itself (a model may be built on meta, its data may not)"
        )
    if any(t.requires_grad for t in tensors(inputs)):
        # step's backward ends at stage 0's input: it fills the parameters' .grad,
        # never the input's; silently returning no x.grad would be worse than this.
        raise ConfigError(
            f"{name} requires grad, but step computes the parameters' gradients only: its "
            "backward stops at the pipeline's input and never fills x.grad: pass "
            "x.detach() instead, or, to get x's gradient too, use pipe(x), which is "
            "autograd-transparent: loss_fn(pipe(x), y).backward()"
        )
    return rows


def check_target(target: Any, name: str) -> None:
    """Raises ConfigError where a tensor of ``target`` (called ``name``) requires grad.

    Why refused: each micro-batch's backward would run through the target's
    autograd history (a teacher's output), once per micro-batch over one shared
    graph, and write the teacher's ``.grad`` from inside the step, outside its
    transaction; plain PyTorch runs that history once.
    """
    if any(t.requires_grad for t in tensors(target)):
        raise ConfigError(
            f"{name} requires grad (it carries autograd history, e.g. a teacher model's "
            "output): a step runs one backward per micro-batch, which would each go "
            "through that history; pass its .detach() (to train the model it came from, "
            "compute that loss outside the pipeline)"
        )
