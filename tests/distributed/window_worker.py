"""One rank of tests/distributed/test_window.py: the docs' pattern, and a window end failing.

``python window_worker.py SCENARIO OUT`` under torchrun's environment:

- ``traced``: pp=2, a tied LM traced on its first call (no ``example_inputs``),
  its AdamW built before that call (as examples/gpt2_pipeline.py does):
  trains SAVE_AT steps and saves ``OUT/ckpt``; then rank 1's optimizer
  raises inside the next window end (after the reductions): every rank's
  window end is put back, ``flush()`` on every rank retries it, and training
  goes on to TOTAL steps. Each rank writes its parameters and what it saw.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import RemoteError
from tests.distributed import sharded_worker as w

SAVE_AT = 3
TOTAL = 8


def pipeline(mesh: Any) -> Pipeline:
    devices = None if mesh is not None else ["cpu", "cpu"]
    return Pipeline(
        w.tied_lm(), 2, split_points=["fc2"], devices=devices, mesh=mesh,
        num_stages=2 if mesh is not None else None, schedule="1f1b",
    )  # fmt: skip


def accumulator(pipe: Pipeline) -> GradientAccumulator:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.1)  # before step 1
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    return GradientAccumulator(
        pipe, optimizer, accumulation_steps=w.STEPS, max_grad_norm=0.5, lr_scheduler=scheduler
    )


def train(acc: GradientAccumulator, steps: range) -> None:
    for step in steps:
        x, y = w.tokens(step)
        acc.step(x, y, loss_fn=w.token_sum, num_items=int((y != -100).sum()))


def main(out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    from pipesched.runtime.mesh import init_mesh

    mesh = init_mesh(pp=2, timeout=30)
    rank = dist.get_rank()
    results = run(out, mesh, rank)
    torch.save(results, out / f"traced-rank{rank}.pt")
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run(out: Path, mesh: Any, rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    torch.manual_seed(1)
    acc = accumulator(pipeline(mesh))
    train(acc, range(SAVE_AT))
    acc.save(str(out / "ckpt"))  # KeyError: <id> at train/sharded.py before the fix
    results["saved"] = w.own_parameters(acc.pipe)
    optimizer = acc.optimizers[0]
    step = optimizer.step
    if rank == 1:

        def fail(*args: object, **kwargs: object) -> None:
            optimizer.step = step  # type: ignore[method-assign]
            step(*args, **kwargs)  # this rank's parameters move...
            raise RuntimeError("rank 1's optimizer failed")  # ...then it fails

        optimizer.step = fail  # type: ignore[method-assign]
    before = w.own_parameters(acc.pipe)
    try:
        train(acc, range(SAVE_AT, SAVE_AT + 1))  # the window's last step
    except (RuntimeError, RemoteError) as err:
        results["error"] = f"{type(err).__name__}: {err}"
    results["pending"] = acc.window_end_pending
    results["put_back"] = all(
        torch.equal(before[n], p) for n, p in w.own_parameters(acc.pipe).items()
    )
    acc.flush()
    train(acc, range(SAVE_AT + 1, TOTAL))
    results["params"] = w.own_parameters(acc.pipe)
    results["counters"] = (acc.steps, acc.windows)
    results["optimizer_holds_real"] = sum(
        not p.is_meta for g in optimizer.param_groups for p in g["params"]
    )
    results["own"] = len(w.own_parameters(acc.pipe))
    return results


if __name__ == "__main__":
    main(Path(sys.argv[2]))
