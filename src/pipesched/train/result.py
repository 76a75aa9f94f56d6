"""What one accumulator step did, and its log line."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepResult", "log_line"]


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`GradientAccumulator.step` did.

    Attributes:
        loss: this step's loss, normalized by its own item count (NaN for 0 items).
        window_loss: at a window's end, the window's loss normalized by its item count.
        stepped: the window ended and the optimizer stepped.
        skipped: the window ended with an inf/NaN gradient and nothing stepped.
        grad_norm: at a stepped window's end, the global gradient norm before clipping.
        effective_batch: samples in the window so far, over all replicas.
        step: steps (calls) done so far; window: windows finished so far.
        lr: the first parameter group's learning rate after this step.
    """

    loss: float
    window_loss: float | None
    stepped: bool
    skipped: bool
    grad_norm: float | None
    effective_batch: int
    step: int
    window: int
    lr: float


def log_line(result: StepResult, chunks: int, steps: int, replicas: int, given: int | None) -> str:
    """``step 12 | loss 1.23 | lr 1e-3 | eff. batch 256 (16 x 4 chunks x 4 steps)``.

    Args:
        result: the step's result.
        chunks: the pipeline's micro-batches per step.
        steps: the steps the shown loss covers (the window's, or so far).
        replicas: data-parallel replicas.
        given: micro-batches the last step was given as a list, or None.
    """
    loss = result.window_loss if result.window_loss is not None else result.loss
    micro = result.effective_batch / max(1, chunks * max(1, steps) * replicas)
    breakdown = f"{micro:g} x {chunks} chunks x {steps} steps"
    if given is not None:  # micro-batches of their own sizes: no product to show
        breakdown = f"variable micro-batches ({given} in the last step) x {steps} steps"
    if replicas > 1:
        breakdown += f" x {replicas} replicas"
    state = " | skipped (inf/NaN)" if result.skipped else ""
    return (
        f"step {result.step} | loss {loss:.4g} | lr {result.lr:.3g} | eff. batch "
        f"{result.effective_batch} ({breakdown}){state}"
    )
