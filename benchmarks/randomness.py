"""What seeding every random operation costs: pipesched with and without the dispatch-level seeding.

Run: .venv/bin/python benchmarks/randomness.py [--rounds 25] [--steps 2] [--json out.json]

Random operations reach pipesched through a dispatch key of their own, in the
threads that seed (:mod:`pipesched.runtime.stage.rng`): a C++ kernel there keys and
seeds each CPU draw from a default generator without calling Python (the Python
kernel behind it takes the rest); a stage of torch's draw-free layers is not seeded at
all. This measures that cost on the local benchmark's model (8 x Linear(1024) + ReLU, batch 256,
chunks 8, 2 CPU stages, 1F1B, checkpoint "except_last"), the target being
below 2% of step time, and on a small Transformer (4 x
TransformerEncoderLayer(64, 4, 128), batch 64 x 16 tokens, chunks 8, 2 stages:
many small operations, the worst case) without dropout and with dropout 0.1,
the target being below 5%. "off" is the same pipeline with the seeding
replaced by a no-op (not a configuration users can pick: unseeded draws are
wrong under threads and recomputation). Rounds alternate on and off so
machine noise hits both alike; the cost by medians of wall time per step, by
minima (noise only ever adds time: on a machine whose cores other jobs share,
the minima tell the work added, the medians mostly the neighbours), and
"paired": the median over rounds of each round's on / off, the two measured
side by side (the load drifts between rounds, not within one). "cpu": the same
paired median of the process's CPU time per step (every thread's), which a
neighbour's turn on a shared core does not charge; the target is read on that
one, as ``split_backward.py`` reads thread CPU time, and the wall-time figures
are printed beside it. "A/A": the control, "off" run a second time in each round
and read against the first as "on" is: what this machine's noise alone reads (on
a shared 2-core VM it has read -2% to +10%; a cost inside it is not resolved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch
from mlp_bench import BATCH, CHUNKS, LAYERS, WIDTH, loss_fn, mlp
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.stage.seeding import StageSeeding

TARGET = 0.02
TARGET_DRAWING = 0.05  # the Transformer with dropout


def transformer(dropout: float) -> nn.Sequential:
    """4 encoder layers of width 64 on (batch, 16 tokens, 64)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout, batch_first=True)
            for _ in range(4)
        ]
    )


def cases() -> dict[str, tuple[Pipeline, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    mlp_pipe = Pipeline(
        mlp(), CHUNKS, balance=[LAYERS, LAYERS], devices=["cpu", "cpu"], schedule="1f1b"
    )
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    found: dict[str, tuple[Pipeline, torch.Tensor, torch.Tensor]] = {
        "mlp 8 x Linear(1024)": (mlp_pipe, x, y)
    }
    for p in (0.0, 0.1):
        pipe = Pipeline(transformer(p), 8, balance=[2, 2], devices=["cpu"] * 2, schedule="1f1b")
        t, u = torch.randn(64, 16, 64), torch.randn(64, 16, 64)
        found[f"transformer d64 dropout {p}"] = (pipe, t, u)
    return found


def timed(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[float, float]:
    """Wall time and the process's CPU time (every thread's) per step."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        pipe.step(x, y, loss_fn=loss_fn)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


MODES = ("on", "off", "off again")
"""The contenders: seeded as pipesched seeds; no seeding at all; the same again, the
control: what "off again" reads against "off" is this machine's noise on the figure."""


@contextlib.contextmanager
def seeding(mode: str) -> Any:
    """Runs the block with stages seeded as ``mode`` says (:data:`MODES`)."""
    if mode == "on":
        yield
        return
    saved = StageSeeding.forward, StageSeeding.backward
    StageSeeding.forward = lambda *args: contextlib.nullcontext()  # type: ignore[method-assign]
    StageSeeding.backward = lambda *args: contextlib.nullcontext()  # type: ignore[method-assign]
    try:
        yield
    finally:
        StageSeeding.forward, StageSeeding.backward = saved  # type: ignore[method-assign]


def _paired(on: list[float], off: list[float]) -> float:
    """The median over rounds of on / off, minus one."""
    return statistics.median(a / b for a, b in zip(on, off, strict=True)) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args()
    results = {}
    print(
        f"{'model':<30}{'on ms':>9}{'off ms':>9}{'cost':>8}"
        f"{'min on':>9}{'min off':>9}{'cost':>8}{'paired':>8}{'cpu':>8}{'A/A':>8}"
    )
    for name, (pipe, x, y) in cases().items():
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        for mode in MODES:  # warm-up (the first step learns where stages draw)
            with seeding(mode):
                timed(pipe, x, y, 2)
        for r in range(args.rounds):
            for mode in MODES if r % 2 else MODES[::-1]:  # the order alternates
                with seeding(mode):
                    wall, used = timed(pipe, x, y, args.steps)
                    times[mode].append(wall)
                    cpu[mode].append(used)
        on_ms, off_ms = (1000 * statistics.median(times[k]) for k in ("on", "off"))
        on_min, off_min = (1000 * min(times[k]) for k in ("on", "off"))
        cost, min_cost = on_ms / off_ms - 1, on_min / off_min - 1
        paired = _paired(times["on"], times["off"])
        cpu_cost = _paired(cpu["on"], cpu["off"])
        noise = _paired(cpu["off again"], cpu["off"])
        results[name] = {
            "on_ms": on_ms, "off_ms": off_ms, "cost": cost, "on_min_ms": on_min,
            "off_min_ms": off_min, "min_cost": min_cost, "paired_cost": paired,
            "cpu_cost": cpu_cost, "cpu_noise": noise,
        }  # fmt: skip
        print(
            f"{name:<30}{on_ms:>9.2f}{off_ms:>9.2f}{100 * cost:>7.1f}%"
            f"{on_min:>9.2f}{off_min:>9.2f}{100 * min_cost:>7.1f}%"
            f"{100 * paired:>7.1f}%{100 * cpu_cost:>7.1f}%{100 * noise:>7.1f}%"
        )
    for name, target in (
        ("mlp 8 x Linear(1024)", TARGET),
        ("transformer d64 dropout 0.1", TARGET_DRAWING),
    ):
        row = results[name]
        verdict = "ok" if row["cpu_cost"] < target else "MISSED"
        print(
            f"target: seeding costs < {100 * target:.0f}% on {name}: "
            f"{100 * row['cpu_cost']:.1f}% of CPU time {verdict} (the control, off against "
            f"itself: {100 * row['cpu_noise']:+.1f}%; wall time: paired "
            f"{100 * row['paired_cost']:.1f}%, by medians {100 * row['cost']:.1f}%, by minima "
            f"{100 * row['min_cost']:.1f}%)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
