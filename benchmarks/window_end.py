"""What the transactional window end costs: GradientAccumulator with and without its snapshot.

Run: .venv/bin/python benchmarks/window_end.py [--rounds 9] [--json out.json]

The end of an accumulation window is a transaction (:mod:`pipesched.train.window`):
before the optimizers step, every parameter they hold and every state tensor
they keep is cloned, so that a failure anywhere in the window end puts them
back. This measures what that costs on the local benchmark's model
(8 x Linear(1024) + ReLU, 8.4M parameters, batch 256, chunks 8, 2 CPU stages,
1F1B) with AdamW and clipping, for windows of 1 and 4 steps. "off" is the same
accumulator with the snapshot replaced by one that copies nothing (not a
configuration users can pick: a failed window end would then be lost). Rounds
alternate on and off so machine noise hits both alike; medians of the time
per window. The snapshot's own time (clone of parameters and AdamW's two
moments) is printed beside AdamW's step, for scale.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator

import torch
from mlp_bench import BATCH, CHUNKS, LAYERS, WIDTH, loss_fn, mlp

from pipesched import GradientAccumulator, Pipeline
from pipesched.train import window


class _NoSnapshot:
    """A snapshot that copies nothing and cannot put anything back."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def restore(self) -> None:  # pragma: no cover - never called in this benchmark
        raise RuntimeError("the benchmark's 'off' snapshot cannot put anything back")


@contextlib.contextmanager
def snapshot(on: bool) -> Iterator[None]:
    if on:
        yield
        return
    import pipesched.train.accumulator as accumulator

    taken = accumulator.WindowSnapshot
    accumulator.WindowSnapshot = _NoSnapshot  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        accumulator.WindowSnapshot = taken  # type: ignore[misc]


def timed(acc: GradientAccumulator, x: torch.Tensor, y: torch.Tensor, windows: int) -> float:
    start = time.perf_counter()
    for _ in range(windows * acc.accumulation_steps):
        acc.step(x, y, loss_fn=loss_fn)
    return (time.perf_counter() - start) / windows


def snapshot_alone(acc: GradientAccumulator, repeats: int = 9) -> tuple[float, float]:
    """Medians of one snapshot and of one AdamW step, in ms (the moments exist by now)."""
    taken, stepped = [], []
    params = list(acc.pipe.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    for _ in range(repeats):
        start = time.perf_counter()
        window.WindowSnapshot(acc, True)
        taken.append(time.perf_counter() - start)
        start = time.perf_counter()
        for optimizer in acc.optimizers:
            optimizer.step()
        stepped.append(time.perf_counter() - start)
    acc.pipe.zero_grad(set_to_none=True)
    return 1000 * statistics.median(taken), 1000 * statistics.median(stepped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args()
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    results = {}
    print(f"{'window':<28}{'on ms':>9}{'off ms':>9}{'cost':>8}")
    for steps in (1, 4):
        pipe = Pipeline(
            mlp(), CHUNKS, balance=[LAYERS, LAYERS], devices=["cpu", "cpu"], schedule="1f1b"
        )
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        acc = GradientAccumulator(pipe, optimizer, accumulation_steps=steps, max_grad_norm=1.0)
        times: dict[bool, list[float]] = {True: [], False: []}
        for on in (True, False):  # warm-up: AdamW's moments exist from here on
            with snapshot(on):
                timed(acc, x, y, 1)
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                with snapshot(on):
                    times[on].append(timed(acc, x, y, args.windows))
        on_ms, off_ms = (1000 * statistics.median(times[k]) for k in (True, False))
        cost = on_ms / off_ms - 1
        name = f"{steps} step{'s' * (steps > 1)} per window, AdamW"
        results[name] = {"on_ms": on_ms, "off_ms": off_ms, "cost": cost}
        print(f"{name:<28}{on_ms:>9.1f}{off_ms:>9.1f}{100 * cost:>7.1f}%")
    alone, adamw = snapshot_alone(acc)
    params = sum(p.numel() for p in pipe.parameters())
    print(
        f"the snapshot alone: {alone:.2f} ms for {params / 1e6:.1f}M parameters and AdamW's "
        f"two moments; AdamW's step: {adamw:.2f} ms"
    )
    results["snapshot_ms"], results["adamw_step_ms"] = alone, adamw
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
