"""Synthesized schedules against the lower bound, the built-ins and the exact solver.

Run: PYTHONPATH=src .venv/bin/python benchmarks/synthesize.py [--profiles 200] [--effort 1500]
     [--exact-cases 8] [--exact-time 8] [--seed 0]

Random cost profiles: p in {4, 8}, m in {2p, 3p}, a worker share's F, B, W
each drawn from [0.5, 2], no send latency, memory limit = 1F1B's peak (p
micro-batches of a whole share per worker). Each profile is synthesized on
both placements (one stage per worker, and a V of two half-share stages per
worker) and the faster kept. Reported: the gap of each placement's schedule
to its lower bound under the memory limit; the win over the fastest
built-in that fits the limit (of zb-h1, zb-v, dualpipev: whichever exist in
SCHEDULES when this runs) and how many profiles came out slower than it; the
most any schedule could win over that built-in (the lower bound on the
better placement says so); the seconds per synthesize
call; and, where OR-Tools is installed, the exact solver's optimum on the
first ``--exact-cases`` profiles with p = 4, m = 8 (both placements),
each within ``--exact-time`` seconds: how many it proves optimal, the
heuristic's gap to those optima, and, on the others, how much faster the
best order CP-SAT found (started from the heuristic's) is. Then the same with a heavy last stage
(an LM head: the model's last half-share chunk costs 2-3x).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

from pipesched.analysis import lower_bound
from pipesched.analysis.bound import stage_costs, synth_placement
from pipesched.analysis.heuristic import Player, Problem
from pipesched.analysis.synthesize import peak_memory, synthesize
from pipesched.errors import ConfigError
from pipesched.schedule import SCHEDULES, Costs, get_schedule, stages_per_worker
from pipesched.schedule.schedule import Schedule

BUILT_INS = ("zb-h1", "zb-v", "dualpipev")


def chunk_costs(p: int, rng: random.Random, heavy: bool) -> list[tuple[float, float, float]]:
    """F, B, W of each of the model's 2p half-share chunks."""
    f, b, w = (rng.uniform(0.5, 2.0) for _ in range(3))
    chunks = [(f / 2, b / 2, w / 2)] * (2 * p)
    if heavy:
        k = rng.uniform(2.0, 3.0)
        chunks[-1] = (k * f / 2, k * b / 2, k * w / 2)
    return chunks


def costs_for(chunks: list[tuple[float, float, float]], v: int) -> Costs:
    """Per-stage Costs when each stage is ``2 / v`` consecutive chunks."""
    per = 2 // v
    stages = [
        tuple(sum(c[k] for c in chunks[s * per : (s + 1) * per]) for k in range(3))
        for s in range(len(chunks) // per)
    ]
    return Costs(*([s[k] for s in stages] for k in range(3)))


def best_built_in(p: int, m: int, chunks: list[tuple[float, float, float]], limit: float) -> float:
    """The fastest built-in of BUILT_INS that exists and fits ``limit``."""
    best = float("inf")
    for name in BUILT_INS:
        if name not in SCHEDULES:
            continue
        v = stages_per_worker(name)
        try:
            schedule = get_schedule(name, p * v, m)
        except ConfigError:  # a built-in that cannot run these counts
            continue
        costs = costs_for(chunks, v)
        if max(peak_memory(schedule, costs)) <= limit:
            best = min(best, schedule.simulate(costs).makespan)
    return best


def rows_of(schedule: Schedule, problem: Problem) -> list[list[int]]:
    """A Schedule as the heuristic's integer-coded rows."""
    return [[problem.number(s, "FBW".index(k), i) for s, k, i in row] for row in schedule.actions]


@dataclass
class ExactTally:
    """The exact solver's results on one placement."""

    tried: int = 0
    gaps: list[float] = field(default_factory=list)  # heuristic / optimum - 1, where proved
    built_in_gaps: list[float] = field(default_factory=list)  # same-placement built-in's
    found: list[float] = field(default_factory=list)  # 1 - incumbent / heuristic, unproved

    def add(
        self, p: int, m: int, v: int, made: tuple[float, Schedule, Costs], time_limit: float
    ) -> float | None:
        """Solves one profile on placement ``v``; its proved optimum, else None."""
        from pipesched.analysis.exact import solve

        heur, schedule, costs = made
        problem = Problem(synth_placement(p, v), m, stage_costs(costs, p * v), p * v)
        self.tried += 1
        result = solve(problem, time_limit=time_limit, hint=rows_of(schedule, problem))
        if result is None:
            return None
        best = Player(problem).makespan(result.rows)
        if result.optimal:
            built = get_schedule("zb-h1" if v == 1 else "zb-v", p * v, m)
            self.gaps.append(heur / best - 1)
            self.built_in_gaps.append(built.simulate(costs).makespan / best - 1)
            return best
        self.found.append(1 - best / heur)
        return None

    def report(self, v: int, time_limit: float) -> str:
        name = "zb-h1" if v == 1 else "zb-v"
        text = (
            f"exact (CP-SAT, p=4 m=8, {v} stage(s)/worker, {time_limit:g} s each): "
            f"{len(self.gaps)}/{self.tried} proved optimal"
        )
        if self.gaps:
            text += (
                f"; on those the heuristic's gap to optimum: mean "
                f"{100 * statistics.mean(self.gaps):.2f}%, max {100 * max(self.gaps):.2f}% "
                f"({name}'s: mean {100 * statistics.mean(self.built_in_gaps):.2f}%)"
            )
        if self.found:
            text += (
                f"; unproved ones: CP-SAT's best is {100 * statistics.mean(self.found):.2f}% "
                f"below the heuristic (mean)"
            )
        return text


def run(args: argparse.Namespace, heavy: bool) -> None:
    rng = random.Random(args.seed + (1 if heavy else 0))
    gaps: dict[int, list[float]] = {1: [], 2: []}
    wins, rooms, above, seconds = [], [], 0, []
    optimum_wins: list[float] = []  # where both placements were proved optimal
    exact = {1: ExactTally(), 2: ExactTally()}
    from pipesched.analysis.exact import available

    for _ in range(args.profiles):
        p = rng.choice((4, 8))
        m = rng.choice((2 * p, 3 * p))
        chunks = chunk_costs(p, rng, heavy)
        limit = p
        made, bounds = {}, []
        for v in (1, 2):
            costs = costs_for(chunks, v)
            t0 = time.perf_counter()
            schedule = synthesize(
                p, m, costs, stages_per_worker=v, memory_limit=limit, effort=args.effort
            )
            seconds.append(time.perf_counter() - t0)
            makespan = schedule.simulate(costs).makespan
            bound = lower_bound(p, m, costs, stages_per_worker=v, memory_limit=limit)
            bounds.append(bound)
            gaps[v].append(makespan / bound - 1)
            made[v] = (makespan, schedule, costs)
        ours = min(made[1][0], made[2][0])
        theirs = best_built_in(p, m, chunks, limit)
        wins.append(1 - ours / theirs)
        rooms.append(1 - min(bounds) / theirs)  # no schedule on either placement wins more
        above += ours > theirs * (1 + 1e-12)
        if available() and exact[1].tried < args.exact_cases and p == 4 and m == 8:
            optima = [exact[v].add(p, m, v, made[v], args.exact_time) for v in (1, 2)]
            if None not in optima:
                optimum_wins.append(1 - min(optima) / theirs)  # type: ignore[type-var]
    title = "heavy last stage (last chunk x2-3)" if heavy else "equal stages"
    print(f"\n== {title}: {args.profiles} profiles, memory limit = 1F1B's peak (p) ==")
    for v in (1, 2):
        print(
            f"gap to lower bound, {v} stage(s)/worker: mean {100 * statistics.mean(gaps[v]):.2f}%"
            f", max {100 * max(gaps[v]):.2f}%"
        )
    print(
        f"win over best fitting built-in ({', '.join(n for n in BUILT_INS if n in SCHEDULES)}): "
        f"mean {100 * statistics.mean(wins):.2f}%, max {100 * max(wins):.2f}%, "
        f"cases above it: {above}/{len(wins)}"
    )
    print(
        f"the most any schedule can win over it (proven: lower bound under the limit): mean "
        f"{100 * statistics.mean(rooms):.2f}%, max {100 * max(rooms):.2f}%; the synthesized "
        f"reach {100 * sum(wins) / max(sum(rooms), 1e-12):.0f}% of that"
    )
    print(
        f"solve time per synthesize call: mean {statistics.mean(seconds):.2f} s, "
        f"max {max(seconds):.2f} s"
    )
    if not available():
        if args.exact_cases:
            print("exact: OR-Tools not installed (pip install 'pipesched[solver]'), skipped")
        return
    for v in (1, 2):
        if exact[v].tried:
            print(exact[v].report(v, args.exact_time))
    if optimum_wins:  # the most any schedule could win on these profiles
        print(
            f"the optimum's own win over the best fitting built-in, on the {len(optimum_wins)} "
            f"profiles proved on both placements: mean {100 * statistics.mean(optimum_wins):.2f}%, "
            f"max {100 * max(optimum_wins):.2f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=200)
    parser.add_argument(
        "--effort", type=int, default=1500, help="local-search moves (synthesize's default)"
    )
    parser.add_argument("--exact-cases", type=int, default=8)
    parser.add_argument("--exact-time", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for heavy in (False, True):
        run(args, heavy)


if __name__ == "__main__":
    main()
