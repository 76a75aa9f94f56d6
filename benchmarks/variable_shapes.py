"""What micro-batches of their own shapes cost on 2 gloo ranks: the layout exchange vs the step.

Run: .venv/bin/python benchmarks/variable_shapes.py [--rounds 31]
     (it launches itself under torchrun with 2 processes, one intra-op thread each)

Method. A token model (Embedding, 8 x (Linear(256, 256) + GELU), Linear(256,
1024); a token loss summed, divided by ``num_items``), cut into 2 stages on 2
ranks, schedule 1f1b, 8 micro-batches of 2 rows and sequence lengths 96, 160,
64, 192, 128, 112, 144, 128 (2048 tokens): every transfer has a layout of its
own. The same micro-batches run on three pipelines that differ only in what
their transport exchanges about shapes:

- steady: the default on gloo/TCP after the first step: each channel's
  receive buffer is its largest message so far, every message's header
  carries its layout, no notice is sent;
- cold: the same, with every channel's layout state forgotten (on both
  ranks) before each step: every step pays what a first step pays (a
  header-only notice each time a channel's largest message grows);
- exact: the protocol NCCL needs (and every backend used before): a receive
  exactly the message's size, so a notice, sized as the receiver expects,
  precedes every change of layout (16 a step here) and the data's receive is
  posted only once the notice is read.

The shape exchange's cost is ``cold / steady - 1``: same shapes, same
compute, same bubbles; only the exchange differs. Target: < 2% of the step.
For scale, ``fixed`` runs 8 x 128 tokens (the same FLOPs, one shape):
``steady / fixed`` is what varying shapes cost in all (mostly GEMMs of other
sizes, and bubbles where neighbours differ in length). Contenders alternate
round by round in the same two processes; a round's time is the slower
rank's; each ratio is the median over rounds of that round's ratio (paired,
so load that moves during the run cancels out). The machine is shared (2
cores): run it twice if a number looks odd.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, WIDTH, LAYERS, ROWS = 1024, 256, 8, 2
VARIED = (96, 160, 64, 192, 128, 112, 144, 128)
FIXED = (128,) * len(VARIED)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(VOCAB, WIDTH)]
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, VOCAB))


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def batches(lengths: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, VOCAB, (ROWS, n), generator=g) for n in lengths]
    ys = [torch.randint(0, VOCAB, (ROWS, n), generator=g) for n in lengths]
    return xs, ys


def contenders(rank: int) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    from pipesched import Pipeline
    from pipesched.distributed import init_mesh

    mesh = init_mesh(pp=2)
    half = 1 + LAYERS  # embedding + 4 blocks | 4 blocks + head
    runs: dict[str, Callable[[], None]] = {}
    transports: dict[str, Any] = {}
    for name, lengths in (
        ("steady", VARIED),
        ("cold", VARIED),
        ("exact", VARIED),
        ("fixed", FIXED),
    ):
        pipe = Pipeline(model(), 1, balance=[half, len(model()) - half], mesh=mesh, schedule="1f1b")
        transport = pipe._runtime.transport
        transport._roomy = transport._roomy and name != "exact"
        xs, ys = batches(lengths)
        items = sum(y.numel() for y in ys)

        def step(
            pipe: Any = pipe,
            cold: bool = name == "cold",
            xs: Any = xs,
            ys: Any = ys,
            n: int = items,
        ) -> None:
            if cold:  # both ranks forget, between steps (no receive is pending then)
                pipe._runtime.transport._sent.clear()
                pipe._runtime.transport._expected.clear()
            pipe.step(microbatches=xs, targets=ys, loss_fn=token_sum, num_items=n)

        runs[name] = step
        transports[name] = transport
    return runs, transports


def worker(rounds: int) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    runs, transports = contenders(rank)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for fn in runs.values():  # warm-up, first layouts exchanged
        dist.barrier()
        fn()
    notices = {name: 0 for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            before = transports[name].notices
            start = time.perf_counter()
            runs[name]()
            elapsed = torch.tensor([time.perf_counter() - start])
            notices[name] = transports[name].notices - before
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
    sent = torch.tensor([notices[name] for name in names])
    dist.all_reduce(sent)  # both ranks' notices (activations one way, gradients the other)
    if rank == 0:
        report(times, rounds, dict(zip(names, sent.tolist(), strict=True)))
    dist.destroy_process_group()


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def report(times: dict[str, list[float]], rounds: int, notices: dict[str, int]) -> None:
    print(
        f"Embedding + {LAYERS} x Linear({WIDTH}) + GELU + head, 2 stages (1f1b), 8 micro-batches "
        f"of {ROWS} rows, {ROWS * sum(FIXED)} tokens a step; 2 gloo processes, 1 thread each; "
        f"median of {rounds} alternating rounds"
    )
    print(f"{'contender':<10}{'step ms':>9}{'notices/step':>14}{'x steady':>10}")
    for name, t in times.items():
        ratio = _paired(times, name, "steady")
        print(f"{name:<10}{1000 * statistics.median(t):>9.1f}{notices[name]:>14}{ratio:>10.3f}")
    cost = _paired(times, "cold", "steady") - 1
    exact = _paired(times, "exact", "steady") - 1
    shapes = _paired(times, "steady", "fixed") - 1
    print(
        f"shape exchange (cold vs steady): {100 * cost:+.1f}% of the step; the exact-size "
        f"protocol: {100 * exact:+.1f}%; varying shapes in all (steady vs fixed): "
        f"{100 * shapes:+.1f}%"
    )
    verdict = "ok" if cost < 0.02 else "FAIL"
    print(f"target shape exchange < 2% of step time: {100 * cost:.1f}% {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.rounds)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        "--rounds",
        str(args.rounds),
    ]
    sys.exit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
