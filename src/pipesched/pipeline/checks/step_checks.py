"""One training step's checks, in their order: before its cut, before its run, after its run.

The one owner of what a step checks of the user's model, call and ``loss_fn``
(each check is its own module beside this one); :meth:`Pipeline._train` only
runs the step between them. Every check after the run abandons the step where
it raises (a warning made an error under ``-W error``), so nothing is left half
kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipesched.errors import ConfigError, PipeschedWarning, warn_user
from pipesched.partition.call import Call
from pipesched.pipeline.batches import StepBatches
from pipesched.pipeline.checks.buffer_updates import warn_buffer_updates, watch_buffers
from pipesched.pipeline.checks.coupled_outputs import (
    coupled_paths,
    warn_coupled,
    warn_uneven_targets,
)
from pipesched.pipeline.checks.gradient_hooks import warn_gradient_hooks
from pipesched.pipeline.checks.micro_batch_norm import warn_micro_batch_norm
from pipesched.pipeline.checks.separable_loss import check_separable, wants_check
from pipesched.pipeline.stages import Stages
from pipesched.runtime.engine import PendingStep, RunResult
from pipesched.runtime.passes import StepInputs

__all__ = ["StepChecks"]


class StepChecks:
    """The checks of one training step of ``pipe`` over ``model`` (the user's module).

    Constructed before the step's cut: refuses a step with nothing to train and
    tells a ``num_items_in_batch`` passed without ``num_items=``.

    Args:
        pipe: the Pipeline: what "once per Pipeline" warnings key on.
        model: the user's model.
        batches: the step's micro-batches.
        summed: the step was given ``num_items=`` (``loss_fn`` returns sums).
    """

    def __init__(self, pipe: nn.Module, model: nn.Module, batches: StepBatches, *, summed: bool):
        # The model's own parameters: on a mesh it holds other ranks' too (on meta, frozen or not).
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                "the training step has nothing to train: no parameter of the model requires "
                "grad (it has none, or all were frozen with requires_grad_(False)), so "
                "backward would compute nothing (the plain model's loss.backward() raises "
                "here too). Unfreeze the parameters to train, or evaluate with pipe(x) under "
                "torch.no_grad()"
            )
        self.pipe, self.model, self.batches, self.summed = pipe, model, batches, summed
        self.m = m = len(batches.inputs)
        call = batches.inputs[0]
        self.passed = isinstance(call, Call) and call.kwargs.get("num_items_in_batch") is not None
        self._watch: Any = None
        if self.passed and not summed and m > 1:
            warn_user(
                "the call passes num_items_in_batch, so a Hugging Face model returns each "
                "micro-batch's summed loss divided by it, but the step was given no "
                "num_items=: it takes loss_fn's values as means and averages them by rows "
                f"over the {m} micro-batches, a loss {m} times too small or so. Pass "
                "num_items_in_batch=1 in the call and num_items=<the batch's item count> to "
                "the step (guide: 'A model that computes its own loss')",
                PipeschedWarning,
            )

    def before_run(self, stages: Stages) -> int:
        """Tells what the cut ``stages`` show, starts watching buffers; returns how many
        last-stage outputs the run should keep for :meth:`after_run`."""
        pipe, batches, m = self.pipe, self.batches, self.m
        warn_micro_batch_norm(pipe, batches.rows, stages.cut.traced)
        warn_gradient_hooks(pipe, m)
        traced = stages.cut.traced
        if m > 1 and traced is not None:
            warn_coupled(pipe, coupled_paths(traced, self.passed), m)
            if not (self.passed or self.summed):  # (with num_items, loss_fn returns sums)
                warn_uneven_targets(pipe, traced, batches.inputs, batches.rows)
        self._watch = watch_buffers(pipe, self.model, m)
        return 2 if wants_check(pipe, m) else 0

    def after_run(
        self,
        result: RunResult,
        step: StepInputs,
        loss_fn: Callable[..., torch.Tensor],
        last: nn.Module,
        pending: PendingStep,
    ) -> None:
        """The checks of what the run did (``last``: the last stage); the step ``pending``
        is abandoned where one raises."""
        batches = self.batches
        try:  # a warning made an error (-W error) must not leave the step half kept
            warn_buffer_updates(self.pipe, self._watch, self.model, self.m)
            if result.outputs:  # the last stage's rank, on the first step of two or more
                check_separable(
                    self.pipe,
                    batches.inputs[0],
                    result.outputs,
                    batches.targets,
                    result.losses,
                    step.loss_weights,
                    batches.rows,
                    loss_fn,
                    last,
                    summed=self.summed,
                )
        except BaseException as error:
            pending.abandon(error)
            raise
