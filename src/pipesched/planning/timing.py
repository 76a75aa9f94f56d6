"""Each layer timed as the runtime runs it: the steps of a pipeline with one stage per layer.

Why not the per-operation profile that ``balance="time"`` uses: timing each
operation alone, on fresh leaves, leaves out what a stage's pass really
spends around them, and not evenly: the autograd engine's work per node (a
Transformer block has dozens of small ones, an LM head one large matmul), the
accumulation of each micro-batch's weight gradient into ``.grad`` (an
embedding's is as large as the table), the loss's softmax over a large
vocabulary. Measured on a GPT-2 with a 32k vocabulary, the profile put its
blocks at 60% of what the pipeline spends on them and its embedding's
backward at a tenth, so a cut balanced on it was not balanced in the run.

Here the model is cut into one stage per layer, all on the one device, and a
few training steps of the example micro-batch run through pipesched's own
runtime (GPipe, one micro-batch, no recomputation, the loss the sum of the
floating outputs); each layer's F and B are the medians of its measured
actions. Nothing of the model changes: gradients, buffers (BatchNorm
statistics) and the random generators are put back.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from pipesched.call import Call
from pipesched.schedule import FORWARD
from pipesched.tree import tensors

__all__ = ["run_layer_times"]

STEPS = 3
"""Measured steps, after one to warm up."""


def run_layer_times(
    module: nn.Module, example_inputs: Any, num_layers: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Per layer of the stage graph, (forward seconds, backward seconds) in pipesched's runtime.

    Args:
        module: the model (an ``nn.Sequential``, or one that traces).
        example_inputs: one micro-batch: a tuple of positional arguments or a Call.
        num_layers: the layers of its stage graph (one stage each).
        device: where every stage runs.

    Raises:
        Exception: whatever the model raises; the caller falls back to the profile.
    """
    from pipesched.pipeline import Pipeline  # the planner runs inside Pipeline's construction

    call = Call.of(example_inputs)
    sequential = isinstance(module, nn.Sequential)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            pipe = Pipeline(
                module,
                1,
                balance=[1] * num_layers,
                devices=[device] * num_layers,
                checkpoint="never",
                example_inputs=call.args if sequential else call,
            )
            batch = call.args[0] if sequential else call
            forward: list[list[float]] = [[] for _ in range(num_layers)]
            backward: list[list[float]] = [[] for _ in range(num_layers)]
            for step in range(1 + STEPS):
                pipe.step(batch, loss_fn=_summed)
                timeline = pipe.last_timeline
                if step == 0 or timeline is None:
                    continue
                for event in timeline.events:
                    kind = forward if event.action.kind == FORWARD else backward
                    kind[event.action.stage].append(event.duration)
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
    return [statistics.median(f) for f in forward], [statistics.median(b) for b in backward]


def _summed(output: Any) -> torch.Tensor:
    """The model's own loss (its 0-dim floating outputs) if it returns one, else every floating
    output summed: a scalar whose backward reaches every layer as a loss's would."""
    leaves = [t for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    scalars = [t for t in leaves if t.ndim == 0]
    return torch.stack([t.sum().float() for t in scalars or leaves]).sum()
