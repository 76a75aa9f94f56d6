"""The main job of `make demo`: train through a 2-stage CPU pipeline, then compare schedules.

Run: make demo          (or: .venv/bin/python examples/demo.py)

1. A 6-layer MLP classifier is cut into 2 stages, one worker thread each
   (devices=["cpu", "cpu"]), and trained on synthetic data (labels from a
   fixed random "teacher" network) with the 1F1B schedule, 8 micro-batches
   per step and 2 steps per accumulation window (GradientAccumulator: one
   normalization, clip and optimizer step per window), behind a progress bar
   that shows the one-line log.
2. The last step's measured timeline is printed as a grid, beside the plan:
   the same schedule simulated with the per-stage costs measured in that step.
3. Every built-in schedule is simulated for 4 workers and 8 micro-batches.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

import pipesched.viz
from pipesched import GradientAccumulator, Pipeline
from pipesched.analysis import compare
from pipesched.analysis.compare import format_comparison
from pipesched.schedule import Costs, render_timeline

STEPS, WINDOW, BATCH, CHUNKS, WIDTH, CLASSES = 80, 2, 128, 8, 512, 10


def model() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(64, WIDTH), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def main() -> None:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, CLASSES))
    pipe = Pipeline(model(), chunks=CHUNKS, devices=["cpu", "cpu"], schedule="1f1b")
    print(
        f"pipeline: {pipe.num_stages} stages, balance {pipe.balance} (layers per stage, "
        f"by parameters), devices {[str(d) for d in pipe.devices]}, schedule "
        f"{pipe.schedule_name}, {CHUNKS} micro-batches of {BATCH // CHUNKS}"
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS // WINDOW)
    accumulator = GradientAccumulator(
        pipe, optimizer, accumulation_steps=WINDOW, max_grad_norm=1.0, lr_scheduler=schedule
    )
    progress = tqdm(range(STEPS), desc="training", unit="step")
    for _ in progress:
        x = torch.randn(BATCH, 64)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        result = accumulator.step(x, y, loss_fn=nn.functional.cross_entropy)
        if result.stepped:
            progress.set_description(accumulator.log_line(result))
    print(accumulator.log_line(result))
    measured = pipe.last_timeline  # the last training step's
    with torch.no_grad():
        x = torch.randn(1024, 64)
        accuracy = (pipe(x).argmax(dim=1) == teacher(x).argmax(dim=1)).float().mean()
    print(f"held-out accuracy against the teacher: {accuracy:.1%} (chance: {1 / CLASSES:.0%})")

    assert measured is not None
    planned = pipe.schedule_for(CHUNKS).simulate(measured.measured_costs())
    print(
        f"\nmeasured last step (ms; a column per shortest action, -- continues, . idle): "
        f"makespan {1000 * measured.makespan:.1f} ms"
    )
    print(render_timeline(measured))
    print(
        f"planned with the measured per-stage costs: makespan {1000 * planned.makespan:.1f} ms"
        f", bubble {planned.bubble_fraction:.1%} (measured {measured.bubble_fraction:.1%})"
    )
    print(render_timeline(planned))

    print("\nall built-in schedules on paper, 4 workers, 8 micro-batches, F = B = W = 1:")
    print(format_comparison(compare(4, 8, Costs(1, 1, 1))))
    print("\nTry: .venv/bin/pipesched show --schedule zb-h1 --stages 4 --chunks 8")
    write_pictures(measured, planned)


def write_pictures(measured: pipesched.Timeline, planned: pipesched.Timeline) -> None:
    """Draws the last step as measured (its plan under it) and as planned; writes its trace."""
    folder = "out/demo"
    try:
        pipesched.viz.gantt(measured, f"{folder}/measured.png", overlay=planned)
        pipesched.viz.gantt(planned, f"{folder}/planned.png", title="last step: the plan")
    except ModuleNotFoundError as error:  # matplotlib comes with `make`, not with pip install -e .
        print(f"\nno pictures: {error}")
        return
    measured.save(f"{folder}/run.json")
    pipesched.viz.chrome_trace(measured, f"{folder}/trace.json")
    print(
        f"\npictures of the last step, in {folder}/:\n"
        "  measured.png  the measured step, with the plan under each worker\n"
        "  planned.png   the plan alone (the schedule with the measured per-stage costs)\n"
        "  trace.json    a Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing\n"
        f"  run.json      the timeline: .venv/bin/pipesched trace {folder}/run.json -o run.png"
    )


if __name__ == "__main__":
    main()
