"""Draw a real CPU pipeline step over its plan: the picture of docs/schedules.md, made here.

Run: .venv/bin/python examples/draw_pipeline.py
     .venv/bin/python examples/draw_pipeline.py --schedule zb-h1 --out out/zb-h1
     .venv/bin/python examples/draw_pipeline.py --picture docs/img/measured-1f1b.png   (the docs')

A 6-layer MLP is cut into 2 stages on 2 CPU workers (devices=["cpu", "cpu"])
and trained for a few steps, so the last one runs warm. Its measured timeline
(pipe.last_timeline, in seconds) is drawn with, under each worker, the plan:
the same schedule simulated with the per-stage costs measured in that step.
Where the two differ is overhead, noise, or time the plan does not model.
Also written: the timeline as JSON (draw it again with `pipesched trace`) and
as a Chrome trace for https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from pipesched import Pipeline, viz

BATCH, WIDTH, STEPS = 256, 512, 8


def model() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(64, WIDTH), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or zb-h1 (2 workers)")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--out", type=Path, default=Path("out/draw_pipeline"), help="folder")
    parser.add_argument("--picture", type=Path, help="the picture's path (default: in --out)")
    args = parser.parse_args()

    torch.manual_seed(0)
    pipe = Pipeline(model(), chunks=args.chunks, devices=["cpu", "cpu"], schedule=args.schedule)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        pipe.step(x, y, loss_fn=nn.functional.cross_entropy)
    measured = pipe.last_timeline
    if measured is None:  # pragma: no cover - step always records one
        raise SystemExit("the pipeline recorded no timeline")
    plan = pipe.schedule_for(args.chunks).simulate(measured.measured_costs())

    picture = args.picture or args.out / f"measured-{args.schedule}.png"
    title = (
        f"{args.schedule} on 2 CPU workers, {args.chunks} micro-batches of {BATCH // args.chunks}:"
        " measured step vs plan"
    )
    viz.gantt(measured, picture, overlay=plan, title=title)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = measured.save(args.out / "run.json")
    trace = viz.chrome_trace(measured, args.out / "run.trace.json")
    print(f"measured: {measured.summary()} (seconds)")
    print(f"plan:     {plan.summary()} (seconds)")
    print(f"wrote {picture} ({picture.stat().st_size / 1024:.0f} KB), {saved}, {trace}")
    print(f"draw it again: .venv/bin/pipesched trace {saved} --plan {args.schedule} -o run.png")


if __name__ == "__main__":
    main()
