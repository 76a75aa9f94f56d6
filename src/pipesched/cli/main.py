"""The ``pipesched`` command: compare, show and draw schedules and runs; convert checkpoints.

The schedule commands import neither torch nor matplotlib; the others import them
only when they run. Every number is checked before any work (an argparse error,
exit status 2), and a schedule over :data:`~pipesched.schedule.limits.MAX_ACTIONS`
actions is refused before anything is built.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipesched.analysis.compare import compare, format_comparison
from pipesched.cli.plan_command import add_plan_parser, run_plan
from pipesched.errors import ConfigError, PipeschedError
from pipesched.schedule import Costs, Timeline, get_schedule, render_timeline, stages_per_worker
from pipesched.schedule.builders import SCHEDULES, check_size_of
from pipesched.schedule.limits import MAX_ACTIONS, limit_text

__all__ = ["main"]

_WORKERS_HELP = (
    "pipeline depth in workers (devices); interleaved-1f1b and the V schedules (zb-v, "
    "dualpipev, v-half, v-min) cut each worker's share of the model into 2 stages"
)
_COSTS_HELP = (
    "durations F,B,W[,SEND] of one worker's share of the model on one micro-batch "
    "(B: input gradient, W: weight gradient; schedules that do not split backward "
    "spend B+W at once); default 1,1,1,0"
)


_MAX_COUNT = MAX_ACTIONS // 2
"""The most stages or micro-batches: every schedule runs at least F and B of each."""
_MAX_BATCH_COUNT = 2**53
"""The most samples, GPUs or micro-batches ``batch`` takes: floats hold whole numbers exactly."""
_COST_RANGE = (1e-9, 1e9)
"""A nonzero cost's bounds: the time grid divides the makespan by the shortest pass."""


def _count(maximum: int, why: str) -> Callable[[str], int]:
    """An argparse type: a positive integer up to ``maximum``, read without int() on huge text."""

    def parse(text: str) -> int:
        value = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]+", value):
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
        digits = value.lstrip("+-").lstrip("0") or "0"
        if value.startswith("-") or digits == "0":
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
        if len(digits) > len(str(maximum)) or int(digits) > maximum:
            shown = digits if len(digits) <= 12 else f"{digits[:12]}... ({len(digits)} digits)"
            raise argparse.ArgumentTypeError(f"must be at most {maximum} ({why}), got {shown}")
        return int(digits)

    return parse


_schedule_count = _count(
    _MAX_COUNT, f"a schedule within {limit_text()} runs F and B of each stage and micro-batch"
)
_batch_count = _count(_MAX_BATCH_COUNT, "2**53, the largest whole number a float holds exactly")


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


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
    low, high = _COST_RANGE
    if not all(v == 0 or low <= v <= high for v in values):
        raise argparse.ArgumentTypeError(
            f"--costs values must each be 0 or between {low:g} and {high:g} (the time grid "
            f"divides the longest time by the shortest), got {text!r}"
        )
    try:
        return Costs(values[0], values[1], values[2], send=values[3] if len(values) == 4 else 0.0)
    except PipeschedError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipesched",
        description="Pipeline-parallel schedules: compare, show, simulate, draw.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    simulate = commands.add_parser(
        "simulate", help="makespan, bubble and peak activations of every built-in schedule"
    )
    show = commands.add_parser("show", help="the time grid of one schedule")
    viz = commands.add_parser(
        "viz", help="draw one schedule's simulated timeline (PNG or SVG, by the suffix of -o)"
    )
    drawn = commands.add_parser(
        "compare", help="draw every built-in schedule stacked on one time axis (PNG or SVG)"
    )
    for command in (show, viz):
        command.add_argument("--schedule", required=True, help=f"one of: {', '.join(SCHEDULES)}")
    for command in (simulate, show, viz, drawn):
        command.add_argument(
            "--stages",
            "--workers",
            dest="workers",
            type=_schedule_count,
            required=True,
            metavar="P",
            help=_WORKERS_HELP,
        )
        command.add_argument(
            "--chunks",
            type=_schedule_count,
            required=True,
            metavar="M",
            help="micro-batches per step",
        )
        command.add_argument("--costs", type=_costs, default=Costs(), help=_COSTS_HELP)
    show.add_argument(
        "--order", action="store_true", help="also print each worker's actions in order"
    )
    for command in (viz, drawn):
        command.add_argument(
            "-o", "--output", required=True, type=Path, metavar="FILE", help="out.png or out.svg"
        )
    trace = commands.add_parser(
        "trace",
        help="draw a timeline saved with Timeline.save (e.g. pipe.last_timeline.save('run.json'))",
    )
    trace.add_argument("timeline", type=Path, metavar="TIMELINE.json", help="a saved timeline")
    trace.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        metavar="FILE",
        help="run.png or run.svg for a picture; run.trace.json for a Chrome trace "
        "(open in https://ui.perfetto.dev or chrome://tracing)",
    )
    trace.add_argument(
        "--plan",
        metavar="SCHEDULE",
        help="also draw this schedule's plan under the run, simulated with the per-stage "
        "costs measured in it (the schedule the run used, e.g. 1f1b)",
    )
    batch = commands.add_parser(
        "batch",
        help="accumulation steps for a target effective batch, and the nearest whole choices",
    )
    count = _batch_count
    batch.add_argument("--target", type=count, required=True, help="effective batch wanted")
    batch.add_argument("--micro-batch", type=count, required=True, help="samples per micro-batch")
    batch.add_argument("--chunks", type=count, default=1, help="micro-batches per pipeline step")
    batch.add_argument("--nodes", type=count, default=1, help="machines")
    batch.add_argument("--gpus-per-node", type=count, default=1, help="GPUs (ranks) per machine")
    batch.add_argument(
        "--pp", type=count, default=1, help="pipeline ranks per replica (replicas = GPUs / pp)"
    )
    batch.add_argument("--lr", type=_learning_rate, help="learning rate tuned for the target batch")
    checkpoint = commands.add_parser(
        "checkpoint", help="sharded checkpoints: show one, export its model, import a model"
    )
    actions = checkpoint.add_subparsers(dest="action", required=True)
    shown = actions.add_parser("show", help="what a checkpoint holds and the layout that saved it")
    shown.add_argument("checkpoint", metavar="CHECKPOINT", help="a sharded checkpoint directory")
    export = actions.add_parser(
        "export", help="the model as the plain model's state_dict file (for load_state_dict)"
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a sharded checkpoint directory")
    export.add_argument("output", metavar="OUT.pt", help="the state_dict file to write")
    imported = actions.add_parser(
        "import", help="a plain state_dict file as a model-only sharded checkpoint"
    )
    imported.add_argument("state_dict", metavar="STATE.pt", help="torch.save(model.state_dict())")
    imported.add_argument("checkpoint", metavar="CHECKPOINT", help="the directory to write")
    add_plan_parser(commands, _schedule_count)
    return parser


def _checkpoint(args: argparse.Namespace) -> None:
    from pipesched.train import export

    if args.action == "show":
        print(export.describe(args.checkpoint))
    elif args.action == "export":
        export.export_model(args.checkpoint, args.output)
        print(f"wrote {args.output}: the model's state_dict from {args.checkpoint}")
    else:
        export.import_model(args.state_dict, args.checkpoint)
        print(f"wrote {args.checkpoint}: a model-only sharded checkpoint of {args.state_dict}")


def _batch(args: argparse.Namespace) -> None:
    from pipesched.train.batch_size import plan_accumulation

    gpus = args.nodes * args.gpus_per_node
    if args.pp < 1 or gpus % args.pp:
        raise ConfigError(
            f"--pp {args.pp} must divide the {gpus} GPUs ({args.nodes} nodes x "
            f"{args.gpus_per_node}); each replica is a pipeline of pp ranks"
        )
    plan = plan_accumulation(
        args.target, args.micro_batch, chunks=args.chunks, replicas=gpus // args.pp, lr=args.lr
    )
    print(plan.describe())


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command in ("simulate", "show", "viz", "compare"):
            _check_sizes(args)
        if args.command in ("viz", "compare", "trace"):
            _draw(args)
        elif args.command == "batch":
            _batch(args)
        elif args.command == "checkpoint":
            _checkpoint(args)
        elif args.command == "plan":
            run_plan(args)
        elif args.command == "simulate":
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
    except (PipeschedError, ImportError, OSError) as error:
        print(f"pipesched: error: {error}", file=sys.stderr)
        return 2
    return 0


def _check_sizes(args: argparse.Namespace) -> None:
    """Refuses, before anything is built or imported, schedules over MAX_ACTIONS actions."""
    names = [args.schedule] if args.command in ("show", "viz") else list(SCHEDULES)
    for name in names:
        check_size_of(name, args.workers * stages_per_worker(name), args.chunks)


def _draw(args: argparse.Namespace) -> None:
    """The drawing commands; pipesched.viz (and matplotlib) load here, not before."""
    from pipesched import viz

    out: Path = args.output
    if args.command == "trace":
        timeline = Timeline.load(args.timeline)
        plan = None
        if args.plan is not None:
            plan = _plan(timeline, args.plan)
        if out.suffix.lower() == ".json":
            if plan is not None:
                raise ConfigError(
                    "--plan draws the plan under a picture; a trace (.json) shows the run only. "
                    "Leave out --plan, or write a .png or .svg"
                )
            viz.chrome_trace(timeline, out)
        else:
            viz.gantt(timeline, out, overlay=plan)
    elif args.command == "viz":
        v = stages_per_worker(args.schedule)
        schedule = get_schedule(args.schedule, args.workers * v, args.chunks)
        title = (
            f"{schedule.name}: {schedule.num_stages} stages on {schedule.num_workers} workers, "
            f"{schedule.num_microbatches} micro-batches, {_per_share(args.costs)}"
        )
        viz.gantt(schedule, out, costs=args.costs.scaled(1 / v), title=title)
    else:
        title = f"{args.workers} workers, {args.chunks} micro-batches, {_per_share(args.costs)}"
        viz.gantt_comparison(compare(args.workers, args.chunks, args.costs), out, title=title)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")


def _per_share(costs: Costs) -> str:
    values = (costs.forward, costs.backward, costs.weight, costs.send)
    f, b, w, send = (f"{x:g}" if isinstance(x, int | float) else str(x) for x in values)
    return f"F={f} B={b} W={w} send={send} per worker share"


def _plan(timeline: Timeline, name: str) -> Timeline:
    """Schedule ``name`` for ``timeline``'s pipeline, simulated with its measured costs."""
    m = 1 + max((e.action.microbatch for e in timeline.events), default=0)
    schedule = get_schedule(name, timeline.num_stages, m)
    if schedule.placement != timeline.placement:
        raise ConfigError(
            f"--plan {name} places stages on workers {list(schedule.placement)} but the run "
            f"placed them on {list(timeline.placement)}; name the schedule the run used"
        )
    return schedule.simulate(timeline.measured_costs())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
