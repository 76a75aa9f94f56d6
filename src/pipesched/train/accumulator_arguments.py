"""The GradientAccumulator's arguments, checked before its first window."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipesched.errors import ConfigError, ConfigTypeError, check_number, check_positive_int
from pipesched.runtime import replacement

if TYPE_CHECKING:
    from pipesched.pipeline import Pipeline

__all__ = ["checked_arguments"]


def checked_arguments(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    accumulation_steps: int,
    max_grad_norm: float | None,
    lr_scheduler: Any,
) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and schedulers as lists, once every argument is one the window can use.

    Raises:
        ConfigError, ConfigTypeError: naming the argument, the value seen and the fix.
    """
    check_positive_int("accumulation_steps", accumulation_steps)
    if max_grad_norm is not None:
        check_number("max_grad_norm", max_grad_norm, "a number or None")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ConfigError(f"max_grad_norm must be > 0, got {max_grad_norm!r}; use None to not clip")
    optimizers = list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]
    if not optimizers:
        raise ConfigError("optimizer is an empty list; give one optimizer or one per stage")
    for k, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            where = "optimizer" if len(optimizers) == 1 else f"optimizer[{k}]"
            raise ConfigTypeError(
                f"{where} must be a torch.optim.Optimizer, got {type(opt).__name__} "
                f"{opt!r}; e.g. torch.optim.SGD(pipe.parameters(), lr=0.1)"
            )
    _check_optimizers_train(pipe, optimizers)
    for k, opt in enumerate(optimizers):
        if needs := _needs(type(opt).step)[1:]:  # (the class's: a scheduler wraps opt.step)
            where = "optimizer" if len(optimizers) == 1 else f"optimizer[{k}]"
            raise ConfigError(
                f"{where} ({type(opt).__name__}) steps with {', '.join(needs)} "
                f"(step({', '.join(needs)}): it evaluates the model again itself), and the "
                "window end steps optimizers with no argument, once per window of "
                "pipeline steps: use an optimizer that steps without one (SGD, AdamW, ...)"
            )
    schedulers = (
        []
        if lr_scheduler is None
        else list(lr_scheduler)
        if isinstance(lr_scheduler, Sequence)
        else [lr_scheduler]
    )
    _check_schedulers(schedulers)
    return optimizers, schedulers


def _check_optimizers_train(pipe: Pipeline, optimizers: list[torch.optim.Optimizer]) -> None:
    """Raises ConfigError for an optimizer that holds parameters, none of them the pipeline's.

    Why: such an optimizer (built over a copy of the model, or another model) steps
    nothing the pipeline trains, and the run would go on silently untrained.
    """
    ours = {id(p) for p in pipe.parameters()}
    for k, optimizer in enumerate(optimizers):
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if held and not any(id(p) in ours or id(replacement(p)) in ours for p in held):
            where = "optimizer" if len(optimizers) == 1 else f"optimizer[{k}]"
            raise ConfigError(
                f"{where} holds {len(held)} parameters, none of them this pipeline's "
                "(pipe.parameters()): it would step nothing the pipeline trains. Build it "
                "over pipe.parameters() (one built over a copy of the model, e.g. after "
                "copy.deepcopy, holds the copy's)"
            )


def _check_schedulers(schedulers: list[Any]) -> None:
    """Raises ConfigError for a scheduler the window end cannot step with no argument.

    Why before the first window: ``ReduceLROnPlateau.step(metrics)`` raised at every
    window end, and the retried end (``acc.flush()``) raised again, for good.
    """
    for k, scheduler in enumerate(schedulers):
        where = "lr_scheduler" if len(schedulers) == 1 else f"lr_scheduler[{k}]"
        step = getattr(scheduler, "step", None)
        if not callable(step):
            raise ConfigTypeError(
                f"{where} must have a step() method (a torch.optim.lr_scheduler), got "
                f"{type(scheduler).__name__} {scheduler!r}"
            )
        if needs := _needs(step):
            raise ConfigError(
                f"{where} ({type(scheduler).__name__}) steps with {', '.join(needs)} "
                f"(step({', '.join(needs)})), and the window end steps schedulers with no "
                "argument: leave it out of lr_scheduler= and step it yourself, e.g. "
                f"`if result.stepped: scheduler.step({needs[0]})` after acc.step"
            )


def _needs(step: Any) -> list[str]:
    """The arguments ``step`` cannot be called without (none where it has no signature)."""
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let it run
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.default is p.empty and p.kind in kinds]
