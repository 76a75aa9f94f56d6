"""Whether a step's ``loss_fn`` adds up over micro-batches: checked once, on two of them together.

A step calls ``loss_fn`` on each micro-batch and adds the results, weighted by
rows (``loss_fn`` returns a mean) or by one (a sum, with ``num_items=``). That is
the plain model's loss only where ``loss_fn`` is a mean (or sum) of per-sample
terms. An in-batch contrastive loss, a mean over the tokens a mask keeps (their
count differs between micro-batches), or a sum passed without ``num_items=``
are not, and would train another model without a word. Why a check that runs
``loss_fn`` once more and not an analysis: ``loss_fn`` is any Python, and its
value on micro-batches 0 and 1 together against theirs apart tells all three.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipesched.errors import BatchCoupledWarning, warn_user
from pipesched.pipeline.outputs import join_step_outputs
from pipesched.runtime.stage.microbatch import join_outputs
from pipesched.runtime.stage.tree import tensors

__all__ = ["check_separable", "wants_check"]

_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def wants_check(pipe: nn.Module, m: int) -> bool:
    """Whether this step of ``pipe`` should keep two outputs for :func:`check_separable`."""
    return m > 1 and pipe not in _checked


def check_separable(
    pipe: nn.Module,
    batch: Any,
    outputs: dict[int, Any],
    targets: list[Any] | None,
    losses: dict[int, torch.Tensor],
    weights: list[float],
    rows: list[int],
    loss_fn: Callable[..., torch.Tensor],
    last: nn.Module,
    *,
    summed: bool,
) -> None:
    """Warns (once per ``pipe``) where ``loss_fn`` on micro-batches 0 and 1 together is not
    what the step adds up from them apart.

    Runs ``loss_fn`` twice more, without gradients, leaving the random state as it
    was: on micro-batch 0 (a ``loss_fn`` that does not give its value again, one
    that draws or keeps state, is not checked) and on 0 and 1 joined. Outputs that
    do not join (micro-batches of their own lengths), or a ``loss_fn`` that cannot
    take the joined value, are not checked.

    Args:
        pipe: the pipeline (checked once).
        batch: the step's batch, for how its outputs join.
        outputs: the last stage's outputs of micro-batches 0 and 1, detached.
        targets: each micro-batch's target, or None.
        losses: each micro-batch's weighted loss.
        weights: each micro-batch's loss weight.
        rows: each micro-batch's rows.
        loss_fn: the step's.
        last: the last stage (its export says which outputs follow the batch).
        summed: ``loss_fn`` returns a sum (``num_items=`` given), else a mean.
    """
    with _lock:
        if pipe in _checked or 0 not in outputs or 1 not in outputs:
            return
        _checked.add(pipe)
    if not weights[0] or not weights[1]:
        return
    apart = [float(losses[i]) / weights[i] for i in (0, 1)]
    expected = (
        apart[0] + apart[1]
        if summed
        else (rows[0] * apart[0] + rows[1] * apart[1]) / (rows[0] + rows[1])
    )
    first = () if targets is None else (targets[0],)
    try:  # micro-batches of their own lengths may not join: then it is not checked
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what joining says was said by the step
            joined = join_step_outputs(batch, {0: outputs[0], 1: outputs[1]}, rows[:2], last)
            target = () if targets is None else (join_outputs(targets[:2], rows[:2]),)
        devices = sorted({t.device.index for t in tensors(joined) if t.is_cuda})
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            again_loss = loss_fn(outputs[0], *first)
            together_loss = loss_fn(joined, *target)
        # Rounded coarser where the outputs or the loss are half precision (autocast too).
        low = (
            torch.is_autocast_enabled("cpu")
            or torch.is_autocast_enabled("cuda")
            or any(
                t.dtype in (torch.float16, torch.bfloat16)
                for t in (*tensors(joined), again_loss, together_loss)
            )
        )
        again, together = (float(v.detach()) for v in (again_loss, together_loss))
        low = low or (_half_rounded(again) and _half_rounded(together))  # cast back up
    except Exception:  # any loss_fn, any output: what cannot be joined or taken is not judged
        return
    if not _close(again, apart[0], low):
        return  # it does not repeat itself on micro-batch 0 (it draws, or keeps state)
    if _close(together, expected, low):
        return
    kind = "sums" if summed else "row-weighted means"
    warn_user(
        f"loss_fn does not add up over micro-batches: on micro-batches 0 and 1 together "
        f"({rows[0] + rows[1]} rows) it gives {together:.6g}, and the step adds up their "
        f"{kind} apart, {apart[0]:.6g} and {apart[1]:.6g}, to {expected:.6g}. Each micro-batch's "
        "loss is computed alone, so this step's loss and gradients are not the plain model's "
        "on the batch. A loss that mixes the batch's samples (in-batch contrastive) cannot "
        "be split: compute it outside the pipeline on the whole batch's per-sample outputs "
        "(pipe(x) under autograd, then loss.backward()), or use chunks=1. A mean over the "
        "tokens a mask keeps, or a sum: return the sum and pass num_items= (the batch's "
        "count). pipesched ran loss_fn twice more to tell (no gradient, random state kept); "
        "shown once per Pipeline",
        BatchCoupledWarning,
    )


def _close(a: float, b: float, low: bool) -> bool:
    """Equal to rounding (a half-precision output rounds coarser), or both not finite."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= (3e-2 if low else 1e-4) * max(abs(a), abs(b), 1e-12)


def _half_rounded(value: float) -> bool:
    """Whether ``value`` is a bfloat16 or float16 number (a loss computed in half precision
    and cast back up: an fp32 loss is one by chance once in 65536)."""
    return math.isfinite(value) and any(
        float(torch.tensor(value).to(dtype)) == value for dtype in (torch.bfloat16, torch.float16)
    )
