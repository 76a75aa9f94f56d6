"""The planner's records: a layer's costs, one candidate plan, and the comparison of all of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipesched.schedule import Schedule

__all__ = ["Candidate", "LayerCost", "Planning"]


@dataclass(frozen=True)
class LayerCost:
    """One cut unit of the model (a layer of the stage graph) and what it costs per micro-batch.

    Args:
        name: the layer's name (``"transformer.h.0"``).
        forward: seconds of its forward on one micro-batch.
        backward: seconds of its backward (input and weight gradients).
        activation_bytes: bytes its forward keeps for backward.
        param_bytes: bytes of its parameters.
        input_bytes: bytes that cross into a stage beginning with this layer
            (every tensor made before it and used from it on): what a
            checkpointed micro-batch keeps.
        backward_input, backward_weight: seconds of its backward's B (input
            gradient) and W (weight gradient) run apart, as zero-bubble
            schedules run them; None: ``backward`` split evenly.
        split_bytes: bytes it holds between B and W when they run apart (the
            deferred weight products' operands); None: its ``activation_bytes``.
        shared: ``(name, bytes)`` of each of its parameters that other
            layers use too (a tied embedding and LM head): a worker running
            several of those layers holds the parameter, and its gradient,
            once, where ``param_bytes`` counts it in each.
    """

    name: str
    forward: float
    backward: float
    activation_bytes: float
    param_bytes: float
    input_bytes: float
    backward_input: float | None = None
    backward_weight: float | None = None
    shared: tuple[tuple[str, float], ...] = ()
    split_bytes: float | None = None


@dataclass(frozen=True)
class Candidate:
    """One way to run the model that the planner compared.

    Args:
        schedule: the schedule's name (``"synthesized"`` for one computed
            for these costs).
        checkpoint: the checkpoint mode (``"never"``, ``"except_last"``, ``"always"``),
            or one per stage (a tuple).
        counts: layers per stage.
        chunks: micro-batches per step.
        step: predicted seconds per step.
        peak_bytes: predicted peak memory of the fullest worker: parameters,
            their gradients and the activations held at once.
        fits: whether ``peak_bytes`` is within the memory budget.
        table: the synthesized Schedule (None for a built-in, built by name).
        note: how it was made, when that is not obvious.
    """

    schedule: str
    checkpoint: str | tuple[str, ...]
    counts: tuple[int, ...]
    chunks: int
    step: float
    peak_bytes: float
    fits: bool
    table: Schedule | None = None
    note: str = ""

    @property
    def spec(self) -> str | Schedule:
        """What ``Pipeline(schedule=...)`` takes to run it."""
        return self.table if self.table is not None else self.schedule


@dataclass(frozen=True)
class Planning:
    """Every candidate the planner compared, fastest first, and the one it picked.

    ``print(planning)`` shows the table and the reasons.

    Args:
        candidates: fitting candidates by predicted step, then the others.
        pick: the fastest that fits the budget.
        num_workers: workers (devices or pipeline ranks).
        memory_budget: bytes per worker, or None.
        skipped: schedules not compared, each with why.
        baseline: 1F1B with the cut that balances per-stage time, for comparison.
        source: what the costs come from.
    """

    candidates: tuple[Candidate, ...]
    pick: Candidate
    num_workers: int
    memory_budget: float | None
    skipped: tuple[tuple[str, str], ...] = ()
    baseline: Candidate | None = None
    source: str = "profiled layer costs"

    def explain(self) -> str:
        """Why the pick: how much faster than the next best and than the baseline, what it beat."""
        pick = self.pick
        lines = [
            f"picked {_label(pick)}: {_ms(pick.step)} per step, peak {_bytes(pick.peak_bytes)} "
            "per worker"
        ]
        others = [c for c in self.candidates if c.fits and c is not pick]
        if others:
            runner = others[0]
            lines.append(f"  next best: {_label(runner)}, {_than(runner.step, pick.step)}")
        if self.baseline is not None and self.baseline is not pick:
            lines.append(
                f"  1f1b with time-balanced stages ({_modes(self.baseline.checkpoint)}, "
                f"{list(self.baseline.counts)}): {_ms(self.baseline.step)}, "
                f"{_than(self.baseline.step, pick.step)}"
                + ("" if self.baseline.fits else ", and over the budget")
            )
        faster = [c for c in self.candidates if not c.fits and c.step < pick.step]
        if faster:
            best = min(faster, key=lambda c: c.step)
            lines.append(
                f"  {len(faster)} faster candidate(s) exceed the budget, e.g. {_label(best)}: "
                f"{_ms(best.step)} at {_bytes(best.peak_bytes)}"
            )
        if pick.checkpoint != "never":
            kept = [c for c in self.candidates if c.checkpoint == "never"]
            fitting = [c for c in kept if c.fits]
            if not kept:
                why = "the only mode compared"
            elif fitting:
                best = min(fitting, key=lambda c: c.step)
                than = _than(best.step, pick.step)
                why = f"without recomputation the fastest that fits is {than}"
            else:
                why = "nothing without recomputation fits the budget"
            lines.append(f"  checkpoint={_modes(pick.checkpoint)}: {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        budget = (
            "no memory budget"
            if self.memory_budget is None
            else (f"memory budget {_bytes(self.memory_budget)} per worker")
        )
        chunks = sorted({c.chunks for c in self.candidates})
        head = (
            f"plan for {self.num_workers} workers, {'/'.join(map(str, chunks))} micro-batches, "
            f"{budget} ({self.source})"
        )
        rows = [("", "schedule", "checkpoint", "chunks", "balance", "step", "peak", "")]
        for c in self.candidates:
            rows.append(
                (
                    "*" if c is self.pick else "",
                    c.schedule,
                    _modes(c.checkpoint),
                    str(c.chunks),
                    _balance(c.counts),
                    _ms(c.step),
                    _bytes(c.peak_bytes),
                    ("" if c.fits else "over budget") + (f" {c.note}" if c.note else ""),
                )
            )
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        table = [
            "  ".join(
                v.ljust(w) if k < 5 else v.rjust(w)
                for k, (v, w) in enumerate(zip(r[:-1], widths[:-1], strict=True))
            )
            + ("  " + r[-1] if r[-1] else "")
            for r in rows
        ]
        skipped = [f"not compared: {name} ({why})" for name, why in self.skipped]
        return "\n".join([head, *table, *skipped, self.explain()])


def _label(c: Candidate) -> str:
    modes = _modes(c.checkpoint)
    return f"{c.schedule} / checkpoint={modes} / balance {list(c.counts)} / chunks {c.chunks}"


def _modes(checkpoint: str | tuple[str, ...]) -> str:
    """A mode, or modes per stage as ``always,never``."""
    return checkpoint if isinstance(checkpoint, str) else ",".join(checkpoint)


def _balance(counts: Sequence[int]) -> str:
    text = str(list(counts))
    return text if len(text) <= 28 else text[:25] + "..]"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _than(other: float, pick: float) -> str:
    """``other``'s step against the pick's: "12.5% slower" or "3.1% faster"."""
    if pick <= 0:
        return "n/a"
    change = (other / pick - 1) * 100
    return f"{change:.1f}% slower" if change >= 0 else f"{-change:.1f}% faster"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
