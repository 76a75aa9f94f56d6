"""What the runtime benchmarks share: the 8 x Linear(1024) MLP, its loss, the results table."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, LAYERS, BATCH, CHUNKS = 1024, 8, 256, 8


def mlp() -> nn.Sequential:
    """8 x (Linear(1024, 1024) + ReLU), the same weights every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def print_table(median: dict[str, float], plain: float, ceiling: float) -> None:
    """Each contender's step time, as a multiple of the plain run and a share of the ceiling."""
    print(f"{'contender':<22}{'step ms':>9}{'x plain':>9}{'of ceiling':>12}")
    for name, t in median.items():
        print(f"{name:<22}{1000 * t:>9.1f}{plain / t:>9.2f}{ceiling / t:>12.2f}")
    if plain / ceiling < 1.2:
        print(
            f"WARNING: the parallel ceiling is only {plain / ceiling:.2f}x the plain run: the "
            "two cores did not run in parallel during this run (a shared or throttled "
            "machine), so speedups over the plain run or a one-thread anchor cannot show; "
            "shares of the ceiling still compare the contenders."
        )
