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
        effective_batch: the window's samples: at its end, over all replicas;
            before it, so far on this replica.
        step: steps (calls) done so far; window: windows finished so far.
        lr: the first parameter group's learning rate after this step.
        step_rows: the samples of each step of the window so far, on this replica.
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
    step_rows: tuple[int, ...] = ()


def log_line(result: StepResult, chunks: int, replicas: int, given: int | None) -> str:
    """``step 12 | loss 1.23 | lr 1e-3 | eff. batch 256 (16 x 4 chunks x 4 steps)``.

    The breakdown is the result's own counts: a product only where every
    step had the same rows, split evenly into ``chunks``; else each step's
    rows. With data parallelism: ``x R replicas`` where the replicas' rows
    add up to that, else this replica's rows and the total; before the
    window's end, this replica's rows so far.

    Args:
        result: the step's result.
        chunks: the pipeline's micro-batches per step.
        replicas: data-parallel replicas.
        given: micro-batches the last step was given as a list, or None.
    """
    loss = result.window_loss if result.window_loss is not None else result.loss
    state = " | skipped (inf/NaN)" if result.skipped else ""
    return (
        f"step {result.step} | loss {loss:.4g} | lr {result.lr:.3g} | eff. batch "
        f"{result.effective_batch} ({_breakdown(result, chunks, replicas, given)}){state}"
    )


def _breakdown(result: StepResult, chunks: int, replicas: int, given: int | None) -> str:
    rows = result.step_rows
    steps = len(rows)
    unit = "step" if steps == 1 else "steps"
    if given is not None:  # micro-batches of their own sizes: no product to show
        mine = f"variable micro-batches ({given} in the last step) x {steps} {unit}"
    elif len(set(rows)) == 1 and rows[0] % chunks == 0:
        mine = f"{rows[0] // chunks} x {chunks} chunks x {steps} {unit}"
    else:
        shown = " + ".join(map(str, rows[:8])) + (" + ..." if steps > 8 else "")
        mine = f"{shown} rows in {steps} {unit}"
    if replicas == 1:
        return mine
    if result.window_loss is None:  # mid-window: no reduction yet, only this replica's count
        return f"{mine} so far on this replica, of {replicas} replicas"
    if result.effective_batch == sum(rows) * replicas:
        return f"{mine} x {replicas} replicas"
    return f"{mine} on this replica; {result.effective_batch} rows over {replicas} replicas"
