"""Local runtime on CPU: pipesched vs the plain model, the parallel ceiling and torchgpipe.

Run: .venv/bin/python benchmarks/local_cpu.py [--rounds 7] [--json out.json]

Model: 8 x (Linear(1024, 1024) + ReLU), batch 256, chunks 8, 2 stages on CPU,
one intra-op thread per stage. Contenders, alternated round by round so that
machine noise hits all of them alike (median of the rounds is reported):

- plain: the unpipelined model, forward + backward of the whole batch, 1 thread.
- ceiling: each stage's forward and backward of all 8 micro-batches run at
  the same time in two threads with no dependencies between them: what two
  cores can give at all.
- pipesched gpipe / 1f1b / zb-h1: ``Pipeline.step`` (checkpoint="never"), weight
  gradients accumulated in the GEMM (the default); "1f1b unfused" with
  ``fuse_weight_grads=False``, autograd's accumulation as in the ceiling.
- torchgpipe: ``GPipe(model, balance=[8, 8], devices=["cpu", "cpu"], chunks=8)``,
  forward + backward (checkpoint="never").

Then the per-stage peak of saved-activation bytes (counted with
``torch.autograd.graph.saved_tensors_hooks`` around each stage's forward) for
gpipe vs 1f1b and for each checkpoint mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import weakref
from collections.abc import Callable

import torch
from mlp_bench import BATCH, CHUNKS, LAYERS, WIDTH, loss_fn, mlp, print_table
from torch import nn

from pipesched import Pipeline


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        torch.set_num_threads(1)
        loss_fn(model(x), y).backward()

    return run


def ceiling_step(model: nn.Sequential, x: torch.Tensor) -> Callable[[], None]:
    """Both stages' F and B for every micro-batch, concurrently, with no dependencies."""
    half = len(model) // 2
    stages = [model[:half], model[half:]]
    micro = x.chunk(CHUNKS)

    def work(stage: nn.Module) -> None:
        torch.set_num_threads(1)
        for mb in micro:
            inp = mb.detach().requires_grad_()
            out = stage(inp)
            out.backward(torch.ones_like(out))

    def run() -> None:
        threads = [threading.Thread(target=work, args=(s,)) for s in stages]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return run


def two_stage_pipeline(schedule: str, checkpoint: str, fuse: bool = True) -> Pipeline:
    """The MLP as 2 CPU stages of 8 layers each."""
    return Pipeline(
        mlp(),
        CHUNKS,
        balance=[LAYERS, LAYERS],
        devices=["cpu", "cpu"],
        schedule=schedule,
        checkpoint=checkpoint,
        fuse_weight_grads=fuse,
    )


def pipesched_step(
    schedule: str, x: torch.Tensor, y: torch.Tensor, fuse: bool = True
) -> Callable[[], None]:
    pipe = two_stage_pipeline(schedule, "never", fuse)
    return lambda: pipe.step(x, y, loss_fn=loss_fn) and None


def torchgpipe_step(x: torch.Tensor, y: torch.Tensor) -> Callable[[], None] | None:
    try:
        from torchgpipe import GPipe
    except ImportError:
        return None
    model = GPipe(
        mlp(), balance=[LAYERS, LAYERS], devices=["cpu", "cpu"], chunks=CHUNKS, checkpoint="never"
    )

    def run() -> None:
        torch.set_num_threads(1)
        loss_fn(model(x), y).backward()

    return run


def saved_bytes(schedule: str, checkpoint: str, x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """Per stage, the peak bytes of tensors autograd saved for backward during one step."""
    pipe = two_stage_pipeline(schedule, checkpoint)
    lock = threading.Lock()
    held, peak = [0, 0], [0, 0]

    class Saved:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    def hooks(stage: int) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> Saved:
            size = t.numel() * t.element_size()
            box = Saved(t)
            with lock:
                held[stage] += size
                peak[stage] = max(peak[stage], held[stage])
            weakref.finalize(box, release, stage, size)
            return box

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)

    def release(stage: int, size: int) -> None:
        with lock:
            held[stage] -= size

    pipe.engine.runtime.passes.forward_context = hooks
    pipe.step(x, y, loss_fn=loss_fn)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    contenders: dict[str, Callable[[], None] | None] = {
        "plain (1 thread)": plain_step(mlp(), x, y),
        "ceiling (2 threads)": ceiling_step(mlp(), x),
        "pipesched gpipe": pipesched_step("gpipe", x, y),
        "pipesched 1f1b": pipesched_step("1f1b", x, y),
        "pipesched zb-h1": pipesched_step("zb-h1", x, y),
        "pipesched 1f1b unfused": pipesched_step("1f1b", x, y, fuse=False),
        "torchgpipe": torchgpipe_step(x, y),
    }
    runs = {name: fn for name, fn in contenders.items() if fn is not None}
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for fn in runs.values():  # warm-up
        fn()
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    torch.set_num_threads(cores)
    median = {name: statistics.median(t) for name, t in times.items()}
    plain, ceiling = median["plain (1 thread)"], median["ceiling (2 threads)"]
    print(
        f"{LAYERS} x Linear({WIDTH}) + ReLU, batch {BATCH}, chunks {CHUNKS}, 2 CPU stages, "
        f"1 thread each; median of {args.rounds} alternating rounds ({cores} cores)"
    )
    print_table(median, plain, ceiling)
    targets = {"pipesched 1f1b": 0.80, "pipesched zb-h1": 0.85}
    for name, target in targets.items():
        share = ceiling / median[name]
        print(
            f"target {name}: >= {target:.2f} of ceiling: {share:.2f} "
            f"{'ok' if share >= target else 'MISSED'}"
        )
    if "torchgpipe" in median:
        for name in ("pipesched gpipe", "pipesched 1f1b", "pipesched zb-h1"):
            speedup = median["torchgpipe"] / median[name]
            print(
                f"target {name} >= 1.4x torchgpipe: {speedup:.2f}x "
                f"{'ok' if speedup >= 1.4 else 'MISSED'}"
            )
    print("\npeak saved-activation MiB per stage (saved_tensors_hooks), one step:")
    memory = {}
    for schedule, checkpoint in [
        ("gpipe", "never"),
        ("1f1b", "never"),
        ("1f1b", "except_last"),
        ("1f1b", "always"),
        ("gpipe", "always"),
    ]:
        peaks = saved_bytes(schedule, checkpoint, x, y)
        memory[f"{schedule}/{checkpoint}"] = peaks
        print(
            f"  {schedule:<6} checkpoint={checkpoint:<12}"
            + "  ".join(f"stage {s}: {b / 2**20:7.1f}" for s, b in enumerate(peaks))
        )
    per_mb = memory["gpipe/never"][0] / CHUNKS
    ratio = memory["1f1b/never"][0] / per_mb
    print(
        f"1f1b stage 0 holds {ratio:.2f} micro-batches' activations (p = 2): "
        f"{'ok' if ratio <= 2 + 1e-9 else 'MISSED'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": median, "saved_bytes": memory}, f, indent=2)


if __name__ == "__main__":
    main()
