"""The warning that parameters' gradient hooks run once per micro-batch, issued once per pipeline.

A hook sees each micro-batch's part of the gradient: exact if linear in it, not if
it clamps or normalizes, and an optimizer stepped in a hook breaks later
backwards. Why a warning and not an error: pipesched cannot tell a linear hook from
another. Checked at the first training step with more than one micro-batch.
"""

from __future__ import annotations

import threading
import weakref

from torch import nn

from pipesched.errors import PipeschedWarning, warn_user
from pipesched.runtime.compat.internals import gradient_hooks

__all__ = ["warn_gradient_hooks"]

_SHOWN_NAMES = 4  # parameter names in the message; the rest are counted

_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def warn_gradient_hooks(pipeline: nn.Module, num_microbatches: int) -> None:
    """Warns once if the pipeline's parameters have gradient hooks, at its first step of 2+.

    Args:
        pipeline: the pipeline (its parameters carry the plain model's names).
        num_microbatches: this step's micro-batches.
    """
    if num_microbatches < 2 or pipeline in _checked:
        return
    with _lock:
        if pipeline in _checked:
            return
        _checked.add(pipeline)
    hooked = [
        name for name, p in pipeline.named_parameters() if p.requires_grad and gradient_hooks(p)
    ]
    if hooked:
        warn_user(_message(hooked, num_microbatches), PipeschedWarning)


def _message(names: list[str], num_microbatches: int) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    if len(names) > _SHOWN_NAMES:
        shown += f" and {len(names) - _SHOWN_NAMES} more"
    return (
        f"{len(names)} parameter{'s' if len(names) > 1 else ''} ({shown}) "
        f"{'have' if len(names) > 1 else 'has'} gradient hooks (register_hook or "
        "register_post_accumulate_grad_hook). The pipeline runs backward once per "
        f"micro-batch, so each hook runs {num_microbatches} times a step, on that "
        "micro-batch's part of the gradient, as under gradient accumulation: a hook that is "
        "not linear in the gradient (clamping, normalizing) gives other gradients than the "
        "plain model on the batch, and an optimizer stepped in a hook changes weights that "
        "later micro-batches still need. Change the whole gradient after step() instead "
        "(before optimizer.step(), as clipping does). Shown once per Pipeline."
    )
