"""A proven lower bound on the makespan of any split-backward schedule on a placement.

Carlier's bound for ``1|r_j,q_j|Cmax`` applied to each worker: for any set ``S``
of a worker's actions, ``makespan >= min r(a) + sum duration(a) + min q(a)``,
where the head ``r`` and tail ``q`` are the longest data-flow chains before and
after ``a``. With a ``memory_limit`` a second bound holds: before its first B a
worker runs at most ``slots`` forwards. The proof is in :func:`lower_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipesched.analysis.memory_cap import MemoryCap, memory_cap
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule.builders.argument_checks import check_count
from pipesched.schedule.costs import Costs

__all__ = ["StageCosts", "lower_bound", "stage_costs", "synth_placement"]


@dataclass(frozen=True)
class StageCosts:
    """F, B and W of every stage and the one send latency, resolved from the user's costs."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    send: float

    def as_costs(self) -> Costs:
        """These costs as a :class:`Costs` the simulator reads (one value per stage)."""
        return Costs(list(self.forward), list(self.backward), list(self.weight), self.send)

    def duration(self, stage: int, kind: int) -> float:
        """Duration of ``kind`` (0 F, 1 B, 2 W) on ``stage``."""
        return (self.forward, self.backward, self.weight)[kind][stage]


def synth_placement(num_workers: int, stages_per_worker: int) -> tuple[int, ...]:
    """The placement a synthesized schedule uses: stage ``s`` on worker ``s``, or a V.

    Example:
        >>> synth_placement(3, 2)
        (0, 1, 2, 2, 1, 0)
    """
    p = check_count("num_workers", num_workers)
    if isinstance(stages_per_worker, bool) or stages_per_worker not in (1, 2):
        raise ConfigError(
            f"stages_per_worker must be 1 (stage s on worker s) or 2 (a V, as zb-v), got "
            f"{stages_per_worker!r}"
        )
    if stages_per_worker == 1:
        return tuple(range(p))
    return tuple(range(p)) + tuple(reversed(range(p)))


def stage_costs(costs: Costs | Sequence[Costs], num_stages: int) -> StageCosts:
    """Resolves ``costs``: one :class:`Costs` (scalars or per-stage lists) or one per stage.

    Raises:
        ConfigTypeError: ``costs`` is neither a Costs nor a list of them.
        ConfigError: the list has another length than ``num_stages``, an item
            of it holds per-stage lists, or the items disagree on ``send``.

    Example:
        >>> stage_costs(Costs(1, 2, 1), 2).backward
        (2.0, 2.0)
    """
    if isinstance(costs, Costs):
        d = costs.per_stage(num_stages, split_backward=True)
        return StageCosts(d["F"], d["B"], d["W"], float(costs.send))
    if not isinstance(costs, Sequence) or not all(isinstance(c, Costs) for c in costs):
        raise ConfigTypeError(
            f"costs must be a Costs or a list of Costs (one per stage), got {costs!r}"
        )
    if len(costs) != num_stages:
        raise ConfigError(
            f"costs has {len(costs)} entries but the schedule has {num_stages} stages; give "
            "one Costs per stage, or a single Costs"
        )
    sends = {float(c.send) for c in costs}
    if len(sends) > 1:
        raise ConfigError(
            f"costs disagree on send ({sorted(sends)}); the simulator has one send latency, "
            "so give every stage the same send"
        )
    rows: list[tuple[float, float, float]] = []
    for s, c in enumerate(costs):
        values = (c.forward, c.backward, c.weight)
        if not all(isinstance(v, int | float) for v in values):
            raise ConfigError(
                f"costs[{s}] holds per-stage lists ({c!r}); in a list of Costs, one per "
                "stage, each must hold single numbers"
            )
        rows.append((float(c.forward), float(c.backward), float(c.weight)))  # type: ignore[arg-type]
    f, b, w = (tuple(col) for col in zip(*rows, strict=True))
    return StageCosts(f, b, w, sends.pop())


def heads_and_tails(
    costs: StageCosts, placement: tuple[int, ...]
) -> tuple[list[list[float]], list[list[float]]]:
    """``r[s][k]`` and ``q[s][k]``: the head and tail of kind ``k`` (0 F, 1 B, 2 W) on stage ``s``.

    Example:
        >>> r, q = heads_and_tails(stage_costs(Costs(), 2), (0, 1))
        >>> r, q
        ([[0.0, 3.0, 4.0], [1.0, 2.0, 3.0]], [[4.0, 1.0, 0.0], [3.0, 2.0, 0.0]])
    """
    n = len(placement)
    f, b, w = costs.forward, costs.backward, costs.weight

    def send(a: int, c: int) -> float:
        return costs.send if placement[a] != placement[c] else 0.0

    r = [[0.0, 0.0, 0.0] for _ in range(n)]
    q = [[0.0, 0.0, 0.0] for _ in range(n)]
    for s in range(1, n):
        r[s][0] = r[s - 1][0] + f[s - 1] + send(s - 1, s)
    r[n - 1][1] = r[n - 1][0] + f[n - 1]
    for s in range(n - 2, -1, -1):
        r[s][1] = r[s + 1][1] + b[s + 1] + send(s + 1, s)
    for s in range(n):
        r[s][2] = r[s][1] + b[s]
    q[0][1] = w[0]
    for s in range(1, n):
        q[s][1] = max(w[s], send(s, s - 1) + b[s - 1] + q[s - 1][1])
    q[n - 1][0] = b[n - 1] + q[n - 1][1]
    for s in range(n - 2, -1, -1):
        q[s][0] = send(s, s + 1) + f[s + 1] + q[s + 1][0]
    return r, q


def lower_bound(
    num_workers: int,
    num_microbatches: int,
    costs: Costs | Sequence[Costs],
    *,
    stages_per_worker: int = 1,
    memory_limit: float | Sequence[float] | None = None,
    stage_memory: Sequence[float] | None = None,
) -> float:
    """A proven lower bound on the makespan of any schedule on this placement.

    Valid for every split-backward schedule (F, B, W actions) whose stage
    ``s`` runs on ``synth_placement(num_workers, stages_per_worker)[s]``,
    built-in or synthesized, with or without a memory limit (unsplit
    schedules too: their B is a B with its W right after).

    Proof: every action ``a`` has a *head* ``r(a)``, the longest chain of
    data predecessors (F down the stages, the last F into the last B, B back
    up, B into W, with a send wherever two consecutive stages sit on
    different workers) that must end before it starts, and a *tail*
    ``q(a)``, the longest such chain that must run after it ends; neither
    depends on any worker's order. Take any set ``S`` of one worker's
    actions. The first of them to start starts at ``>= min r``; the worker
    runs them one at a time, so the last ends at ``>= min r + sum of their
    durations``; its tail follows, so the makespan is ``>= min r + sum +
    min q``. Heads and tails depend only on (stage, kind), so a worker has
    at most ``3 x stages_per_worker`` classes of ``m`` equal actions; the
    bound is the largest such sum over the sets of classes with head and
    tail above two thresholds. That includes the worker's whole work after
    the ramp that reaches it first (all its classes: ``min q = 0`` from
    its Ws), the work before its last B's chain back to stage 0 (its F and
    B classes), and the critical path of one micro-batch.

    With a ``memory_limit`` (as :func:`pipesched.analysis.synthesize`
    counts it), also for every worker: let ``T`` be the smallest head of
    its Bs. No B of the worker starts before ``T``, so no W ends before it
    and nothing it holds is released; every F started before ``T`` still
    holds its micro-batch at ``T``, so the Fs started before ``T`` fit in
    its limit together, and the worker's work before ``T`` is at most
    ``min(T - its first head, the most F time that fits in the limit)``
    (the ``slots`` longest Fs; with ``stage_memory``, a fractional
    knapsack of its stages' Fs, an upper bound on it). The rest of its
    work runs after ``T``, one action at a time::

        makespan >= T + total work - that most work before T.

    Under 1F1B's memory and ``B`` above ``F`` this is the larger bound:
    the last worker of a V waits out its first micro-batch's round trip
    with only ``slots`` forwards to run.

    Args:
        num_workers: workers (devices).
        num_microbatches: micro-batches per step.
        costs: per-stage durations: one :class:`Costs` or one per stage
            (``num_workers x stages_per_worker`` stages).
        stages_per_worker: 1 (stage ``s`` on worker ``s``) or 2 (a V).
        memory_limit: most activations a worker may hold at once, as for
            :func:`pipesched.analysis.synthesize` (micro-batches of its
            whole share, or the units of ``stage_memory``; one number, or
            one per worker); None: no limit (the bound holds for every
            schedule).
        stage_memory: what one micro-batch holds on each stage, from its F
            to its W, in the units of ``memory_limit``; None: equal stages.

    Returns:
        The bound, in the units of ``costs``.

    Raises:
        ConfigError: a count or the costs do not fit, or ``memory_limit``
            is below one micro-batch of a worker's share (1, or its stages'
            ``stage_memory`` summed).

    Example:
        >>> lower_bound(4, 8, Costs())  # 3m of work after a ramp of p - 1 forwards
        27.0
        >>> lower_bound(4, 8, Costs(0.5, 0.5, 0.5), stages_per_worker=2)  # zb-v's 25.5
        25.5
        >>> costs = Costs(0.5, 1.0, 0.5)  # B twice F: the first round trip is long
        >>> lower_bound(4, 8, costs, stages_per_worker=2)  # forwards could fill the wait...
        33.5
        >>> lower_bound(4, 8, costs, stages_per_worker=2, memory_limit=4)  # ...memory allowing
        35.0
    """
    m = check_count("num_microbatches", num_microbatches)
    placement = synth_placement(num_workers, stages_per_worker)
    resolved = stage_costs(costs, len(placement))
    cap = memory_cap(memory_limit, stage_memory, placement, m)
    r, q = heads_and_tails(resolved, placement)
    best = 0.0 if cap is None else _memory_bound(resolved, placement, m, cap, r)
    for worker in range(num_workers):
        classes = [
            (r[s][k], q[s][k], m * resolved.duration(s, k))
            for s, w in enumerate(placement)
            if w == worker
            for k in range(3)
        ]
        for r0 in {c[0] for c in classes}:
            for q0 in {c[1] for c in classes}:
                chosen = [c for c in classes if c[0] >= r0 and c[1] >= q0]
                if chosen:
                    total = sum(c[2] for c in chosen)
                    value = min(c[0] for c in chosen) + total + min(c[1] for c in chosen)
                    best = max(best, value)
    return best


def _memory_bound(
    costs: StageCosts, placement: tuple[int, ...], m: int, cap: MemoryCap, r: list[list[float]]
) -> float:
    """The bound from a worker running only the forwards its cap holds before its first B."""
    best = 0.0
    for worker in range(max(placement) + 1):
        stages = [s for s, w in enumerate(placement) if w == worker]
        total = m * sum(costs.duration(s, k) for s in stages for k in range(3))
        first_b = min(r[s][1] for s in stages)
        room, work = cap.capacity[worker], 0.0  # a fractional knapsack: F time per unit held
        for s in sorted(stages, key=lambda s: _per_unit(costs.forward[s], cap.sizes[s])):
            count = m if cap.sizes[s] <= 0 else min(m, room / cap.sizes[s])
            work += count * costs.forward[s]
            room -= count * cap.sizes[s]
        before = min(first_b - min(r[s][0] for s in stages), work)
        best = max(best, first_b + total - before)
    return best


def _per_unit(forward: float, size: float) -> float:
    """Sort key of the knapsack: the most F time per unit held first (held nothing: first)."""
    return -math.inf if size <= 0 else -forward / size
