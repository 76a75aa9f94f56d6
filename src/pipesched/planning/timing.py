"""Each layer timed as the runtime runs it: an engine with one stage per layer, on one worker.

Why not the per-operation profile ``balance="time"`` uses: timed alone, an
operation leaves out what a stage's pass spends around it (autograd's work per
node, gradient accumulation, a large loss), and not evenly
(docs/partitioning.md gives the measurements). Nothing of the model changes:
gradients, buffers and the random generators are put back.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipesched.partition import plan_partition
from pipesched.partition.call import Call
from pipesched.partition.model_cut import draw_places
from pipesched.partition.trace import TracedModel
from pipesched.runtime.engine import Engine, Workers
from pipesched.runtime.passes import StepInputs
from pipesched.runtime.stage.tree import tensors
from pipesched.schedule import BACKWARD, FORWARD, WEIGHT, Action, Schedule

__all__ = ["LayerTimes", "run_layer_times"]

STEPS = 3
"""Measured steps, after one to warm up."""


@dataclass(frozen=True)
class LayerTimes:
    """Per layer of the stage graph, medians of its actions in pipesched's runtime (seconds).

    Args:
        forward: F.
        backward: the whole backward, as GPipe and 1F1B run it.
        backward_input, backward_weight: B and W, as zero-bubble schedules
            run them (apart, they can cost more than together).
    """

    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]


def run_layer_times(
    module: nn.Module,
    example_inputs: Any,
    num_layers: int,
    device: torch.device,
    num_threads: int | None = None,
    traced: TracedModel | None = None,
) -> LayerTimes:
    """Each layer of the stage graph timed in pipesched's runtime, backward whole and split.

    Args:
        module: the model (an ``nn.Sequential``, or one that traces).
        example_inputs: one micro-batch: a tuple of positional arguments or a Call.
        num_layers: the layers of its stage graph (one stage each).
        device: where every stage runs.
        num_threads: intra-op threads on a CPU (a pipeline worker's share).
        traced: the model's trace on ``example_inputs`` (not traced again), or None.

    Raises:
        Exception: whatever the model raises; the caller falls back to the profile.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            whole = _timed(module, example_inputs, num_layers, device, False, num_threads, traced)
            split = _timed(module, example_inputs, num_layers, device, True, num_threads, traced)
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
    forward = [
        statistics.median(a + b) for a, b in zip(whole[FORWARD], split[FORWARD], strict=True)
    ]
    return LayerTimes(
        forward,
        [statistics.median(t) for t in whole[BACKWARD]],
        [statistics.median(t) for t in split[BACKWARD]],
        [statistics.median(t) if t else 0.0 for t in split[WEIGHT]],
    )


def _timed(
    module: nn.Module,
    example_inputs: Any,
    num_layers: int,
    device: torch.device,
    split: bool,
    num_threads: int | None,
    traced: TracedModel | None,
) -> dict[str, list[list[float]]]:
    """Each stage's measured durations per kind of action, over :data:`STEPS` steps."""
    call = Call.of(example_inputs)
    sequential = isinstance(module, nn.Sequential)
    schedule = _one_worker(num_layers, split)
    threads = torch.get_num_threads() if num_threads is None else num_threads
    previous = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)  # the one worker gets what a pipeline's worker gets
    try:
        cut = plan_partition(
            module,
            num_stages=num_layers,
            devices=[device] * num_layers,
            schedule=schedule,
            num_microbatches=1,
            balance=[1] * num_layers,
            example_inputs=call.args if sequential else call,
            num_threads=threads,
            traced=traced,
        )
    finally:
        torch.set_num_threads(previous)
    stages = cut.build(module, [device] * num_layers)
    for stage in stages:
        stage.to(device)
    engine = Engine(
        stages,
        range(num_layers),
        {},
        Workers((device,), (0,) * num_layers, threads),
        model=module,
        extra_names=draw_places(stages),
    )
    engine.runtime.passes.whole_backward = False  # B and W as split schedules split them
    batch = call.args[0] if sequential else call
    step = StepInputs([batch], loss_fn=_summed, loss_weights=[1.0])
    durations: dict[str, list[list[float]]] = {
        k: [[] for _ in range(num_layers)] for k in (FORWARD, BACKWARD, WEIGHT)
    }
    for run in range(1 + STEPS):
        timeline = engine.run(schedule, step, detach=True).timeline
        if run == 0:
            continue
        for event in timeline.events:
            durations[event.action.kind][event.action.stage].append(event.duration)
    return durations


def _one_worker(num_layers: int, split: bool) -> Schedule:
    """Every layer a stage of one worker, one micro-batch: the forwards, then each backward
    (its B and W one after the other when ``split``). One action at a time: none is slowed
    by another sharing the machine."""
    row = [Action(s, FORWARD, 0) for s in range(num_layers)]
    for s in reversed(range(num_layers)):
        row.append(Action(s, BACKWARD, 0))
        if split:
            row.append(Action(s, WEIGHT, 0))
    return Schedule((tuple(row),), (0,) * num_layers, 1, name="per-layer")


def _summed(output: Any) -> torch.Tensor:
    """The model's own loss (its 0-dim floating outputs) if it returns one, else every floating
    output summed: a scalar whose backward reaches every layer as a loss's would."""
    leaves = [t for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    scalars = [t for t in leaves if t.ndim == 0]
    return torch.stack([t.sum().float() for t in scalars or leaves]).sum()
