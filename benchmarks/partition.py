"""Automatic partitioning on CPU: balance by parameters vs by time vs schedule-aware.

Run: .venv/bin/python benchmarks/partition.py [--rounds 5] [--json out.json]

Model: a residual CNN (not an nn.Sequential: it is traced with torch.export)
of 4 levels x 2 blocks, each level at half the resolution and twice the
channels of the one before. Every block costs about the same compute, but
its parameters grow 4x per level, the classic case where cutting by
parameters is badly off: the first stage gets the cheap-in-parameters,
expensive-in-time early levels. Cut into 2 stages (one CPU worker thread
each), 1F1B, 8 micro-batches of 4 images, checkpoint="never".

For each balance mode: the cuts, the step time the schedule core's simulator
predicts for them, and the measured step time (median of alternating
rounds). The predictions all use one profile, the stage graph of the
``balance="time"`` pipeline (``simulate_partition``), so that they differ
only by the cuts; each pipeline's own table (``print(pipe.partition)``), from
its own profile, follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from pipesched import Pipeline
from pipesched.partition import simulate_partition

LEVELS, BLOCKS, WIDTH, SIZE, MICRO, CHUNKS = 4, 2, 8, 64, 4, 8


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        widths = [WIDTH * 2**i for i in range(LEVELS)]
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1)
        self.blocks = nn.ModuleList()
        for i, w in enumerate(widths):
            if i:
                self.blocks.append(nn.Conv2d(widths[i - 1], w, 2, stride=2))
            self.blocks.extend(Block(w) for _ in range(BLOCKS))
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    example = torch.randn(MICRO, 3, SIZE, SIZE)
    x = torch.randn(MICRO * CHUNKS, 3, SIZE, SIZE)
    y = torch.randint(0, 10, (MICRO * CHUNKS,))
    pipes = {}
    for balance in ("params", "time", "schedule"):
        torch.manual_seed(0)
        pipes[balance] = Pipeline(
            Tower(),
            CHUNKS,
            balance=balance,
            example_inputs=(example,),
            devices=["cpu", "cpu"],
            schedule="1f1b",
            checkpoint="never",
        )
    for pipe in pipes.values():  # warm-up
        pipe.step(x, y, loss_fn=loss_fn)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            pipes[name].step(x, y, loss_fn=loss_fn)
            times[name].append(time.perf_counter() - start)
    torch.set_num_threads(cores)
    print(
        f"residual CNN, {LEVELS} levels x {BLOCKS} blocks ({WIDTH}..{WIDTH * 2 ** (LEVELS - 1)} "
        f"channels, {SIZE}px), 2 CPU stages, 1F1B, {CHUNKS} micro-batches of {MICRO}; "
        f"median of {args.rounds} alternating rounds ({cores} cores)\n"
    )
    results = {}
    header = ("balance", "layers per stage", "predicted ms", "measured ms", "ratio")
    print(f"{header[0]:<10}{header[1]:<18}{header[2]:>14}{header[3]:>13}{header[4]:>8}")
    for name, pipe in pipes.items():
        graph = pipes["time"].stage_graph
        predicted = simulate_partition(graph, pipe.balance, "1f1b", CHUNKS).makespan
        measured = statistics.median(times[name])
        results[name] = {"balance": pipe.balance, "predicted_s": predicted, "measured_s": measured}
        print(
            f"{name:<10}{pipe.balance!s:<18}{1e3 * predicted:>14.1f}{1e3 * measured:>13.1f}"
            f"{measured / predicted:>8.2f}"
        )
    best = min(results, key=lambda n: results[n]["measured_s"])
    speedup = results["params"]["measured_s"] / results["time"]["measured_s"]
    print(f"\nfastest measured: {best}; balance='time' is {speedup:.2f}x balance='params'")
    for name, pipe in pipes.items():
        print(f"\nbalance={name!r}:\n{pipe.partition}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
