"""Build, validate and simulate every built-in schedule at p=64, m=512; torch's generators beside.

Run: .venv/bin/python benchmarks/schedule_build.py [--workers 64] [--microbatches 512]
     [--repeat 3] [--json out.json]

For each schedule: seconds to build (get_schedule), validate, and simulate
(unit costs), best of --repeat, at 64 workers (interleaved-1f1b and zb-v then
have 128 stages). Beside it the anchor: torch.distributed.pipelining
generating the same per-rank orders (its _calculate_single_rank_operations,
called on a bare instance: no process group needed) and checking them with
its _validate_schedule, which checks counts and F-before-B per stage but not
deadlocks across ranks and does no timing. Target: under 2 s per schedule
for build + validate + simulate on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import time

from pipesched.schedule import SCHEDULES, get_schedule, stages_per_worker

TARGET_S = 2.0


def _best(fn, repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def ours(name: str, workers: int, m: int, repeat: int) -> dict[str, float]:
    v = stages_per_worker(name)
    times = {"build": 0.0, "validate": 0.0, "simulate": 0.0}
    best_total = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        schedule = get_schedule(name, workers * v, m)
        t1 = time.perf_counter()
        schedule.validate()
        t2 = time.perf_counter()
        timeline = schedule.simulate()
        _ = timeline.bubble_fraction, timeline.peak_activations
        t3 = time.perf_counter()
        if t3 - t0 < best_total:
            best_total = t3 - t0
            times = {"build": t1 - t0, "validate": t2 - t1, "simulate": t3 - t2}
    times["total"] = best_total
    times["bubble"] = timeline.bubble_fraction
    times["actions"] = sum(len(r) for r in schedule.actions)
    return times


def torch_anchor(name: str, workers: int, m: int, repeat: int) -> float | None:
    """Seconds for torch to generate and check the orders; None where it has no generator."""
    try:
        from torch.distributed.pipelining import schedules as ts
    except ImportError:  # pragma: no cover
        return None
    if name == "interleaved-1f1b":
        cls = ts.ScheduleInterleaved1F1B
        rounds = max(1, m // workers)
        attrs = {
            "n_local_stages": 2,
            "number_of_rounds": rounds,
            "microbatches_per_round": m // rounds,
        }
    elif name == "zb-v":
        cls, attrs = ts.ScheduleZBVZeroBubble, {"n_local_stages": 2, "num_stages": 2 * workers}
    else:
        return None  # torch's gpipe/1f1b are runtimes with no order to generate

    def run() -> None:
        generator = object.__new__(cls)
        generator.pp_group_size, generator._n_microbatches = workers, m
        for key, value in attrs.items():
            setattr(generator, key, value)
        order = {r: generator._calculate_single_rank_operations(r) for r in range(workers)}
        ts._validate_schedule(order, workers, 2 * workers, m)

    return _best(run, repeat)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    p, m = args.workers, args.microbatches
    print(
        f"schedule core at {p} workers, {m} micro-batches (best of {args.repeat}); "
        f"target < {TARGET_S:g} s each"
    )
    header = (
        f"{'schedule':<17}{'stages':>7}{'actions':>9}{'build s':>9}{'validate s':>11}"
        f"{'simulate s':>11}{'total s':>9}{'target':>8}{'bubble':>8}"
        f"{'torch gen+check s':>19}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for name in SCHEDULES:
        r = ours(name, p, m, args.repeat)
        anchor = torch_anchor(name, p, m, args.repeat)
        r["torch_generate_and_check"] = anchor
        results[name] = r
        ok = "ok" if r["total"] < TARGET_S else "MISSED"
        anchor_text = f"{anchor:.2f}" if anchor is not None else "n/a"
        print(
            f"{name:<17}{p * stages_per_worker(name):>7}{int(r['actions']):>9}"
            f"{r['build']:>9.2f}{r['validate']:>11.2f}{r['simulate']:>11.2f}"
            f"{r['total']:>9.2f}{ok:>8}{100 * r['bubble']:>7.2f}%{anchor_text:>19}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": p, "microbatches": m, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
