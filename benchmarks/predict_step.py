"""Pipeline.predict() against the measured step, for every built-in schedule, local and on 2 ranks.

Run: .venv/bin/python benchmarks/predict_step.py [--rounds 7] [--only local|distributed]

Models: the runtime benchmarks' MLP (8 x Linear(1024) + ReLU, batch 256,
chunks 8) and a Transformer stack (4 x nn.TransformerEncoderLayer(256, 4
heads, ffn 1024), batch 32 x 64 tokens, chunks 8), checkpoint="except_last"
(the default), cut in 2 stages (4 for the schedules with 2 stages per
worker). Runtimes: local (2 CPU workers, one thread each) and distributed
(2 gloo ranks under torchrun, one thread each; the step's time is the slower
rank's, and predict() runs on both ranks, which must agree).

Each round steps every pipeline once, alternating, after one warm-up step:
measured is the median wall time of ``pipe.step``; predicted the median of
``pipe.predict().step_time`` called after each of those steps (each from that
one step's measured actions); error compares the two medians. Two columns
say why a row misses: "step err", the median of each step's prediction
against that same step's wall time, and "spread", the median over steps of
the mean coefficient of variation of like actions' durations (same stage,
kind, checkpointing) within a step. The prediction plays the means; when
like actions vary (other processes on the cores), a step takes longer than
its means say. The machine's cores may be shared (the load average is printed).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _torchrun import under_torchrun
from mlp_bench import BATCH, CHUNKS, LAYERS, WIDTH, loss_fn, mlp
from torch import nn

from pipesched import Pipeline
from pipesched.schedule import SCHEDULES, Timeline, get_schedule, stages_per_worker

D_MODEL, HEADS, FFN, BLOCKS, TOKENS, ROWS = 256, 4, 1024, 4, 64, 32


def transformer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
            for _ in range(BLOCKS)
        )
    )


MODELS: dict[str, tuple[Callable[[], nn.Sequential], int, Callable[[], tuple[Any, Any]]]] = {
    "mlp": (mlp, 2 * LAYERS, lambda: (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))),
    "transformer": (
        transformer,
        BLOCKS,
        lambda: (torch.randn(ROWS, TOKENS, D_MODEL), torch.randn(ROWS, TOKENS, D_MODEL)),
    ),
}


def schedules() -> list[str]:
    """Every built-in schedule that runs on 2 workers."""
    names = []
    for name in SCHEDULES:
        try:
            get_schedule(name, 2 * stages_per_worker(name), CHUNKS)
        except Exception:  # a builder that needs another shape: not this benchmark's
            continue
        names.append(name)
    return names


def pipelines(mesh: Any = None) -> dict[tuple[str, str], tuple[Pipeline, Any, Any]]:
    made = {}
    for model_name, (build, layers, data) in MODELS.items():
        x, y = data()
        for schedule in schedules():
            stages = 2 * stages_per_worker(schedule)
            placement: dict[str, Any] = (
                {"devices": ["cpu", "cpu"]} if mesh is None else {"mesh": mesh}
            )
            pipe = Pipeline(
                build(),
                CHUNKS,
                balance=[layers // stages] * stages,
                schedule=schedule,
                **placement,
            )
            made[model_name, schedule] = (pipe, x, y)
    return made


Result = tuple[float, float, float, float]


def spread(timeline: Timeline | None, stop: int) -> float:
    """The mean coefficient of variation of the durations of like actions in one step.

    Like: the same stage and kind, checkpointed or not. The prediction uses
    their means; a step whose like actions vary takes longer than its means
    say (the slowest of each wait decides).
    """
    if timeline is None:
        return float("nan")
    groups: dict[tuple[int, str, bool], list[float]] = {}
    for e in timeline.events:
        groups.setdefault((e.action.stage, e.action.kind, e.action.microbatch < stop), []).append(
            e.duration
        )
    cvs = [
        statistics.pstdev(d) / statistics.mean(d)
        for d in groups.values()
        if len(d) > 1 and statistics.mean(d) > 1e-3
    ]
    return statistics.mean(cvs) if cvs else 0.0


def measure(
    made: dict[tuple[str, str], tuple[Pipeline, Any, Any]],
    rounds: int,
    wall_of: Callable[[float], float] = lambda t: t,
    barrier: Callable[[], None] = lambda: None,
) -> dict[tuple[str, str], Result]:
    """Per pipeline, the medians over its steps of: predicted and measured seconds, each
    step's own error (its prediction against its wall time), and the spread of its actions.
    """
    walls: dict[tuple[str, str], list[float]] = {key: [] for key in made}
    predicted: dict[tuple[str, str], list[float]] = {key: [] for key in made}
    spreads: dict[tuple[str, str], list[float]] = {key: [] for key in made}
    for r in range(rounds + 1):
        for key, (pipe, x, y) in made.items():
            barrier()
            start = time.perf_counter()
            pipe.step(x, y, loss_fn=loss_fn)
            wall = wall_of(time.perf_counter() - start)
            pipe.zero_grad()
            if r:  # the first round warms up
                walls[key].append(wall)
                prediction = pipe.predict()  # a collective on a mesh: every rank calls it
                predicted[key].append(prediction.step_time)
                stop = CHUNKS - 1  # checkpoint="except_last"
                whole = pipe.gather_timeline()
                spreads[key].append(spread(whole, stop))
                if whole is not None and DETAIL:
                    DETAIL.setdefault(key, []).append(
                        (predicted[key][-1], wall, whole.makespan, prediction.makespan)
                    )
    return {
        key: (
            statistics.median(predicted[key]),
            statistics.median(walls[key]),
            statistics.median(p / w - 1 for p, w in zip(predicted[key], walls[key], strict=True)),
            statistics.median(spreads[key]),
        )
        for key in made
    }


def rows(runtime: str, results: dict[tuple[str, str], Result]) -> list[str]:
    lines = []
    for (model, schedule), (predicted, measured, own, cv) in results.items():
        error = 100 * (predicted - measured) / measured
        flag = "" if abs(error) <= 5 else "  MISSED"  # the README says within 5%
        lines.append(
            f"{model:12} {runtime:12} {schedule:17} {1e3 * predicted:9.1f} "
            f"{1e3 * measured:9.1f} {error:+7.1f}% {100 * own:+9.1f}% {100 * cv:6.0f}%{flag}"
        )
        for p, w, span, pred_span in DETAIL.get((model, schedule), []) if flag else []:
            lines.append(
                f"    step: predicted {1e3 * p:.1f} ms, wall {1e3 * w:.1f} ms; makespan "
                f"predicted {1e3 * pred_span:.1f} ms, measured {1e3 * span:.1f} ms"
            )
    return lines


DETAIL: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
"""With --detail: per missed row, each step's predicted and measured step and makespan."""

HEADER = (
    f"{'model':12} {'runtime':12} {'schedule':17} {'pred ms':>9} {'meas ms':>9} {'error':>8} "
    f"{'step err':>10} {'spread':>7}"
)


def local(rounds: int) -> None:
    torch.set_num_threads(1)
    made = pipelines()
    results = measure(made, rounds)
    print(
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}; "
        f"{rounds} alternating rounds"
    )
    print(HEADER)
    print("\n".join(rows("local", results)), flush=True)


def distributed_worker(rounds: int) -> None:
    import torch.distributed as dist

    from pipesched.runtime.mesh import init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(pp=2)
    made = pipelines(mesh)

    def slowest(t: float) -> float:
        elapsed = torch.tensor([t])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    results = measure(made, rounds, slowest, dist.barrier)
    mine = {key: round(p, 9) for key, (p, *_) in results.items()}
    everyone: list[Any] = [None] * 2
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        agree = everyone[0] == everyone[1]
        print(f"load average {os.getloadavg()[0]:.1f}; ranks' predictions agree: {agree}")
        print("\n".join(rows("2 gloo ranks", results)), flush=True)
    # The pipelines gone before the groups: a gloo work freed from gloo's own thread
    # while the interpreter exits aborts the process (pytorch/pytorch#190489).
    made.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("local", "distributed"))
    parser.add_argument("--detail", action="store_true", help="each step of a missed row")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.detail:
        DETAIL[("", "")] = []  # non-empty: record
    if args.worker:
        distributed_worker(args.rounds)
        return
    if args.only != "distributed":
        local(args.rounds)
    if args.only != "local":
        if args.only == "distributed":
            print(HEADER)
        argv = ["--worker", "--rounds", str(args.rounds)] + (["--detail"] if args.detail else [])
        code = under_torchrun(__file__, argv, timeout=900)
        if code:
            sys.exit(code)


if __name__ == "__main__":
    main()
