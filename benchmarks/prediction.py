"""The partition table's predicted step time against the measured one, for the examples' models.

Run: .venv/bin/python benchmarks/prediction.py [--steps 10] [--rounds 3] [--detail] [--variants]

For each example's model (examples/vit_pipeline.py, gpt2_pipeline.py,
demo.py), built and called as the example does (the Hugging Face ones cut at
their first step): the step time ``print(pipe.partition)``
predicts (``pipe.partition.simulated.makespan``) and the measured one,
``pipe.last_timeline.makespan`` after ``pipe.step``: the best and the median
step of all rounds (after one warm-up step; the rounds alternate between the
models), their ratios to the prediction, and the median wall time of the
whole ``pipe.step`` call. demo.py's pipeline balances by parameters and is
not profiled, so it has no prediction; here it gets ``example_inputs`` and
``balance="time"``. ``--detail`` adds the bubbles and each stage's predicted
and measured F and B; ``--variants`` adds each model with
``checkpoint="never"`` (no recomputation), and also without
``fuse_weight_grads`` (no wrapper around each operation).

The machine's cores may be shared (the load average is printed): read the
best step's ratio as what the prediction misses by itself, the median's as
what a busy machine adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipesched import Pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


@dataclass
class Case:
    name: str
    pipe: Pipeline
    batch: Callable[[], tuple[Any, Any, int | None]]
    """Returns a step's inputs, target and num_items."""
    loss_fn: Callable[..., torch.Tensor]
    makespans: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    bubbles: list[float] = field(default_factory=list)
    durations: dict[tuple[str, int], list[float]] = field(default_factory=lambda: defaultdict(list))

    def step(self) -> None:
        x, y, num_items = self.batch()
        start = time.perf_counter()
        self.pipe.step(x, y, loss_fn=self.loss_fn, num_items=num_items)
        wall = time.perf_counter() - start
        self.pipe.zero_grad()
        timeline = self.pipe.last_timeline
        assert timeline is not None
        self.makespans.append(timeline.makespan)
        self.walls.append(wall)
        self.bubbles.append(timeline.bubble_fraction)
        for e in timeline.events:
            self.durations[e.action.kind, e.action.stage].append(e.duration)


def vit(**options: Any) -> Case:
    import vit_pipeline as ex

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randn(ex.CLASSES, 3, 32, 32, generator=generator)
    pipe = Pipeline(ex.new_model(), chunks=ex.CHUNKS, devices=["cpu", "cpu"], **options)
    return Case("vit", pipe, lambda: (ex.batch(patterns, generator), None, None), _own_loss)


def gpt2(**options: Any) -> Case:
    import gpt2_pipeline as ex

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    pipe = Pipeline(
        ex.new_model(), chunks=ex.CHUNKS, devices=["cpu", "cpu"], schedule="1f1b", **options
    )

    def batch() -> tuple[dict[str, Any], None, int]:
        data = ex.batch(generator)
        return {**data, "num_items_in_batch": 1}, None, ex.tokens_of(data)

    return Case("gpt2", pipe, batch, _own_loss)


def _own_loss(out: Any) -> torch.Tensor:
    """A Hugging Face model's own loss (it was given the labels)."""
    return out.loss


def demo(**options: Any) -> Case:
    import demo as ex

    torch.manual_seed(0)
    micro = ex.BATCH // ex.CHUNKS
    pipe = Pipeline(
        ex.model(),
        chunks=ex.CHUNKS,
        devices=["cpu", "cpu"],
        schedule="1f1b",
        example_inputs=(torch.randn(micro, 64),),
        balance="time",
        **options,
    )

    def batch() -> tuple[torch.Tensor, torch.Tensor, None]:
        return torch.randn(ex.BATCH, 64), torch.randint(0, ex.CLASSES, (ex.BATCH,)), None

    return Case("demo (mlp)", pipe, batch, nn.functional.cross_entropy)


VARIANTS = {
    "as in the example": {},
    "checkpoint=never": {"checkpoint": "never"},
    "never, unfused": {"checkpoint": "never", "fuse_weight_grads": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--detail", action="store_true", help="per-stage F and B too")
    parser.add_argument(
        "--variants", action="store_true", help="also checkpoint='never', and unfused"
    )
    args = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    variants = VARIANTS if args.variants else {"as in the example": {}}
    cases = [
        (variant, build(**options))
        for build in (vit, gpt2, demo)
        for variant, options in variants.items()
    ]
    for _, case in cases:
        case.step()  # warm-up
        case.makespans.clear(), case.walls.clear(), case.bubbles.clear()
        case.durations.clear()
    for _ in range(args.rounds):
        for _, case in cases:
            for _ in range(args.steps):
                case.step()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}; {args.rounds} alternating rounds x {args.steps} steps"
    )
    print(
        f"{'model':11} {'pipeline':18} {'predicted':>9} {'best':>8} {'median':>8} "
        f"{'best/pred':>9} {'median/pred':>11} {'wall':>8}"
    )
    for variant, case in cases:
        simulated = case.pipe.partition.simulated
        assert simulated is not None
        predicted = simulated.makespan
        best, median = min(case.makespans), statistics.median(case.makespans)
        wall = statistics.median(case.walls)
        print(
            f"{case.name:11} {variant:18} {1e3 * predicted:7.2f}ms {1e3 * best:6.2f}ms "
            f"{1e3 * median:6.2f}ms {best / predicted:9.2f} {median / predicted:11.2f} "
            f"{1e3 * wall:6.2f}ms"
        )
    if args.detail:
        for variant, case in cases:
            simulated = case.pipe.partition.simulated
            assert simulated is not None
            print(
                f"\n{case.name}, {variant}: bubble predicted "
                f"{100 * simulated.bubble_fraction:.0f}%, measured (median) "
                f"{100 * statistics.median(case.bubbles):.0f}%; per stage, ms, "
                "measured: best and median of the actions"
            )
            for s, row in enumerate(case.pipe.partition.stages):
                cells = []
                for kind, predicted in (("F", row.forward_time), ("B", row.backward_time)):
                    got = case.durations[kind, s]
                    cells.append(
                        f"{kind} predicted {1e3 * (predicted or 0):.2f} measured "
                        f"{1e3 * min(got):.2f} / {1e3 * statistics.median(got):.2f}"
                    )
                print(f"  stage {s}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
