"""What a stage of layers costs under the checkpoint modes compared, and which modes to compare.

Pure Python over per-layer numbers (:class:`~pipesched.planning.candidate.LayerCost`);
:mod:`pipesched.planning.search` scores cuts with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pipesched.partition.cuts import prefix_sums
from pipesched.planning.candidate import Candidate, LayerCost
from pipesched.runtime.stage.recompute import checkpoint_stop

__all__ = ["MIXED_STAGES", "Modes", "StageTable", "modes_to_compare", "undominated"]

Modes = str | tuple[str, ...]
"""One checkpoint mode for every stage, or one per stage."""

MIXED_STAGES = 4
"""Mixes of modes per stage are searched for schedules of at most this many stages (2^n - 2)."""


class StageTable:
    """Prefix sums of the layers' costs, and what a stage of layers ``[i, j)`` costs."""

    def __init__(self, layers: Sequence[LayerCost], checkpoint: Modes, chunks: int) -> None:
        self.forward = prefix_sums(x.forward for x in layers)
        self.backward = prefix_sums(x.backward for x in layers)
        self.split = (  # B and W run apart, as measured, else the whole backward in halves
            prefix_sums(
                x.backward / 2 if x.backward_input is None else x.backward_input for x in layers
            ),
            prefix_sums(
                x.backward / 2 if x.backward_weight is None else x.backward_weight for x in layers
            ),
        )
        self.activation = prefix_sums(x.activation_bytes for x in layers)
        self.waiting = prefix_sums(  # between B and W: measured, else the activations
            x.activation_bytes if x.split_bytes is None else x.split_bytes for x in layers
        )
        self.params = prefix_sums(x.param_bytes for x in layers)
        self.shared = [x.shared for x in layers]
        self.input = [x.input_bytes for x in layers]
        self.mode = checkpoint
        self.chunks = chunks
        self._stops = (
            checkpoint_stop(checkpoint, chunks)
            if isinstance(checkpoint, str)
            else tuple(checkpoint_stop(m, chunks) for m in checkpoint)
        )

    def stop(self, k: int) -> int:
        """How many leading micro-batches stage ``k`` checkpoints."""
        return self._stops if isinstance(self._stops, int) else self._stops[k]

    def stops(self, num_stages: int) -> tuple[int, ...]:
        return tuple(self.stop(k) for k in range(num_stages))

    def times(self, i: int, j: int) -> tuple[float, float]:
        return self.forward[j] - self.forward[i], self.backward[j] - self.backward[i]

    def split_times(self, i: int, j: int) -> tuple[float, float]:
        """(B, W) of layers ``[i, j)`` when a schedule runs them apart."""
        (b, w) = self.split
        return b[j] - b[i], w[j] - w[i]

    def held(self, i: int, j: int) -> tuple[float, float]:
        """(bytes of a checkpointed micro-batch before its backward, of a kept one)."""
        return self.input[i], self.input[i] + self.activation[j] - self.activation[i]

    def between(self, i: int, j: int) -> float:
        """Bytes a micro-batch of layers ``[i, j)`` holds between its B and its W."""
        return float(self.input[i] + self.waiting[j] - self.waiting[i])

    def search_passes(self, k: int, i: int, j: int) -> tuple[float, float, float]:
        """For the cut search: (F, B with recomputation, bytes per held micro-batch)."""
        forward, backward = self.times(i, j)
        checkpointed, kept = self.held(i, j)
        if self.stop(k) == 0:
            return forward, backward, kept
        return forward, backward + forward, checkpointed

    def counted_twice(self, spans: Sequence[tuple[int, int]]) -> float:
        """Bytes that :meth:`fixed` of these layer ranges (one worker's) counts more than once.

        A parameter several of the layers use (a tied embedding and head on
        one worker) is one tensor with one gradient; each layer's
        ``param_bytes`` counts it.

        Example:
            >>> from pipesched.planning.candidate import LayerCost
            >>> tied = (("wte", 8.0),)
            >>> embed = LayerCost("embed", 1, 1, 0, 8, 0, shared=tied)
            >>> head = LayerCost("head", 1, 1, 0, 8, 0, shared=tied)
            >>> table = StageTable([embed, LayerCost("block", 1, 1, 0, 2, 0), head], "never", 4)
            >>> table.counted_twice([(0, 1), (2, 3)]), table.counted_twice([(0, 2)])
            (16.0, 0.0)
        """
        seen: dict[str, float] = {}
        extra = 0.0
        for i, j in spans:
            for layer in range(i, j):
                for name, size in self.shared[layer]:
                    if name in seen:
                        extra += 2.0 * size  # the parameter and its gradient
                    seen[name] = size
        return extra

    def fixed(self, k: int, i: int, j: int) -> float:
        """Parameters and gradients, and the kept micro-batch where others are checkpointed."""
        extra = 0.0
        if 0 < self.stop(k) < self.chunks:
            extra = self.activation[j] - self.activation[i]
        return float(2.0 * (self.params[j] - self.params[i]) + extra)


def undominated(found: list[Candidate]) -> list[Candidate]:
    """``found`` without the modes per stage that another mode of their schedule beats on both
    step and memory (a mix is only worth showing where it trades one for the other)."""
    return [
        c
        for c in found
        if isinstance(c.checkpoint, str)
        or not any(
            o is not c
            and o.schedule == c.schedule
            and o.step <= c.step
            and o.peak_bytes <= c.peak_bytes
            and (isinstance(o.checkpoint, str) or (o.step, o.peak_bytes) != (c.step, c.peak_bytes))
            for o in found
        )
    ]


def modes_to_compare(checkpoints: Sequence[str], stages: int, mixed: bool) -> list[Modes]:
    """The checkpoint modes to compare for a schedule of ``stages`` stages."""
    found: list[Modes] = list(checkpoints)
    if mixed and "never" in checkpoints and "always" in checkpoints and stages <= MIXED_STAGES:
        for modes in itertools.product(("never", "always"), repeat=stages):
            if len(set(modes)) > 1:
                found.append(modes)
    return found
