"""How a pipeline's two kinds of call run: forward only (``pipe(x)``) and a training step.

The Pipeline checks the arguments and holds the cuts; this module turns one
call into micro-batches, picks the cut that fits them, runs them through the
cut's stepper (one transaction, seeded), and gathers what comes back.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pipesched.errors import BatchCoupledWarning, ConfigError, warn_user
from pipesched.partition.call import Call, one_call
from pipesched.partition.per_sample import leaf_paths, per_sample_flags
from pipesched.partition.traced_stage import TracedStage
from pipesched.pipeline.batches import StepBatches
from pipesched.pipeline.checks.coupled_outputs import coupled_flags, coupled_paths
from pipesched.pipeline.checks.gradient_hooks import warn_gradient_hooks
from pipesched.pipeline.checks.micro_batch_norm import warn_micro_batch_norm
from pipesched.runtime.distributed import DistributedRuntime, broadcast_loss
from pipesched.runtime.passes import StepInputs
from pipesched.runtime.stage.microbatch import batch_size, join_outputs, scatter
from pipesched.runtime.stage.recompute import stage_stops
from pipesched.schedule import Timeline

if TYPE_CHECKING:
    from pipesched.pipeline.facade import Pipeline

__all__ = ["gather_timeline", "run_forward", "run_training"]


def run_forward(pipe: Pipeline, batch: Any) -> Any:
    """``pipe``'s output on ``batch`` (stage 0's input), micro-batch by micro-batch.

    With a mesh: the output on the last stage's rank, None on the others.

    Raises:
        ConfigError: a mesh with gradients enabled (train with ``step``).
    """
    if pipe.mesh is not None and torch.is_grad_enabled():
        raise ConfigError(
            "with a mesh, pipe(x) runs forward only: call it under torch.no_grad() "
            "(evaluation), and train with pipe.step or GradientAccumulator.step, whose "
            "backward crosses the ranks"
        )
    micro = scatter(batch, pipe.chunks)
    assembly = pipe._assembly_for(batch if isinstance(batch, Call) else None, micro)
    if assembly.unloaded is not None:
        assembly.unloaded.check("pipe(x)")
    rows = [batch_size(m) for m in micro]
    warn_micro_batch_norm(pipe, rows)
    stop = stage_stops(pipe.checkpoint, pipe.num_stages, len(micro))
    run = assembly.stepper.run(
        pipe.schedule_for,
        lambda seed: StepInputs(micro, checkpoint_stop=stop, seed=seed),
        detach=False,
    )
    pipe.last_timeline = run.timeline
    if pipe.mesh is not None and pipe.placement[-1] != pipe.mesh.pp_rank:
        return None
    # Hugging Face's contract: given num_items_in_batch, a model's loss is its sum over
    # the micro-batch's items divided by that count, a share of the batch's: they add up.
    summed = isinstance(batch, Call) and batch.kwargs.get("num_items_in_batch") is not None
    outputs = [run.outputs[i] for i in range(len(micro))]
    last = assembly.stages[-1]
    fixed: list[str] = []
    coupled: list[str] = []
    if isinstance(last, TracedStage):  # the export says which outputs follow the batch
        paths = leaf_paths(outputs[0])
        if len(paths) == len(flags := per_sample_flags(last.traced)):
            fixed = [path for path, flag in zip(paths, flags, strict=True) if not flag]
        if len(paths) == len(mixed := coupled_flags(last.traced)):
            coupled = [path for path, flag in zip(paths, mixed, strict=True) if flag]
    return join_outputs(outputs, rows, "sum" if summed else "mean", fixed, coupled)


def run_training(
    pipe: Pipeline,
    batches: StepBatches,
    loss_fn: Callable[..., torch.Tensor],
    *,
    summed: bool,
    scale: float,
) -> torch.Tensor:
    """Forward and backward of every micro-batch of ``batches`` in the schedule's order.

    Micro-batch i's loss weighs ``scale`` (``loss_fn`` returns a sum) or
    ``scale * rows_i`` (a mean). Returns the weighted sum, on every rank.
    Sets ``pipe.last_timeline`` and ``pipe.last_step_seconds`` (this call's wall time).
    """
    begin = time.perf_counter()
    if not any(p.requires_grad for p in pipe.parameters()):  # every rank holds every name
        raise ConfigError(
            "the training step has nothing to train: no parameter of the model requires "
            "grad (it has none, or all were frozen with requires_grad_(False)), so backward "
            "would compute nothing (the plain model's loss.backward() raises here too). "
            "Unfreeze the parameters to train, or evaluate with pipe(x) under torch.no_grad()"
        )
    m = len(batches.inputs)
    assembly = pipe._assembly_for(one_call(batches.inputs), batches.inputs)
    if assembly.unloaded is not None:
        assembly.unloaded.check("the training step")
    warn_micro_batch_norm(pipe, batches.rows)
    warn_gradient_hooks(pipe, m)
    traced = assembly.plan.traced
    if m > 1 and traced is not None:
        _warn_coupled(pipe, coupled_paths(traced), m)
    weights = [scale if summed else scale * rows for rows in batches.rows]

    def make_step(seed: int | None) -> StepInputs:
        return StepInputs(
            inputs=batches.inputs,
            targets=batches.targets,
            loss_fn=loss_fn,
            loss_weights=weights,
            checkpoint_stop=stage_stops(pipe.checkpoint, pipe.num_stages, m),
            seed=seed,
        )

    run = assembly.stepper.run(pipe.schedule_for, make_step, detach=True)
    pipe.last_timeline = run.timeline
    if pipe.mesh is None:
        total = torch.stack([run.losses[i] for i in range(m)]).sum()
    else:
        total = broadcast_loss(run.losses, m, pipe.placement[-1], pipe.mesh)
    pipe.last_step_seconds = time.perf_counter() - begin
    return total


_warned: weakref.WeakSet[Pipeline] = weakref.WeakSet()
_lock = threading.Lock()


def _warn_coupled(pipe: Pipeline, paths: list[str], m: int) -> None:
    """Warns once per ``pipe`` that its loss_fn gets batch-coupled outputs per micro-batch."""
    if not paths or pipe in _warned:
        return
    with _lock:
        if pipe in _warned:
            return
        _warned.add(pipe)
    shown = ", ".join(f"output{p}" for p in paths)
    warn_user(
        f"{shown} of the model mix{'es' if len(paths) == 1 else ''} rows of different samples "
        "(each sample's value depends on the other samples of the batch: an in-batch "
        f"contrastive loss or a similarity matrix over the batch); this step runs {m} "
        "micro-batches, so loss_fn receives each micro-batch's value, not the plain model's "
        "on the batch, and a loss or gradient computed from it is another model's. Fix: have "
        "the model return per-sample outputs (embeddings) only, and compute the coupled loss "
        "outside the pipeline on the whole batch's (pipe(x) under autograd, then "
        "loss.backward()), or use chunks=1. Shown once per Pipeline",
        BatchCoupledWarning,
    )


def gather_timeline(pipe: Pipeline, *, everywhere: bool = False) -> Timeline | None:
    """The last step's timeline with every rank's actions (see :meth:`Pipeline.gather_timeline`).

    ``everywhere``: on every pp rank, not only on rank 0.
    """
    if pipe.mesh is None or pipe.last_timeline is None:
        return pipe.last_timeline
    runtime = pipe._runtime
    if not isinstance(runtime, DistributedRuntime):  # pragma: no cover - set together
        raise ConfigError("gather_timeline needs the distributed runtime")
    return runtime.gather_timeline(pipe.last_timeline, everywhere=everywhere)
