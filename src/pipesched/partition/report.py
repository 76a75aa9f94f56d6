"""The partition, explained: per stage its layers, parameters, time and activation memory."""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.schedule import Timeline

__all__ = ["ESTIMATED_NOTE", "SIMULATED_NOTE", "Partition", "StagePlan"]

SIMULATED_NOTE = (
    "  includes: the fwd/bwd ms above (each layer or operation timed alone on the example,",
    "    the fastest of its runs), in the schedule's order of actions",
    "  leaves out: recomputation (checkpoint='except_last' or 'always' adds about one fwd",
    "    to the bwd of each checkpointed micro-batch), the loss, the runtime's own work per",
    "    action (thread hand-offs, seeding, wrappers around each operation), other processes",
    "    on the cores; measured steps on CPU (pipe.last_timeline.makespan after pipe.step)",
    "    typically take 2-5x this, more on a busy machine",
)
"""What the simulated step of the table includes and leaves out, printed under it.

Why words and not a better number: on the examples' models (CPU, 2 workers) the
measured step was 1.5-4x the simulated one at its best and 4-14x at its median
on a loaded 2-core machine (``benchmarks/prediction.py``); the largest parts,
contention for the cores and per-operation Python overhead, depend on the
machine at run time, not on anything a build-time profile can see.
"""

ESTIMATED_NOTE = (
    "  the fwd/bwd ms above are estimates, not measurements: the model is on the meta device,",
    "    so each layer's FLOPs and bytes were counted there and divided by nominal rates",
    "    (pipesched.partition.estimate.RATES); they rank the layers, the step time is a guess",
)
"""What the table says under the simulated step when its times are estimates."""


@dataclass(frozen=True)
class StagePlan:
    """What one stage holds and costs.

    Args:
        index: the stage.
        device: where it runs.
        layers: the names of its layers, in order.
        params: parameter elements it uses (a parameter shared with another
            stage counts on both).
        param_bytes: their bytes.
        forward_time, backward_time: measured seconds for the example input;
            None when the layers were not profiled.
        activation_bytes: bytes of activations per example input; None
            without an example.
        held_microbatches: micro-batches the schedule has the stage hold at
            once, at its peak (GPipe: all; 1F1B: ``min(p - s, m)``).
    """

    index: int
    device: str
    layers: tuple[str, ...]
    params: int
    param_bytes: int
    forward_time: float | None
    backward_time: float | None
    activation_bytes: int | None
    held_microbatches: int

    @property
    def peak_activation_bytes(self) -> int | None:
        """``activation_bytes`` times ``held_microbatches``."""
        if self.activation_bytes is None:
            return None
        return self.activation_bytes * self.held_microbatches


@dataclass(frozen=True)
class Partition:
    """How a model was cut into stages, and why; ``print(pipe.partition)`` shows the table.

    Args:
        balance: how the cuts were chosen: ``"params"``, ``"time"``,
            ``"memory"``, ``"schedule"``, ``"explicit"`` (a list of counts) or
            ``"split_points"``.
        schedule: the schedule's name; ``num_microbatches`` per step.
        stages: one row per stage.
        simulated: the schedule simulated with the measured per-stage costs
            (one micro-batch = the example input), or None unprofiled. A
            prediction of compute only: the table says what it leaves out
            (:data:`SIMULATED_NOTE`).
        memory_budget: bytes per worker the cuts had to fit, if any.
        estimated: the times are estimates, not measurements: the model was
            on the meta device (FLOPs and bytes counted there, at nominal
            rates: :mod:`pipesched.partition.estimate`).
    """

    balance: str
    schedule: str
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    simulated: Timeline | None = None
    memory_budget: float | None = None
    estimated: bool = False

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(len(s.layers) for s in self.stages)

    def __str__(self) -> str:
        head = (
            f"{len(self.stages)} stages, balance={self.balance!r}, schedule "
            f"{self.schedule!r}, {self.num_microbatches} micro-batches"
        )
        if self.memory_budget is not None:
            head += f", memory budget {_bytes(self.memory_budget)} per worker"
        if self.estimated:
            head += ", times ESTIMATED (meta-device model: FLOPs and bytes, nothing run)"
        rows = [
            (
                "stage",
                "device",
                "layers",
                "params",
                "fwd ms",
                "bwd ms",
                "act/mb",
                "held",
                "peak act",
            )
        ]
        for s in self.stages:
            rows.append(
                (
                    str(s.index),
                    s.device,
                    _layers(s.layers),
                    _count(s.params),
                    _ms(s.forward_time),
                    _ms(s.backward_time),
                    _bytes(s.activation_bytes),
                    str(s.held_microbatches),
                    _bytes(s.peak_activation_bytes),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head]
        for row in rows:
            cells = [
                cell.ljust(w) if c in (1, 2) else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        if self.simulated is not None:
            t = self.simulated
            lines.append(
                f"simulated step: {_ms(t.makespan)} ms, bubble {100 * t.bubble_fraction:.1f}% "
                "(micro-batches of the example's size)"
            )
            lines += ESTIMATED_NOTE if self.estimated else SIMULATED_NOTE
        elif all(stage.forward_time is None for stage in self.stages):
            lines.append(
                "simulated step: none, times not measured (balance='time' or 'schedule' "
                "with example_inputs= measures them)"
            )
        return "\n".join(lines)


def _layers(names: tuple[str, ...]) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)})"


def _count(n: int) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
