"""The Schedule record: each worker's ordered actions and which worker runs which stage."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from pipesched.errors import ScheduleError
from pipesched.schedule.action import WEIGHT, Action
from pipesched.schedule.limits import MAX_ACTIONS, check_size, limit_text
from pipesched.schedule.reading import layout, rows_from_csv, rows_from_lists

if TYPE_CHECKING:
    import networkx as nx

    from pipesched.schedule.costs import Costs
    from pipesched.schedule.timeline import Timeline

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """For each worker (device or rank) its actions in the order it runs them.

    The schedule is plain data. Runtimes execute it as it is: they follow its
    order and its ``placement``; they never decide either.

    Args:
        actions: ``actions[w]`` is worker ``w``'s ordered actions.
        placement: ``placement[s]`` is the worker that runs stage ``s``.
        num_microbatches: micro-batches per step.
        name: the builder's name, or ``"custom"``.

    Raises:
        ScheduleError: no workers or stages, a worker without a stage, or
            more actions, listed or implied (``num_stages x num_microbatches
            x kinds``), than :data:`~pipesched.schedule.limits.MAX_ACTIONS`.

    Example:
        >>> s = Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]])
        >>> s.num_stages, s.num_workers, s.num_microbatches
        (2, 2, 1)
        >>> s.validate().simulate().makespan
        6.0
    """

    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]
    num_microbatches: int
    name: str = "custom"
    _cache: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(map(_as_actions, self.actions)))
        object.__setattr__(self, "placement", tuple(self.placement))
        if not self.actions:
            raise ScheduleError("a schedule needs at least one worker; actions is empty")
        if not self.placement:
            raise ScheduleError("a schedule needs at least one stage; placement is empty")
        bad = [w for w in self.placement if not 0 <= w < len(self.actions)]
        if bad:
            raise ScheduleError(
                f"placement {list(self.placement)} names workers {sorted(set(bad))} but the "
                f"schedule has {len(self.actions)} workers (0..{len(self.actions) - 1})"
            )
        idle = sorted(set(range(len(self.actions))) - set(self.placement))
        if idle:
            raise ScheduleError(
                f"workers {idle} run no stage (placement {list(self.placement)}); "
                "remove them or place a stage on each"
            )
        if self.num_microbatches < 1:
            raise ScheduleError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        listed = sum(map(len, self.actions))
        if listed > MAX_ACTIONS:
            raise ScheduleError(f"the schedule lists {listed} actions, more than {limit_text()}")
        check_size(self.num_stages, self.num_microbatches, 3 if self.split_backward else 2)

    @classmethod
    def from_lists(
        cls, actions: Sequence[Iterable[str | Action]], *, name: str = "custom"
    ) -> Schedule:
        """Builds a schedule from each worker's actions, inferring the rest.

        A stage runs on the worker whose list holds its actions; the stage and
        micro-batch counts are the largest indices seen plus one. The size
        they imply is checked before anything is built (see
        :func:`pipesched.schedule.reading.layout`).

        Raises:
            ScheduleError: an action is malformed, a stage appears on two
                workers, or the indexes imply more than
                :data:`~pipesched.schedule.limits.MAX_ACTIONS` actions or more
                than twice the actions listed; the message names the worker.
        """
        rows, where = rows_from_lists(actions)
        placement, num_microbatches = layout(rows, where, "the lists")
        return cls(tuple(tuple(r) for r in rows), placement, num_microbatches, name)

    @classmethod
    def from_csv(cls, text: str, *, name: str = "custom") -> Schedule:
        """Reads the table :meth:`to_csv` writes: a row per worker, a short-form action per cell.

        Blank cells and lines starting with ``#`` are skipped.

        Raises:
            ScheduleError: as :meth:`from_lists`; the message names the line
                of ``text`` (counting every line) where the problem is.
        """
        rows, where = rows_from_csv(text)
        placement, num_microbatches = layout(rows, where, "the text")
        return cls(tuple(tuple(r) for r in rows), placement, num_microbatches, name)

    def to_csv(self) -> str:
        """The schedule as CSV: a row per worker, a short-form action per cell."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for row in self.actions:
            writer.writerow([str(a) for a in row])
        return out.getvalue()

    @property
    def num_stages(self) -> int:
        """Model stages (``len(placement)``)."""
        return len(self.placement)

    @property
    def num_workers(self) -> int:
        """Workers (devices or ranks) that run the stages."""
        return len(self.actions)

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """The stages ``worker`` runs, in stage order."""
        return tuple(s for s, w in enumerate(self.placement) if w == worker)

    @property
    def virtual_stages(self) -> int:
        """The most stages any one worker runs."""
        return max(len(self.stages_of(w)) for w in range(self.num_workers))

    @cached_property
    def split_backward(self) -> bool:
        """Whether backward is split into input-gradient B and weight-gradient W."""
        return any(a.kind == WEIGHT for row in self.actions for a in row)

    @cached_property
    def whole_backwards(self) -> frozenset[tuple[int, int]]:
        """The ``(stage, microbatch)`` pairs whose B and W a runtime may run as one
        whole backward, changing no transfer and no sum
        (:func:`pipesched.schedule.whole_backward.whole_backwards`)."""
        from pipesched.schedule.whole_backward import whole_backwards

        return whole_backwards(self)

    def graph(self) -> nx.DiGraph:
        """The dependency graph (read-only): data edges plus each worker's order edges.

        See :func:`pipesched.schedule.action_graph.build_graph`.
        """
        from pipesched.schedule.action_graph import build_graph

        if "graph" not in self._cache:
            self._cache["graph"] = build_graph(self)
        return self._cache["graph"]

    def validate(self) -> Schedule:
        """Checks the schedule can run; returns it so calls chain.

        Raises:
            ScheduleError: an action is missing, duplicated or on the wrong worker,
                or the order deadlocks (the message shows the cycle).
        """
        from pipesched.schedule.action_graph import topological_order
        from pipesched.schedule.gc_pause import paused_gc

        if "order" not in self._cache:
            with paused_gc():
                self._cache["order"] = topological_order(self)
        return self

    def order(self) -> list[Action]:
        """Every action once, each after its dependencies (validates first; read-only)."""
        self.validate()
        return self._cache["order"]  # type: ignore[return-value]

    def simulate(self, costs: Costs | None = None) -> Timeline:
        """Runs the schedule on paper: every action as early as its dependencies allow.

        Args:
            costs: durations of the passes; unit costs (F = B = W = 1, no send
                latency) when None.
        """
        from pipesched.schedule.simulate import simulate

        return simulate(self, costs)

    def to_text(self, max_columns: int = 48) -> str:
        """Each worker's actions in order, one row per worker."""
        from pipesched.schedule.text import render_schedule

        return render_schedule(self, max_columns=max_columns)

    def __str__(self) -> str:
        return self.to_text()


def _as_actions(row: Iterable[Action | tuple[int, str, int] | str]) -> tuple[Action, ...]:
    row = tuple(row)
    if all(type(a) is Action for a in row):
        return row  # type: ignore[return-value]
    return tuple(Action.parse(a) if isinstance(a, str) else Action(*a) for a in row)
