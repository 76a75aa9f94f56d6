"""Effective batch arithmetic: the accumulation steps that reach a target batch, and their cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipesched.errors import ConfigError, ConfigTypeError

__all__ = ["BatchChoice", "BatchPlan", "plan_accumulation"]


@dataclass(frozen=True)
class BatchChoice:
    """A whole number of accumulation steps and the effective batch it gives.

    ``lr_linear`` and ``lr_sqrt`` are the learning rate tuned for the target
    batch, rescaled to this batch (linear and square-root scaling rules), or
    just the factors when no learning rate was given.
    """

    accumulation_steps: int
    effective_batch: int
    lr_linear: float
    lr_sqrt: float


@dataclass(frozen=True)
class BatchPlan:
    """The accumulation steps that reach ``target``, exact or the nearest whole choices."""

    target: int
    micro_batch: int
    chunks: int
    replicas: int
    exact_steps: float
    choices: tuple[BatchChoice, ...]
    lr: float | None

    @property
    def per_step(self) -> int:
        """Samples one pipeline step takes over all replicas."""
        return self.micro_batch * self.chunks * self.replicas

    @property
    def whole(self) -> bool:
        """Whether ``target`` is a whole number of steps."""
        return self.exact_steps == int(self.exact_steps)

    def describe(self) -> str:
        """The plan in words, as ``pipesched batch`` prints it."""
        head = (
            f"target effective batch {self.target} = micro-batch {self.micro_batch} x "
            f"{self.chunks} chunks x {self.replicas} replicas x accumulation steps; one step "
            f"takes {self.per_step} samples"
        )
        if self.whole:
            return f"{head}: accumulation_steps={int(self.exact_steps)} gives it exactly."
        unit = "lr" if self.lr is not None else "lr x"
        lines = [
            f"{head}: {self.target} / {self.per_step} = {self.exact_steps:.4g} accumulation "
            "steps is not whole. Nearest whole choices:"
        ]
        for c in self.choices:
            ratio = c.effective_batch / self.target
            lines.append(
                f"  accumulation_steps={c.accumulation_steps}: effective batch "
                f"{c.effective_batch} ({ratio:.3g}x the target); {unit} {c.lr_linear:.4g} "
                f"(linear scaling) or {c.lr_sqrt:.4g} (square-root scaling)"
            )
        return "\n".join(lines)


def plan_accumulation(
    target: int, micro_batch: int, *, chunks: int = 1, replicas: int = 1, lr: float | None = None
) -> BatchPlan:
    """The accumulation steps for an effective batch of ``target`` samples.

    effective batch = micro_batch x chunks x replicas x accumulation_steps.

    Args:
        target: the effective batch wanted.
        micro_batch: samples per micro-batch.
        chunks: micro-batches per pipeline step.
        replicas: data-parallel replicas.
        lr: the learning rate tuned for ``target``; rescaled for each choice.

    Raises:
        ConfigError: a count is not a positive integer.

    Example:
        >>> plan = plan_accumulation(3072, 10, replicas=240)
        >>> plan.exact_steps, [c.accumulation_steps for c in plan.choices]
        (1.28, [1, 2])
    """
    for name, value in (
        ("target", target),
        ("micro_batch", micro_batch),
        ("chunks", chunks),
        ("replicas", replicas),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}")
        if value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    per_step = micro_batch * chunks * replicas
    exact = target / per_step
    steps = sorted({max(1, math.floor(exact)), max(1, math.ceil(exact))})
    base = 1.0 if lr is None else lr
    choices = tuple(
        BatchChoice(
            s, s * per_step, base * s * per_step / target, base * math.sqrt(s * per_step / target)
        )
        for s in steps
    )
    return BatchPlan(target, micro_batch, chunks, replicas, exact, choices, lr)
