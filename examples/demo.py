"""The main job of `make demo`: compare the built-in pipeline schedules on paper.

Run: make demo          (or: .venv/bin/python examples/demo.py)

It builds every built-in schedule for 4 workers and 8 micro-batches, checks
each can run (no missing action, no deadlock), simulates it with unit costs
and with costs where backward takes twice the forward and sends take time,
and prints the comparison, then the time grids of 1F1B and ZB-H1.
"""

from __future__ import annotations

from pipesched.schedule import Costs, compare, render_timeline
from pipesched.schedule.compare import format_comparison

WORKERS, MICROBATCHES = 4, 8


def main() -> None:
    results = []
    for title, costs in [
        ("equal costs: F = B = W = 1, no send latency", Costs(1, 1, 1)),
        (
            "backward twice the forward (B = 1.2 input + W = 0.8 weight), send 0.1",
            Costs(1, 1.2, 0.8, send=0.1),
        ),
    ]:
        rows = compare(WORKERS, MICROBATCHES, costs)
        results.append(rows)
        print(f"\n{WORKERS} workers, {MICROBATCHES} micro-batches, {title}")
        print(format_comparison(rows))
    print("\nTime grids, equal costs (a column per time unit; -- continues an action, . is idle):")
    for row in results[0]:
        if row.name in ("1f1b", "zb-h1") and row.timeline is not None:
            print(f"{row.name}:")
            print(render_timeline(row.timeline))
    print("\nTry: .venv/bin/pipesched show --schedule 1f1b --stages 4 --chunks 8")


if __name__ == "__main__":
    main()
