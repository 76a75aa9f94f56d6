"""``pipesched plan``: profile a user's model and print the planner's candidates and pick.

The model comes from ``FILE.py:FUNCTION`` (or ``package.module:FUNCTION``)
returning ``(model, batch)``. torch loads only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipesched.errors import ConfigError

__all__ = ["add_plan_parser", "run_plan"]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def memory_size(text: str) -> float:
    """``"2GiB"``, ``"512MiB"``, ``"1.5e9"``: bytes (an argparse type)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    try:
        value = float(match.group(1)) * _UNITS[unit] if match else -1.0
    except (ValueError, KeyError):
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive size in bytes, like 2GiB, 512MiB or 1.5e9, got {text!r}"
        )
    return value


def add_plan_parser(commands: Any, count: Callable[[str], int]) -> None:
    """Adds the ``plan`` command to the ``pipesched`` parser's subcommands."""
    from pipesched.schedule.builders import SCHEDULES

    plan = commands.add_parser(
        "plan",
        help="profile a model and compare schedule x cut x checkpoint (x chunks) in a budget",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    plan.add_argument("model", metavar="FILE.py:FUNCTION", help="returns (model, batch)")
    plan.add_argument("--workers", type=count, default=2, help="devices (pipeline ranks)")
    plan.add_argument(
        "--chunks", type=count, nargs="+", default=[8], help="micro-batch counts to compare"
    )
    plan.add_argument("--memory-budget", type=memory_size, help="bytes per worker, e.g. 8GiB")
    plan.add_argument("--device", default="cpu", help="where to profile (cpu, cuda:0)")
    plan.add_argument(
        "--checkpoint", nargs="+", help="modes to compare: always, except_last, never (all)"
    )
    plan.add_argument("--schedule", nargs="+", choices=list(SCHEDULES), help="built-ins (all)")
    plan.add_argument(
        "--no-synthesize", action="store_true", help="leave out synthesized schedules"
    )


def run_plan(args: argparse.Namespace) -> None:
    """Profiles the model for each ``--chunks`` and prints every candidate and the pick.

    Raises:
        ConfigError: the function cannot be found, returns something else than
            ``(model, batch)``, or the batch has fewer rows than a chunk count.
    """

    from pipesched.partition.call import Call
    from pipesched.planning import Planning, plan_model
    from pipesched.planning.devices import check_device, threads_per_worker
    from pipesched.runtime.stage.microbatch import scatter
    from pipesched.runtime.stage.recompute import CHECKPOINT_MODES

    model, batch = _load(args.model)
    call = batch if isinstance(batch, Call) else _call(batch)
    device = check_device(args.device, "--device", args.workers)
    threads = threads_per_worker(args.workers) if device.type == "cpu" else None
    plannings = []
    for chunks in args.chunks:
        parts = scatter(call, chunks)
        if len(parts) < chunks:
            raise ConfigError(
                f"--chunks {chunks}: the batch has only {len(parts)} rows; return a larger "
                "batch or ask for fewer chunks"
            )
        plannings.append(
            plan_model(
                model,
                parts[0] if parts[0].kwargs else tuple(parts[0].args),
                args.workers,
                chunks,
                device=device,
                num_threads=threads,
                memory_budget=args.memory_budget,
                schedules=args.schedule,
                checkpoints=args.checkpoint or CHECKPOINT_MODES,
                synthesized=not args.no_synthesize,
            )
        )
    best = min(plannings, key=lambda p: p.pick.step)
    fitting = sorted((c for p in plannings for c in p.candidates if c.fits), key=lambda c: c.step)
    others = sorted(
        (c for p in plannings for c in p.candidates if not c.fits), key=lambda c: c.step
    )
    merged = Planning(
        tuple(fitting + others),
        best.pick,
        args.workers,
        args.memory_budget,
        best.skipped,
        best.baseline,
        best.source,
    )
    print(merged)
    print(
        f"\nto build it: Pipeline(model, chunks={best.pick.chunks}, schedule='auto', "
        f"example_inputs=<one micro-batch>"
        # The budget exactly, to paste: 3MiB is 3145728, which .4g would print as 3.146e+06.
        + ("" if args.memory_budget is None else f", memory_budget={int(args.memory_budget)}")
        + ")"
    )


def _call(batch: Any) -> Any:
    from pipesched.partition.call import Call

    if isinstance(batch, dict):
        return Call((), dict(batch))
    if isinstance(batch, tuple):
        return Call(batch, {})
    return Call((batch,), {})


def _load(target: str) -> tuple[Any, Any]:
    """``FILE.py:FUNCTION`` or ``module:FUNCTION``, called: ``(model, batch)``."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ConfigError(
            f"the model must be FILE.py:FUNCTION or package.module:FUNCTION, got {target!r}"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{where}: no such file (the model is FILE.py:FUNCTION)")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{where}: cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{where} has no function {name!r} (the model is FILE.py:FUNCTION)")
    result = function()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ConfigError(
            f"{target}() must return (model, batch): the model and one mini-batch as it "
            f"takes it; it returned {type(result).__name__}"
        )
    return result[0], result[1]
