"""One rank of tests/distributed/test_tied.py: a weight tied between the first and last layer.

``python tied_worker.py SCENARIO OUT`` under torchrun's environment, or with
WORLD_SIZE unset for one process (the local runtime, pp=2 on two "cpu" devices).
The model is 8 x ``Linear(8, 8)`` with ``m[7].weight = m[0].weight``: under
``1f1b`` at pp=2 its two users sit on two ranks, under ``zb-v`` (stages 0 and 3
on pp rank 0) both on rank 0. Scenarios:

- ``save``: trains SAVE_AT steps (a window and a half) and saves
  ``OUT/ck-<layout>`` (a sharded checkpoint); in one process ``local``, on 2
  ranks ``1f1b`` and ``zb-v``, on 4 (dp=2) ``zb-v-dp2``. On 2 ranks also
  ``old``: ``zb-v`` saved without the ``aliases/`` entries (as a checkpoint of
  an older pipesched), and ``subset``: ``1f1b`` whose optimizer leaves out
  ``5.weight``.
- ``resume``: loads every checkpoint of CHECKPOINTS at each of RESUME_SCHEDULES
  and trains to TOTAL steps; each rank writes its parameters. On 4 ranks, dp=2.
- ``refuse``: loads ``old`` and ``subset`` at ``1f1b``: each must be refused on every
  rank, nothing changed.
- ``fsdp``: pp=2 x dp=2, each stage sharded (FSDP2), trains TOTAL steps from the
  start, each run of FSDP_RUNS: under ``zb-v`` (the tie whole on pp rank 0,
  all-reduced over the replicas; clipping nothing, or acting) and under ``1f1b``
  (the tie split over the pp ranks); writes the parameters (whole) and each
  window's gradient norm.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import CheckpointError

WIDTH = 8
ROWS = 8
STEPS = 2  # per window
SAVE_AT = 3  # steps done at the save: one window and one step into the next
TOTAL = SAVE_AT + 1 + 2 * STEPS  # then the window's last step and two more windows
CLIP = 0.05  # small enough to act in every window
NO_CLIP = 1e3  # clips nothing: the coefficient is 1
FSDP_RUNS = {"zb-v": ("zb-v", NO_CLIP), "1f1b": ("1f1b", CLIP), "zb-v-clip": ("zb-v", CLIP)}
BALANCE = {"1f1b": [4, 4], "zb-v": [2, 2, 2, 2]}
CHECKPOINTS = {1: ["1f1b", "zb-v", "zb-v-dp2"], 2: ["local", "1f1b", "zb-v", "zb-v-dp2"]}
RESUME_SCHEDULES = {1: ["1f1b"], 2: ["1f1b", "zb-v"], 4: ["1f1b", "zb-v"]}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])
    m[7].weight = m[0].weight  # tied: one Parameter, two users
    return m


def batch(step: int, replica: int = 0, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or replica ``replica``'s share of its rows."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    share = ROWS // replicas
    rows = slice(replica * share, (replica + 1) * share)
    return x[rows], y[rows]


def accumulator(
    pipe: nn.Module, leave_out: str | None = None, clip: float = CLIP
) -> GradientAccumulator:
    params = [p for n, p in pipe.named_parameters() if n != leave_out]
    optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return GradientAccumulator(pipe, optimizer, accumulation_steps=STEPS, max_grad_norm=clip)


def pipeline(schedule: str, mesh: Any) -> Pipeline:
    if mesh is None:  # the local runtime: both users of the tie in this process
        return Pipeline(model(), 2, balance=[4, 4], devices=["cpu", "cpu"])
    return Pipeline(model(), 2, balance=BALANCE[schedule], mesh=mesh, schedule=schedule)


def train(acc: GradientAccumulator, steps: range, replica: int, replicas: int) -> list[float]:
    """Runs ``steps``; returns the gradient norm of each window that ended."""
    norms = []
    for step in steps:
        x, y = batch(step, replica, replicas)
        result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
        if result.stepped:
            norms.append(float(result.grad_norm))  # type: ignore[arg-type]
    return norms


def own_parameters(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's parameters under every name (a tied one under each), whole."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in pipe.named_parameters(remove_duplicate=False)
        if not p.is_meta
    }


def main(scenario: str, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    if "WORLD_SIZE" not in os.environ:
        run(scenario, out, None, 0, 1)
        return
    from pipesched.runtime.mesh import init_mesh

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_mesh(pp=2, dp=world // 2, timeout=60)
    run(scenario, out, mesh, dist.get_rank(), world // 2)  # its pipelines freed on return
    # Collected before the group goes: a gloo work freed at exit aborts the process.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run(scenario: str, out: Path, mesh: Any, rank: int, dp: int) -> None:
    """Runs ``scenario`` on this rank and writes its results to ``OUT/<scenario>-rank<r>.pt``."""
    replica = 0 if mesh is None else mesh.get_local_rank("dp")
    results: dict[str, Any] = {}
    if scenario == "save":
        layouts = ["local"] if mesh is None else ["zb-v-dp2"] if dp == 2 else ["1f1b", "zb-v"]
        for layout in layouts:
            torch.manual_seed(1)
            acc = accumulator(pipeline(layout.removesuffix("-dp2"), mesh))
            train(acc, range(SAVE_AT), replica, dp)
            acc.save(str(out / f"ck-{layout}"), sharded=True)
        if layouts == ["1f1b", "zb-v"]:
            _save_without_aliases(out, mesh)
            torch.manual_seed(1)
            acc = accumulator(pipeline("1f1b", mesh), leave_out="5.weight")
            train(acc, range(SAVE_AT), 0, 1)
            acc.save(str(out / "ck-subset"))
    elif scenario == "resume":
        for checkpoint in CHECKPOINTS[1 if mesh is None else 2]:
            for schedule in RESUME_SCHEDULES[1 if mesh is None else 2 * dp]:
                torch.manual_seed(99)  # whatever the generator holds, the checkpoint's wins
                acc = accumulator(pipeline(schedule, mesh))
                acc.load(str(out / f"ck-{checkpoint}"))
                train(acc, range(SAVE_AT, TOTAL), replica, dp)
                results[f"{checkpoint}>{schedule}"] = own_parameters(acc.pipe)
    elif scenario == "refuse":
        for checkpoint in ("old", "subset"):
            acc = accumulator(pipeline("1f1b", mesh))
            train(acc, range(STEPS), 0, 1)
            before = own_parameters(acc.pipe)
            state = {
                id(p): {k: v.clone() for k, v in s.items()}
                for p, s in acc.optimizers[0].state.items()
            }
            try:
                acc.load(str(out / f"ck-{checkpoint}"))
            except CheckpointError as err:
                results[f"{checkpoint}-error"] = str(err)
            after = own_parameters(acc.pipe)
            results[f"{checkpoint}-unchanged"] = all(
                torch.equal(before[n], after[n]) for n in before
            ) and all(
                all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
                for p, s in acc.optimizers[0].state.items()
            )
    elif scenario == "fsdp":
        from pipesched.runtime.mesh import init_mesh

        for run_name, (schedule, clip) in FSDP_RUNS.items():
            sharded = init_mesh(pp=2, dp=2, shard=2, timeout=60)
            torch.manual_seed(1)
            acc = accumulator(pipeline(schedule, sharded), clip=clip)
            norms = train(acc, range(TOTAL), sharded.get_local_rank("dp"), 2)
            results[run_name] = {"params": own_parameters(acc.pipe), "norms": norms}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    torch.save(results, out / f"{scenario}-rank{rank}.pt")


def _save_without_aliases(out: Path, mesh: Any) -> None:
    """``zb-v`` saved as a pipesched that did not record tied names would have: ``OUT/ck-old``."""
    from pipesched.train import store

    write = store.write

    def without(state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        write({k: v for k, v in state.items() if not k.startswith("aliases/")}, *args, **kwargs)

    store.write = without  # type: ignore[assignment]
    try:
        torch.manual_seed(1)
        acc = accumulator(pipeline("zb-v", mesh))
        train(acc, range(SAVE_AT), 0, 1)
        acc.save(str(out / "ck-old"))
    finally:
        store.write = write  # type: ignore[assignment]


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
