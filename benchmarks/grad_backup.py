"""A mid-window step's time and peak gradient memory under each ``grad_backup``.

Run: .venv/bin/python benchmarks/grad_backup.py [--layers 16 --width 1024 --rounds 7]

Model: ``layers`` x (Linear(width) + ReLU), fp32, two CPU workers (one thread
each), chunks 4, batch 16, schedule 1f1b and zb-h1. Each round runs one window of
4 steps per contender, contenders alternating; the 3 steps after the window's
first are measured: their median wall time, and the most bytes glibc's malloc
held at once above the step's start (sampled every 0.2 ms) added to the
gradient bytes, over the gradient bytes ("peak gradient memory"). ``"host"`` is
``"device"`` on CPU (its gradients are already in host memory) and is left out
where there is no GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pipesched import Pipeline


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


_mallinfo2 = ctypes.CDLL(None).mallinfo2
_mallinfo2.restype = _MallInfo2


def _malloc_bytes() -> int:
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _measured(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """One step's seconds, and the most malloc bytes above its start while it ran."""
    start = peak = _malloc_bytes()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _malloc_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    begin = time.perf_counter()
    pipe.step(x, y, loss_fn=F.mse_loss)
    seconds = time.perf_counter() - begin
    stop.set()
    sampler.join()
    return seconds, max(peak, _malloc_bytes()) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    backups = ["device", "disk"] + (["host"] if torch.cuda.is_available() else [])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, args.width, generator=g), torch.randn(16, args.width, generator=g)
    print(f"{args.layers} x Linear({args.width}) fp32, 2 CPU workers, chunks 4, batch 16")
    print(f"{'schedule':10s} {'grad_backup':12s} {'step ms':>8s} {'vs device':>9s} {'peak':>6s}")
    for schedule in ("1f1b", "zb-h1"):
        pipes = {}
        for backup in backups:
            torch.manual_seed(0)
            layers = [
                m
                for _ in range(args.layers)
                for m in (nn.Linear(args.width, args.width), nn.ReLU())
            ]
            pipes[backup] = Pipeline(
                nn.Sequential(*layers), 4, balance=[args.layers, args.layers],
                devices=["cpu", "cpu"], schedule=schedule, grad_backup=backup,
            )  # fmt: skip
        times: dict[str, list[float]] = {b: [] for b in backups}
        peaks: dict[str, list[float]] = {b: [] for b in backups}
        for _ in range(args.rounds):
            for backup, pipe in pipes.items():
                pipe.zero_grad(set_to_none=True)
                pipe.step(x, y, loss_fn=F.mse_loss)  # the window's first step
                grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in pipe.parameters())
                for _ in range(3):
                    seconds, extra = _measured(pipe, x, y)
                    times[backup].append(seconds)
                    peaks[backup].append((grad_bytes + extra) / grad_bytes)
        base = statistics.median(times["device"])
        for backup in backups:
            median = statistics.median(times[backup])
            print(
                f"{schedule:10s} {backup:12s} {median * 1e3:8.1f} {median / base:8.2f}x "
                f"{statistics.median(peaks[backup]):5.2f}x"
            )


if __name__ == "__main__":
    main()
