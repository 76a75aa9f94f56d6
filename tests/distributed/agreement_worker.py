"""One rank of a cross-rank trust test: `python agreement_worker.py SCENARIO OUT_DIR`.

Each scenario runs a 2-rank pipeline (pp=2) into one kind of trouble, catches
what the step raises in the user's own ``except`` block, and writes what it
saw to ``OUT_DIR/rankN.json``: the error's type, message and RemoteError
attributes, how long the failing call took, and whether the process group
still answered afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.mesh import init_mesh

HUNG_TIMEOUT, HUNG_SLEEP = 6, 18  # seconds: the mesh's timeout, and how long stage 1 sleeps


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2:  # micro-batch 2 of a 10-row batch in 4 chunks (3, 3, 2, 2)
            raise ValueError("boom in a stage")
        return x


class Sleepy(nn.Module):
    slept = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not Sleepy.slept:  # alive, but far slower than the timeout, once
            Sleepy.slept = True
            time.sleep(HUNG_SLEEP)
        return x


class ToNone(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


def model(scenario: str) -> nn.Sequential:
    torch.manual_seed(0)
    middle: nn.Module = {"except": Boom(), "hung": Sleepy(), "none": ToNone()}.get(
        scenario, nn.Dropout(0.5)
    )
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), middle, nn.Linear(8, 3)).double()


def error_record(error: BaseException, elapsed: float) -> dict[str, Any]:
    fields = ("rank", "pp_rank", "dp_rank", "action", "error_type", "error_message", "kind")
    return {
        "type": type(error).__name__,
        "message": str(error),
        "attributes": {f: getattr(error, f, "<missing>") for f in fields},
        "elapsed": elapsed,
    }


def group_answers() -> bool:
    """Whether the default process group still works (an all-reduce over every rank)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t) == dist.get_world_size()


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    timeout = {"hung": HUNG_TIMEOUT, "sizes": 600}.get(scenario, 30)
    mesh = init_mesh(pp=2, timeout=timeout)
    balance = [3, 1] if scenario == "none" else [2, 2]  # None crosses from stage 0
    pipe = Pipeline(model(scenario), 4, balance=balance, mesh=mesh, schedule="1f1b")
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(10, 6, generator=g).double(), torch.randn(10, 3, generator=g).double()
    loss = nn.functional.mse_loss
    if scenario == "sizes":  # rank 1's batch gives 3 micro-batches, rank 0's 4
        rows = 10 if rank == 0 else 3
        for name, call in (
            ("step", lambda: pipe.step(x[:rows], y[:rows], loss_fn=loss)),
            ("eval", lambda: pipe(x[:rows])),
        ):
            start = time.monotonic()
            try:
                with torch.set_grad_enabled(name == "step"):
                    call()
                result[name] = None
            except Exception as error:
                result[name] = error_record(error, time.monotonic() - start)
        result["then"] = float(pipe.step(x, y, loss_fn=loss))  # still usable afterwards
    elif scenario == "seed":  # the ranks' global generators differ: rank 1 drew more
        torch.manual_seed(123)
        if rank == 1:
            torch.rand(5)
        seeds: list[int] = []
        runtime = pipe.engine.runtime
        run = runtime.run

        def spy(schedule: Any, step: Any, *, detach: bool) -> Any:
            done = run(schedule, step, detach=detach)
            seeds.append(step.seed)  # the seed the step ran with
            return done

        runtime.run = spy  # type: ignore[method-assign]
        for _ in range(2):
            pipe.step(x, y, loss_fn=loss)
        result["seeds"] = seeds
    elif scenario == "destroyed":  # the user destroys the process group, then steps again
        pipe.step(x, y, loss_fn=loss)
        dist.destroy_process_group()
        start = time.monotonic()
        try:
            pipe.step(x, y, loss_fn=loss)
            result["error"] = None
        except Exception as error:
            result["error"] = error_record(error, time.monotonic() - start)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        return
    else:  # "except", "hung", "none": the step fails; the user's except block looks
        start = time.monotonic()
        try:
            pipe.step(x, y, loss_fn=loss)
            result["error"] = None
        except Exception as error:
            record = error_record(error, time.monotonic() - start)
            # What a user's handler does first: which rank am I, and log the error.
            record["get_rank"] = dist.get_rank()
            record["get_world_size"] = dist.get_world_size()
            result["error"] = record
            if scenario == "except":
                result["group_answers"] = group_answers()
                try:  # the failed pipeline refuses to run again, saying why
                    pipe.step(x, y, loss_fn=loss)
                    result["again"] = None
                except Exception as again:
                    result["again"] = error_record(again, 0.0)
                # A new pipeline on every rank works: the job goes on without a restart.
                fresh = Pipeline(model("seed"), 4, balance=[2, 2], mesh=mesh, schedule="1f1b")
                result["fresh_loss"] = float(fresh.step(x, y, loss_fn=loss))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
