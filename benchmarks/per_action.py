"""Per-action cost: many micro-batches of a tiny model, where the runtime's own work shows.

Run: .venv/bin/python benchmarks/per_action.py [--rounds 7] [--only local|distributed]
     [--save-baseline]   (writes benchmarks/per_action_baseline.json, printed beside later runs)

Many micro-batches keep the pipeline bubble small, so what a step costs per
action (one stage's forward or backward of one micro-batch) matters. The model
here is 4 x Linear(16, 16) (no activations; a few microseconds of compute per
action), so a step's time is almost all pipesched's (or torch's) own work.

Distributed (2 gloo processes launched under torchrun, one intra-op thread
each; a step's time is the slower rank's): the 4 Linear layers cut into 2
stages of 2 Linear each, one stage per rank (torch's ``Schedule1F1B`` runs
one stage per rank), 256 micro-batches of 4 rows. pipesched 1f1b is
``Pipeline(..., balance=[2, 2], mesh=init_mesh(pp=2), schedule="1f1b",
checkpoint="never")``; torch 1F1B is ``Schedule1F1B`` over a ``PipelineStage``
of the same 2 Linear layers, same weights, same data and mean-squared-error
loss. Target: pipesched 1f1b <= 1.0x torch 1F1B, on the medians and on the
bests. Also printed: the median of the rounds' ratios (each round runs the
two back to back, so load that drifts over a run hits both alike). gloo's
latency makes single rounds vary by +-10%: run 31 rounds for a verdict.

Local (this process, 2 CPU stages in 2 worker threads): the same model,
``Pipeline(model, chunks=m, balance=[2, 2], devices=["cpu", "cpu"],
schedule="1f1b", checkpoint="never")`` on a batch of 1024 rows, for m = 8, 32,
128, 512. Beside it, measured in the same rounds:

- compute: the same two stages' forward and backward of the same m
  micro-batches (each stage's input a fresh leaf, the loss weighted as
  pipesched weighs it) run plainly, one after the other, in one thread: the
  arithmetic a step cannot avoid. (The pipeline's two workers could overlap
  it, so step - compute slightly understates the overhead.)
- overhead = step - compute, and per action: / (4 m) (2 stages, F and B).
- plain: the unpipelined model's forward and backward of the whole batch.

Target: the per-action overhead at most half of the baseline's.
Contenders alternate round by round; medians (and bests) of the rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

WIDTH, LAYERS = 16, 4
DIST_MICROBATCHES, DIST_ROWS = 256, 4
LOCAL_BATCH, LOCAL_COUNTS = 1024, (8, 32, 128, 512)
BASELINE = Path(__file__).with_name("per_action_baseline.json")


def tiny() -> nn.Sequential:
    """4 x Linear(16, 16), the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def timed(
    runs: dict[str, Callable[[], None]], rounds: int, sync: Callable[[float], float]
) -> dict[str, list[float]]:
    """Each run's times over ``rounds`` rounds, the order rotated each round (one warm-up)."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for fn in runs.values():
        sync(0.0)
        fn()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(0.0)
            start = time.perf_counter()
            runs[name]()
            times[name].append(sync(time.perf_counter() - start))
    return times


# Distributed: one stage per rank, pipesched vs torch.


def distributed_worker(rounds: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipesched import Pipeline
    from pipesched.runtime.mesh import init_mesh

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    mesh = init_mesh(pp=2)
    m, half = DIST_MICROBATCHES, LAYERS // 2
    torch.manual_seed(1)
    x, y = torch.randn(m * DIST_ROWS, WIDTH), torch.randn(m * DIST_ROWS, WIDTH)
    pipe = Pipeline(tiny(), m, balance=[half, half], mesh=mesh, schedule="1f1b", checkpoint="never")
    module = tiny()[half * rank : half * (rank + 1)]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(x.chunk(m)[0],))
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)

    def torch_step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])

    def slowest(elapsed: float) -> float:
        t = torch.tensor([elapsed])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    runs = {
        "pipesched 1f1b": lambda: pipe.step(x, y, loss_fn=loss_fn) and None,
        "torch 1F1B": torch_step,
    }
    times = timed(runs, rounds, slowest)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    # Both pipelines gone before the groups: a gloo work freed from gloo's own thread
    # while the interpreter exits aborts the process (pytorch/pytorch#190489).
    runs.clear()
    pipe = sched = stage = None  # type: ignore[assignment]
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def distributed_rows(rounds: int) -> dict[str, list[float]]:
    from _torchrun import under_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        code = under_torchrun(__file__, ["--rounds", str(rounds), "--worker-out", out])
        if code != 0:
            sys.exit(code)
        return json.loads(Path(out).read_text())


# Local: the local runtime vs the same compute run plainly.


def compute_step(m: int, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Both stages' forward and backward of the m micro-batches, plainly, in one thread."""
    model, half = tiny(), LAYERS // 2
    stages = [model[:half], model[half:]]
    micro = list(zip(x.chunk(m), y.chunk(m), strict=True))
    weights = [xi.shape[0] / x.shape[0] for xi, _ in micro]

    def run() -> None:
        for (xi, yi), weight in zip(micro, weights, strict=True):
            h = stages[0](xi)
            leaf = h.detach().requires_grad_()
            loss = loss_fn(stages[1](leaf), yi) * weight
            loss.backward()
            h.backward(leaf.grad)

    return run


def local_rows(rounds: int) -> dict[str, list[float]]:
    from pipesched import Pipeline

    torch.manual_seed(1)
    x, y = torch.randn(LOCAL_BATCH, WIDTH), torch.randn(LOCAL_BATCH, WIDTH)
    plain = tiny()
    runs: dict[str, Callable[[], None]] = {}

    def plain_step() -> None:
        loss_fn(plain(x), y).backward()

    runs["plain"] = plain_step
    for m in LOCAL_COUNTS:
        half = LAYERS // 2
        pipe = Pipeline(
            tiny(),
            m,
            balance=[half, half],
            devices=["cpu", "cpu"],
            schedule="1f1b",
            checkpoint="never",
        )
        runs[f"step m={m}"] = lambda pipe=pipe: pipe.step(x, y, loss_fn=loss_fn) and None
        runs[f"compute m={m}"] = compute_step(m, x, y)
    cores = torch.get_num_threads()
    torch.set_num_threads(1)  # the compute and plain runs: one thread, as each stage worker has
    try:
        return timed(runs, rounds, lambda t: t)
    finally:
        torch.set_num_threads(cores)


# Report.


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {n: {"median": statistics.median(t), "best": min(t)} for n, t in times.items()}
    if "torch 1F1B" in times:  # round by round: both ran back to back, under the same load
        pairs = zip(times["pipesched 1f1b"], times["torch 1F1B"], strict=True)
        out["paired"] = {"median": statistics.median(a / b for a, b in pairs)}
    return out


def print_distributed(now: dict[str, dict[str, float]], base: dict | None, rounds: int) -> None:
    print(
        f"distributed: {LAYERS} x Linear({WIDTH}) as 2 stages of 2 Linear (one per rank), "
        f"{DIST_MICROBATCHES} micro-batches of {DIST_ROWS} rows, 2 gloo processes, 1 thread each; "
        f"{rounds} alternating rounds"
    )
    print(f"{'contender':<18}{'median ms':>10}{'best ms':>9}{'baseline ms':>13}")
    for name, t in now.items():
        if name == "paired":
            continue
        b = base.get(name, {}).get("median") if base else None
        was = f"{1000 * b:>13.1f}" if b else f"{'-':>13}"
        print(f"{name:<18}{1000 * t['median']:>10.1f}{1000 * t['best']:>9.1f}{was}")
    ours, theirs = now["pipesched 1f1b"], now["torch 1F1B"]
    ratio, best = ours["median"] / theirs["median"], ours["best"] / theirs["best"]
    print(
        f"target pipesched 1f1b <= 1.0x torch 1F1B: {ratio:.2f}x median, {best:.2f}x best "
        f"{'ok' if max(ratio, best) <= 1.0 else 'MISSED'} (judged on both: gloo under load "
        "inflates single rounds of either contender)"
    )
    print(
        f"median of the rounds' ratios (each round's two steps back to back): "
        f"{now['paired']['median']:.2f}x"
    )


def print_local(now: dict[str, dict[str, float]], base: dict | None, rounds: int) -> None:
    print(
        f"local: {LAYERS} x Linear({WIDTH}), batch {LOCAL_BATCH}, 2 CPU stages of 2 Linear "
        f"(1f1b, 2 worker threads); plain model {1000 * now['plain']['median']:.1f} ms; "
        f"{rounds} alternating rounds (medians; per action: overhead / 4m)"
    )
    print(
        f"{'m':>5}{'step ms':>9}{'best':>8}{'compute':>9}{'overhead':>10}"
        f"{'us/action':>11}{'baseline':>10}{'ratio':>7}"
    )
    worst = 0.0
    for m in LOCAL_COUNTS:
        step, compute = now[f"step m={m}"], now[f"compute m={m}"]
        per = 1e6 * (step["median"] - compute["median"]) / (4 * m)
        line = (
            f"{m:>5}{1000 * step['median']:>9.1f}{1000 * step['best']:>8.1f}"
            f"{1000 * compute['median']:>9.1f}{1000 * (step['median'] - compute['median']):>10.1f}"
            f"{per:>11.1f}"
        )
        if base and f"step m={m}" in base:
            was = 1e6 * (base[f"step m={m}"]["median"] - base[f"compute m={m}"]["median"]) / (4 * m)
            worst = max(worst, per / was)
            line += f"{was:>10.1f}{per / was:>7.2f}"
        print(line)
    if base:
        print(
            f"target per-action overhead <= 0.5x baseline at every m: worst {worst:.2f}x "
            f"{'ok' if worst <= 0.5 else 'MISSED'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("local", "distributed"))
    parser.add_argument("--save-baseline", action="store_true")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        distributed_worker(args.rounds, args.worker_out)
        return
    base = (
        json.loads(BASELINE.read_text()) if BASELINE.exists() and not args.save_baseline else None
    )
    results: dict[str, dict[str, float]] = {}
    if args.only != "local":
        now = summary(distributed_rows(args.rounds))
        print_distributed(now, base, args.rounds)
        results |= {k: v for k, v in now.items() if k != "paired"}
        print()
    if args.only != "distributed":
        now = summary(local_rows(args.rounds))
        print_local(now, base, args.rounds)
        results |= now
    if args.save_baseline:
        saved = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
        BASELINE.write_text(json.dumps(saved | results, indent=1) + "\n")
        print(f"\nsaved as the baseline: {BASELINE.name}")


if __name__ == "__main__":
    main()
