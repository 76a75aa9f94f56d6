"""One rank of the ordered-transport suite: `python ordered_worker.py SCENARIO OUT_DIR`.

Scenarios ``pp2``, ``pp2dp2``, ``pp4``, ``pp4dp2``: inside one process group,
every built-in schedule and a user's Schedule read from CSV run in turn, each
on a Pipeline of its own (built once the previous one is done), for two
windows of GradientAccumulator on a small fp64 MLP, with uneven rows per
replica (10 and 7 in 4 chunks: uneven micro-batches). Per schedule this rank
saves its stages' parameters, the window losses and norms, and the
transport's mode and stats. The test sets ``PIPESCHED_P2P=ordered``.

Scenario ``misordered``: pp=2, interleaved-1F1B, and pp rank 1 posts two
adjacent receives from pp rank 0 in swapped order (they belong to different
channels, so the tagged transport, which walks each channel in the sender's
order by tag, is unaffected; the ordered transport matches by posting order
and must refuse). Every micro-batch has the same rows (8 rows in 4 chunks),
so the swapped message lands in a buffer of the right size and its header
names it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline, Schedule
from pipesched.runtime import fused_linear, interpreter
from pipesched.runtime.mesh import init_mesh
from pipesched.schedule.transfers import Item, Recv

# pp=4 runs with replicas only: pp4dp2 is pp4 plus the gradient sync, and pp2 covers dp=1.
# With replicas only: dp=1 posts the same pipeline messages as dp=2, without the sync.
SCENARIOS = {"pp2dp2": (2, 2), "pp4dp2": (4, 2)}
SCHEDULES = (
    *("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"),
    *("zb-h2", "dualpipev", "v-half", "v-min", "csv"),
)
# Stages per worker; the others 1.
VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}
WINDOWS, STEPS, CHUNKS = 2, 2, 4
ROWS = (10, 7)  # rows per step of replica 0 and replica 1: uneven micro-batches
MISORDERED = ("interleaved-1f1b", 8)  # the misordered scenario's schedule and rows
WIDTH, LINEARS = 4, 8


def mlp() -> nn.Sequential:
    """8 Linear layers with Tanh between: 15 modules, enough for 8 stages."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, WIDTH)]
    for _ in range(LINEARS - 2):
        layers += [nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    layers += [nn.Tanh(), nn.Linear(WIDTH, 3)]
    return nn.Sequential(*layers).double()


def balance(num_stages: int) -> list[int]:
    """The MLP's modules over ``num_stages`` stages, as evenly as they go."""
    total = 2 * LINEARS - 1
    base, extra = divmod(total, num_stages)
    return [base + (s < extra) for s in range(num_stages)]


def user_schedule(num_stages: int) -> Schedule:
    """A user's table, read from CSV: GPipe's forwards, then the backwards in reverse order.

    Valid (a stage's B of micro-batch j follows the next stage's) and unlike
    every built-in schedule.
    """
    rows = [
        [f"{s}F{j}" for j in range(CHUNKS)] + [f"{s}B{j}" for j in reversed(range(CHUNKS))]
        for s in range(num_stages)
    ]
    return Schedule.from_csv("\n".join(",".join(row) for row in rows) + "\n", name="reversed")


def spec(name: str, pp: int) -> tuple[str | Schedule, int]:
    """The schedule to give Pipeline, and its number of stages."""
    if name == "csv":
        return user_schedule(pp), pp
    return name, pp * VIRTUAL.get(name, 1)


def data(window: int, step: int, replica: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * window + 10 * step + replica)
    return (
        torch.randn(rows, 6, generator=g, dtype=torch.float64),
        torch.randn(rows, 3, generator=g, dtype=torch.float64),
    )


def swapped(plan: Callable[[Schedule], tuple[tuple[Item, ...], ...]], worker: int):
    """``plan`` with ``worker``'s first two adjacent receives of different channels from one
    peer swapped, and a note of which."""
    swaps: list[str] = []

    def misordered(schedule: Schedule) -> tuple[tuple[Item, ...], ...]:
        rows = list(plan(schedule))
        row = list(rows[worker])
        for i in range(len(row) - 1):
            a, b = row[i], row[i + 1]
            if (
                type(a) is Recv
                and type(b) is Recv
                and a.peer == b.peer
                and (a.message.kind, a.message.stage) != (b.message.kind, b.message.stage)
            ):
                row[i], row[i + 1] = b, a
                swaps.append(f"{a} <-> {b}")
                break
        else:
            raise AssertionError(f"no two adjacent receives to swap in {row}")
        rows[worker] = tuple(row)
        return tuple(rows)

    return misordered, swaps


def train(mesh: object, name: str, pp: int, rows: tuple[int, ...]) -> dict[str, object]:
    """Two windows of GradientAccumulator on schedule ``name``: what this rank saw."""
    schedule, num_stages = spec(name, pp)
    pipe = Pipeline(
        mlp(),
        CHUNKS,
        balance=balance(num_stages),
        mesh=mesh,
        schedule=schedule,
        checkpoint="except_last",
    )
    acc = GradientAccumulator(
        pipe,
        torch.optim.SGD(pipe.parameters(), lr=0.1),
        accumulation_steps=STEPS,
        max_grad_norm=0.5,
    )
    replica = pipe.mesh.dp_rank
    losses, norms = [], []
    for window in range(WINDOWS):
        for step in range(STEPS):
            x, y = data(window, step, replica, rows[replica])
            result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
        losses.append(result.window_loss)
        norms.append(result.grad_norm)
    record = {
        "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
        "window_losses": losses,
        "norms": norms,
        "mode": pipe.engine.runtime.mode,
        "stats": dataclasses.asdict(pipe.engine.runtime.stats),
        "num_stages": pipe.num_stages,
    }
    del acc, pipe
    return record


def main() -> None:
    fused_linear.MIN_FUSED_BYTES = 0  # every weight fused: the fused path stays covered
    scenario, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if scenario == "misordered":
        name, rows = MISORDERED
        mesh = init_mesh(pp=2, dp=1, timeout=30)
        swaps: list[str] = []
        if rank == 1:  # this rank alone posts two receives in swapped order
            interpreter.transfer_plan, swaps = swapped(interpreter.transfer_plan, 1)
        results = {name: train(mesh, name, 2, (rows,))}
        results["swaps"] = swaps  # type: ignore[assignment]
    else:
        pp, dp = SCENARIOS[scenario]
        mesh = init_mesh(pp=pp, dp=dp, timeout=30)
        results = {name: train(mesh, name, pp, ROWS) for name in SCHEDULES}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    gc.collect()  # the pipelines (and their process groups) are gone
    torch.distributed.barrier()  # every rank's pipelines are gone before the group is
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
