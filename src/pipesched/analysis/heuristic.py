"""Schedule orders found by list scheduling and local search, played on a fast integer model.

Why not Schedule.simulate: local search plays thousands of orders, and building,
validating and simulating a Schedule for each is over ten times slower. An action
is one int, ``(stage * 3 + kind) * m + microbatch``; memory is counted in slots (a
stage holding a micro-batch from the start of its F to the end of its W). The
synthesizer checks its final answer with the real simulator.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from pipesched.analysis.bound import StageCosts

__all__ = ["POLICIES", "Policy", "Problem", "improve", "list_schedule"]

Rows = list[list[int]]


@dataclass(frozen=True)
class Problem:
    """What an order is played against: sizes, placement, durations and the memory cap.

    Args:
        placement: ``placement[s]`` is the worker of stage ``s``.
        num_microbatches: micro-batches per step.
        costs: per-stage durations and the send latency.
        slots: most slots a worker may hold at once: one number for every
            worker, or one per worker.
        sizes: slots one micro-batch takes on each stage; None: 1 each.
    """

    placement: tuple[int, ...]
    num_microbatches: int
    costs: StageCosts
    slots: int | tuple[int, ...]
    sizes: tuple[int, ...] | None = None

    def size(self, stage: int) -> int:
        """Slots one micro-batch takes on ``stage``."""
        return 1 if self.sizes is None else self.sizes[stage]

    def capacity(self, worker: int) -> int:
        """Slots ``worker`` may hold at once."""
        return self.slots if isinstance(self.slots, int) else self.slots[worker]

    def limited(self, worker: int) -> bool:
        """Whether the cap can bind on ``worker``: it holds less than all its micro-batches."""
        mine = sum(self.size(s) for s, w in enumerate(self.placement) if w == worker)
        return self.capacity(worker) < mine * self.num_microbatches

    @property
    def num_workers(self) -> int:
        """Workers of the placement."""
        return max(self.placement) + 1

    def action(self, a: int) -> tuple[int, int, int]:
        """``(stage, kind, microbatch)`` of action number ``a``."""
        m = self.num_microbatches
        return a // (3 * m), (a // m) % 3, a % m

    def number(self, stage: int, kind: int, microbatch: int) -> int:
        """The number of an action."""
        return (stage * 3 + kind) * self.num_microbatches + microbatch

    def tables(self) -> tuple[list[float], list[int], list[int]]:
        """Per action number: duration, the number of its data predecessor (-1), its worker."""
        n, m = len(self.placement), self.num_microbatches
        dur, pred, worker = [], [], []
        for s in range(n):
            for k in range(3):
                d = self.costs.duration(s, k)
                if k == 0:
                    p = self.number(s - 1, 0, 0) if s else -1
                elif k == 1:
                    p = self.number(s + 1, 1, 0) if s < n - 1 else self.number(s, 0, 0)
                else:
                    p = self.number(s, 1, 0)
                for i in range(m):
                    dur.append(d)
                    pred.append(p + i if p >= 0 else -1)
                    worker.append(self.placement[s])
        return dur, pred, worker


class Player:
    """Plays orders of one :class:`Problem`: makespan, or None when it deadlocks or overflows."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.dur, self.pred, self.worker = problem.tables()
        self.send = problem.costs.send
        m = problem.num_microbatches
        self.held = []  # for each action: + its stage's size at its start (F), - at its end (W)
        for a in range(len(self.dur)):
            kind, size = (a // m) % 3, problem.size(a // (3 * m))
            self.held.append(size if kind == 0 else -size if kind == 2 else 0)
        self.caps = {  # the workers whose cap can bind
            w: problem.capacity(w) for w in range(problem.num_workers) if problem.limited(w)
        }

    def play(self, rows: Rows) -> tuple[float, list[float], list[float]] | None:
        """(makespan, starts, ends) of ``rows``, or None if it deadlocks or exceeds the slots."""
        n = len(self.dur)
        start, end = [0.0] * n, [-1.0] * n
        dur, pred, send = self.dur, self.pred, self.send
        pos = [0] * len(rows)
        free = [0.0] * len(rows)
        left = n
        while left:
            moved = False
            for w, row in enumerate(rows):
                j, t_free = pos[w], free[w]
                while j < len(row):
                    a = row[j]
                    p = pred[a]
                    t = t_free
                    if p >= 0:
                        e = end[p]
                        if e < 0:
                            break
                        if self.worker[p] != w:
                            e += send
                        if e > t:
                            t = e
                    start[a] = t
                    end[a] = t_free = t + dur[a]
                    j += 1
                if j != pos[w]:
                    left -= j - pos[w]
                    pos[w], free[w] = j, t_free
                    moved = True
            if not moved:
                return None
        if any(self.peak_slots(rows[w], start, end) > cap for w, cap in self.caps.items()):
            return None
        return max(free), start, end

    def peak_slots(self, row: list[int], start: list[float], end: list[float]) -> int:
        """The most slots the worker of ``row`` holds at once (a release first at equal times)."""
        held, peak, level = self.held, 0, 0
        changes = sorted((start[a] if held[a] > 0 else end[a], held[a]) for a in row if held[a])
        for _, delta in changes:
            level += delta
            peak = max(peak, level)
        return peak

    def makespan(self, rows: Rows) -> float:
        """The makespan of ``rows``; infinity when it cannot run within the slots."""
        result = self.play(rows)
        return float("inf") if result is None else result[0]


@dataclass(frozen=True)
class Policy:
    """How list scheduling picks among a free worker's ready actions.

    Args:
        rank: priority of F, B, W (lower first), e.g. ``(1, 0, 2)``: B, then F, then W.
        later_stage_first: among equal kinds and micro-batches, the later stage first.
        lookahead: wait for a better-ranked action arriving within this
            fraction of the chosen one's duration rather than start it.
        headroom: on a V, None makes an F on the way down take the slot of
            its way up too (never deadlocks); a number ``h`` lets each F take
            one slot, an F on the way down only while ``h`` more stay free
            (more forwards in flight; may deadlock, and is then dropped).
    """

    rank: tuple[int, int, int]
    later_stage_first: bool
    lookahead: float
    headroom: int | None = None


POLICIES: tuple[Policy, ...] = (
    Policy((1, 0, 2), True, 0.0),
    Policy((1, 0, 2), True, 0.5),
    Policy((0, 1, 2), True, 0.0),
    Policy((0, 1, 2), True, 0.5),
    Policy((1, 0, 1), True, 0.0),
    Policy((1, 0, 1), True, 0.5),
    Policy((1, 0, 1), True, 1.0),
    *(Policy(rank, True, 0.5, h) for rank in ((1, 0, 2), (1, 0, 1)) for h in (1, 2, 3)),
    # Tight V policies: an F on the way down only while 0 or 1 slot stays free. On 60
    # random profiles (p 4 and 8, a heavy last stage or not) these gave the best order
    # most often; with them the heuristic's gap to CP-SAT's optima on V fell from 0.59%
    # mean, 1.59% max, to 0.08% and 0.59% (12 profiles, p=4, m=8, memory limit p).
    *(Policy(rank, True, 0.0, h) for rank in ((0, 1, 2), (1, 0, 2), (1, 0, 1)) for h in (0, 1)),
    *(Policy(rank, True, 0.25, h) for rank in ((0, 1, 2), (1, 0, 2)) for h in (0, 1)),
    Policy((0, 1, 2), True, 0.5, 0),
    Policy((0, 1, 2), True, 1.0, 0),
    *(Policy((1, 0, 2), False, 0.0, h) for h in (1, 2)),
    Policy((1, 0, 1), False, 0.0, 1),
)
"""The policies :func:`list_schedule` is run with; the synthesizer keeps the best order.

A ``headroom`` only changes anything on a V: with one stage per worker those
policies are skipped."""


def list_schedule(problem: Problem, policy: Policy) -> Rows | None:
    """Builds worker orders by list scheduling; None when the memory cap blocks it.

    Each worker runs, per stage and kind, its micro-batches in order. Time
    advances to the worker that can start something first; it starts its
    best-ranked ready action (or waits for a better one by ``lookahead``).
    An F on the way down a V takes its own slots and those its way up on the
    same worker will need, so held micro-batches can always finish: no
    deadlock (unless ``policy.headroom`` trades that guarantee for more
    forwards in flight).
    """
    m, placement = problem.num_microbatches, problem.placement
    n, p = len(placement), problem.num_workers
    dur, pred, worker = problem.tables()
    send = problem.costs.send
    stages = [[s for s in range(n) if placement[s] == w] for w in range(p)]
    vee, h, size = n > p, policy.headroom, problem.size
    need = [
        size(s) if not vee or h is not None else (size(s) + size(n - 1 - s) if s < p else 0)
        for s in range(n)
    ]
    extra = [h * size(n - 1 - s) if vee and h is not None and s < p else 0 for s in range(n)]
    nxt = [[0, 0, 0] for _ in range(n)]
    end = [-1.0] * len(dur)
    free = [0.0] * p
    used = [0] * p  # slots taken (with reservations) and not yet released
    releases: list[list[tuple[float, int]]] = [[] for _ in range(p)]  # (time, slots)
    rows: Rows = [[] for _ in range(p)]
    sign = -1 if policy.later_stage_first else 1

    def pick(w: int) -> tuple[float, int, int] | None:
        options = []
        for s in stages[w]:
            for k in range(3):
                i = nxt[s][k]
                if i >= m:
                    continue
                a = (s * 3 + k) * m + i
                ready = free[w]
                q = pred[a]
                if q >= 0:
                    if end[q] < 0:
                        continue
                    ready = max(ready, end[q] + (send if worker[q] != w else 0.0))
                over = used[w] + need[s] + extra[s] - problem.capacity(w) if k == 0 else 0
                if over > 0:  # wait for the earliest releases that make room
                    room = _room_at(releases[w], over)
                    if room is None:
                        continue
                    ready = max(ready, room)
                options.append((ready, (policy.rank[k], i, sign * s), s, k, dur[a]))
        if not options:
            return None
        t = min(o[0] for o in options)
        best = min((o for o in options if o[0] <= t), key=lambda o: o[1])
        start = t
        for o in sorted(options, key=lambda o: o[1]):
            if o[1] < best[1] and o[0] < t + policy.lookahead * best[4]:
                best, start = o, o[0]
                break
        return start, best[2], best[3]

    for _ in range(len(dur)):
        choice: tuple[float, int, int, int] | None = None  # (start, worker, stage, kind)
        for w in range(p):
            option = pick(w)
            if option is not None and (choice is None or option[0] < choice[0]):
                choice = (option[0], w, option[1], option[2])
        if choice is None:
            return None
        t, w, s, k = choice
        a = (s * 3 + k) * m + nxt[s][k]
        nxt[s][k] += 1
        end[a] = free[w] = t + dur[a]
        rows[w].append(a)
        while releases[w] and releases[w][0][0] <= t:
            used[w] -= heapq.heappop(releases[w])[1]
        if k == 0:
            used[w] += need[s]
        elif k == 2:
            heapq.heappush(releases[w], (end[a], size(s)))
    return rows


def _room_at(releases: list[tuple[float, int]], over: int) -> float | None:
    """When releases have freed ``over`` slots; None if they never do."""
    freed = 0
    for t, slots in sorted(releases):
        freed += slots
        if freed >= over:
            return t
    return None


def improve(player: Player, rows: Rows, budget: int, seed: int = 0) -> tuple[Rows, float]:
    """Local search: moves one action in its worker's order, keeps the move if no slower.

    A W (most of the time) moves up to 12 places either way, anything else
    up to six.

    Ties in makespan are broken by the sum of all actions' end times (earlier
    is better), so the search can cross plateaus. Returns the best order and
    its makespan.
    """
    rng = random.Random(seed)
    m = player.problem.num_microbatches
    best = [list(r) for r in rows]
    result = player.play(best)
    if result is None:
        return best, float("inf")
    best_key = (result[0], _spread(best, result[2]))
    for _ in range(budget):
        w = rng.randrange(len(best))
        row = best[w]
        if len(row) < 2:
            continue
        j = rng.randrange(len(row))
        if (row[j] // m) % 3 == 2 and rng.random() < 0.8:  # a W: nothing waits for it
            to = j + rng.choice((-1, 1)) * rng.randint(1, _W_REACH)
        else:
            to = j + rng.choice(_STEPS)
        to = min(len(row) - 1, max(0, to))
        if to == j:
            continue
        trial = list(row)
        trial.insert(to, trial.pop(j))
        candidate = [*best[:w], trial, *best[w + 1 :]]
        played = player.play(candidate)
        if played is None:
            continue
        key = (played[0], _spread(candidate, played[2]))
        if key <= best_key:
            best, best_key = candidate, key
    return best, best_key[0]


_STEPS = (-6, -4, -3, -2, -1, 1, 2, 3, 4, 6)
"""How far :func:`improve` moves an action in its worker's order."""
_W_REACH = 12
"""How far it moves a W, mostly: the solver's better orders move Ws far (a W waits on no one)."""


def _spread(rows: Rows, end: list[float]) -> float:
    """Sum of all actions' end times: the tie-break of :func:`improve`."""
    return sum(end[a] for row in rows for a in row)
