"""Distributed runtime on 2 CPU processes (gloo): pipesched vs torch.distributed.pipelining.

Run: .venv/bin/python benchmarks/distributed_cpu.py [--rounds 11]
     (it launches itself under torchrun with 2 processes, one intra-op thread each)

Model: 8 x (Linear(1024, 1024) + ReLU), batch 256, chunks 8, cut into 2
stages (4 for zb-v, 2 per rank). Contenders, alternated round by round in the
same two processes (median of the rounds; a step's time is the slower rank's):

- plain: the whole model, forward + backward, one thread on rank 0.
- ceiling: each rank runs its stage's forward and backward of all 8
  micro-batches with no communication: what two processes can give at all.
- pipesched gpipe / 1f1b / zb-h1 / zb-v: ``Pipeline(..., mesh=init_mesh(2))``,
  checkpoint="never" (weight gradients accumulated in the GEMM, the default).
- pipesched 1f1b / zb-v unfused: the same with ``fuse_weight_grads=False``,
  autograd's own accumulation, as the ceiling and torch use: what the
  runtime and schedule give without the fusion.
- torch ScheduleGPipe / Schedule1F1B: torch.distributed.pipelining on the same split.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _torchrun import under_torchrun
from mlp_bench import BATCH, CHUNKS, LAYERS, WIDTH, loss_fn, mlp, print_table

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-v")


def contenders(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from pipesched import Pipeline
    from pipesched.runtime.mesh import init_mesh

    mesh = init_mesh(pp=2)
    runs: dict[str, Callable[[], None]] = {}
    plain = mlp()

    def plain_step() -> None:
        if rank == 0:
            loss_fn(plain(x), y).backward()

    runs["plain (1 process)"] = plain_step
    half = mlp()[LAYERS * rank : LAYERS * (rank + 1)]
    micro = x.chunk(CHUNKS)

    def ceiling() -> None:
        for mb in micro:
            out = half(mb.detach().requires_grad_())
            out.backward(torch.ones_like(out))

    runs["ceiling (no comms)"] = ceiling
    for schedule, fuse in (*((s, True) for s in SCHEDULES), ("1f1b", False), ("zb-v", False)):
        balance = [LAYERS] * 2 if schedule != "zb-v" else [LAYERS // 2] * 4
        pipe = Pipeline(
            mlp(),
            CHUNKS,
            balance=balance,
            mesh=mesh,
            schedule=schedule,
            checkpoint="never",
            fuse_weight_grads=fuse,
        )
        name = f"pipesched {schedule}" + ("" if fuse else " unfused")
        runs[name] = lambda pipe=pipe: pipe.step(x, y, loss_fn=loss_fn) and None
    for name, cls in (("torch GPipe", ScheduleGPipe), ("torch 1F1B", Schedule1F1B)):
        module = mlp()[LAYERS * rank : LAYERS * (rank + 1)]
        stage = PipelineStage(
            module, rank, 2, torch.device("cpu"), input_args=(x.chunk(CHUNKS)[0],)
        )
        sched = cls(stage, n_microbatches=CHUNKS, loss_fn=loss_fn)

        def torch_step(sched=sched) -> None:
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])

        runs[name] = torch_step
    return runs


def worker(rounds: int) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    runs = contenders(rank, x, y)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for fn in runs.values():  # warm-up, shapes exchanged
        dist.barrier()
        fn()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
    if rank == 0:
        report({name: statistics.median(t) for name, t in times.items()}, rounds)
    dist.destroy_process_group()


def report(median: dict[str, float], rounds: int) -> None:
    plain, ceiling = median["plain (1 process)"], median["ceiling (no comms)"]
    print(
        f"{LAYERS} x Linear({WIDTH}) + ReLU, batch {BATCH}, chunks {CHUNKS}, 2 gloo processes, "
        f"1 thread each; median of {rounds} alternating rounds"
    )
    print_table(median, plain, ceiling)
    ours, theirs = median["pipesched 1f1b"], median["torch 1F1B"]
    share = ceiling / ours
    print(
        f"target pipesched 1f1b >= 0.80 of ceiling: {share:.2f} "
        f"{'ok' if share >= 0.80 else 'MISSED'}; vs torch 1F1B: {theirs / ours:.2f}x "
        f"{'ok' if ours <= theirs else 'MISSED'}"
    )
    best = min(("zb-h1", "zb-v"), key=lambda n: median[f"pipesched {n}"])
    speedup = theirs / median[f"pipesched {best}"]
    print(
        f"target best zero-bubble ({best}) >= 1.05x torch 1F1B: {speedup:.2f}x "
        f"{'ok' if speedup >= 1.05 else 'MISSED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.rounds)
        return
    sys.exit(under_torchrun(__file__, ["--rounds", str(args.rounds)]))


if __name__ == "__main__":
    main()
