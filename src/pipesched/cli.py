"""The ``pipesched`` command: compare schedules and show their grids from the terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipesched.errors import PipeschedError
from pipesched.schedule import Costs, get_schedule, render_timeline, stages_per_worker
from pipesched.schedule.builders import SCHEDULES
from pipesched.schedule.compare import compare, format_comparison

__all__ = ["main"]

_WORKERS_HELP = (
    "pipeline depth in workers (devices); interleaved-1f1b and zb-v cut each worker's "
    "share of the model into 2 stages"
)
_COSTS_HELP = (
    "durations F,B,W[,SEND] of one worker's share of the model on one micro-batch "
    "(B: input gradient, W: weight gradient; schedules that do not split backward "
    "spend B+W at once); default 1,1,1,0"
)


def _costs(text: str) -> Costs:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--costs wants numbers F,B,W[,SEND], got {text!r}"
        ) from None
    if len(values) not in (3, 4):
        raise argparse.ArgumentTypeError(
            f"--costs wants 3 or 4 comma-separated numbers F,B,W[,SEND], got {text!r}"
        )
    try:
        return Costs(values[0], values[1], values[2], send=values[3] if len(values) == 4 else 0.0)
    except PipeschedError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipesched", description="Pipeline-parallel schedules: compare, show, simulate."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    simulate = commands.add_parser(
        "simulate", help="makespan, bubble and peak activations of every built-in schedule"
    )
    show = commands.add_parser("show", help="the time grid of one schedule")
    show.add_argument("--schedule", required=True, help=f"one of: {', '.join(SCHEDULES)}")
    for command in (simulate, show):
        command.add_argument(
            "--stages",
            "--workers",
            dest="workers",
            type=int,
            required=True,
            metavar="P",
            help=_WORKERS_HELP,
        )
        command.add_argument(
            "--chunks", type=int, required=True, metavar="M", help="micro-batches per step"
        )
        command.add_argument("--costs", type=_costs, default=Costs(), help=_COSTS_HELP)
    show.add_argument(
        "--order", action="store_true", help="also print each worker's actions in order"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "simulate":
            costs: Costs = args.costs
            print(
                f"{args.workers} workers, {args.chunks} micro-batches, costs per worker share: "
                f"F={costs.forward} B={costs.backward} W={costs.weight} send={costs.send}"
            )
            print(format_comparison(compare(args.workers, args.chunks, costs)))
        else:
            v = stages_per_worker(args.schedule)
            schedule = get_schedule(args.schedule, args.workers * v, args.chunks)
            timeline = schedule.simulate(args.costs.scaled(1 / v))
            print(
                f"{schedule.name}: {schedule.num_stages} stages on {schedule.num_workers} "
                f"workers, {schedule.num_microbatches} micro-batches"
            )
            print(render_timeline(timeline))
            if args.order:
                print(schedule.to_text(max_columns=10**9).split("\n", 1)[1])
    except PipeschedError as error:
        print(f"pipesched: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
