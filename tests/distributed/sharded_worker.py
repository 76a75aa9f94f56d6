"""One rank of the sharded-checkpoint tests (tests/distributed/test_sharded.py).

``python sharded_worker.py SCENARIO OUT`` under torchrun's environment, or
with WORLD_SIZE unset for one process. Scenarios:

- ``save``: pp=2 x dp=1 trains SAVE_AT steps (a window and a half) of three
  models (``traced``: a tied LM traced by torch.export; ``drop``: an MLP
  with Dropout; ``plain``: without) and saves each to ``OUT/<model>``; then steps
  once more and saves ``OUT/drop`` again, rank 1 dying halfway through
  writing its shards (the previous version must stay loadable).
- ``resume-<model>-<pp>x<dp>``: loads ``OUT/<model>`` at that layout and
  trains the remaining steps (every rank writes its parameters to ``OUT``);
  ``meta<model>``: the model built on the meta device, each rank allocating
  only its stages (``init_weights="skip"``) and filling them from the load.
- ``weights``: pp=2 loads the plain model's weights with ``load_model``, from
  ``OUT/plain.pt`` and from ``OUT/plain``; then where rank 1's last layer is
  wider, every rank refuses.
- ``misfit``: pp=2 where rank 1's last layer is wider: every rank's load fails.
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

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import CheckpointError

WIDTH = 12
ROWS = 8
STEPS = 2  # per window
SAVE_AT = 3  # steps done at the save: one window and one step into the next
TOTAL = SAVE_AT + 1 + 2 * STEPS  # then the window's last step and two more windows
BALANCE = {1: [8], 2: [4, 4], 4: [1, 3, 2, 2]}
VOCAB = 11


def mlp(dropout: float, out: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, WIDTH), nn.Tanh(), nn.Dropout(dropout), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, out),
    )  # fmt: skip


class TiedLM(nn.Module):
    """Not a Sequential (traced): the head tied to the embedding, on another stage at pp=2."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(self.fc2(torch.tanh(self.fc1(h))) + h)


def tied_lm() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def tokens(step: int, replica: int = 0, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, VOCAB, (ROWS, 5), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, 5), generator=g)
    y[:, 1 + step % 4 :] = -100  # uneven token counts
    share = ROWS // replicas
    rows = slice(replica * share, (replica + 1) * share)
    return x[rows], y[rows]


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def batch(step: int, replica: int = 0, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or replica ``replica``'s share of its rows."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 2, generator=g)
    share = ROWS // replicas
    rows = slice(replica * share, (replica + 1) * share)
    return x[rows], y[rows]


def model(name: str) -> nn.Module:
    """The model a checkpoint's name stands for; "meta<name>": built on the meta device."""
    if name.startswith("meta"):
        with torch.device("meta"):
            return model(name[len("meta") :])
    return tied_lm() if name == "traced" else mlp(0.1 if name == "drop" else 0.0)


def accumulator(pipe: nn.Module) -> GradientAccumulator:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    return GradientAccumulator(
        pipe, optimizer, accumulation_steps=STEPS, max_grad_norm=0.5, lr_scheduler=scheduler
    )


def pipeline(model: nn.Module, pp: int, mesh: object | None) -> Pipeline:
    devices = None if mesh is not None else ["cpu"] * pp
    if next(model.parameters()).is_meta:  # each rank allocates its stages, for the load
        return _pipeline(model, pp, mesh, devices, init_weights="skip")
    return _pipeline(model, pp, mesh, devices)


def _pipeline(
    model: nn.Module, pp: int, mesh: object | None, devices: list[str] | None, **more: object
) -> Pipeline:
    if isinstance(model, TiedLM):
        split = {1: [], 2: ["fc2"]}[pp]
        example = (tokens(0)[0][:2],)
        return Pipeline(
            model, 2, split_points=split, devices=devices, mesh=mesh, example_inputs=example,
            num_stages=None if mesh is None else pp, schedule="1f1b", **more,
        )  # fmt: skip
    return Pipeline(
        model, 2, balance=BALANCE[pp], devices=devices, schedule="1f1b", mesh=mesh, **more
    )


def train(acc: GradientAccumulator, steps: range, replica: int, replicas: int) -> None:
    for step in steps:
        if isinstance(acc.pipe._model[0], TiedLM):  # (built on meta or not)
            x, y = tokens(step, replica, replicas)
            acc.step(x, y, loss_fn=token_sum, num_items=int((y != -100).sum()))
        else:
            x, y = batch(step, replica, replicas)
            acc.step(x, y, loss_fn=nn.functional.mse_loss)


def own_parameters(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pipe.named_parameters() if not p.is_meta}


def _reinit(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.reset_parameters()  # other weights than the checkpoint's


def main(scenario: str, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    mesh = None
    rank, pp, dp = 0, 1, 1
    if "WORLD_SIZE" in os.environ:
        from pipesched.runtime.mesh import init_mesh

        world = int(os.environ["WORLD_SIZE"])
        dp = 2 if scenario.endswith("x2") else 1
        pp = world // dp
        mesh = init_mesh(pp=pp, dp=dp, timeout=30)
        rank = dist.get_rank()
    run(scenario, out, mesh, rank, pp, dp)  # its pipelines are freed when it returns
    if mesh is not None:
        # Collected before the group goes: a gloo work freed at exit aborts the process
        # ("terminate called without an active exception", pytorch/pytorch#190489).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def run(scenario: str, out: Path, mesh: Any, rank: int, pp: int, dp: int) -> None:
    """Runs ``scenario`` on this rank and writes its results under ``out``."""
    results: dict[str, object] = {}
    if scenario == "save":
        for name in ("traced", "drop", "plain"):
            torch.manual_seed(1)  # the step seeds' generator, as the reference's
            acc = accumulator(pipeline(model(name), pp, mesh))
            train(acc, range(SAVE_AT), 0, 1)
            acc.save(str(out / name))
            results[name] = own_parameters(acc.pipe)
        torch.save(results, out / f"rank{rank}.pt")
        train(acc, range(SAVE_AT, SAVE_AT + 1), 0, 1)  # the "plain" model: a new version...
        if rank == 1:  # ...that rank 1 dies writing
            import torch.distributed.checkpoint.filesystem as files

            def die(*args: object, **kwargs: object) -> None:
                os._exit(3)

            files.FileSystemWriter.write_data = die  # type: ignore[method-assign]
        acc.save(str(out / "plain"))
    elif scenario.startswith("resume-"):
        _, name, _ = scenario.split("-")
        torch.manual_seed(99)  # whatever the generator holds, the checkpoint's state wins
        acc = accumulator(pipeline(model(name), pp, mesh))
        acc.load(str(out / name.removeprefix("meta")))
        replica = 0 if mesh is None else mesh.get_local_rank("dp")
        train(acc, range(SAVE_AT, TOTAL), replica, dp)
        results["params"] = own_parameters(acc.pipe)
        results["steps"], results["windows"] = acc.steps, acc.windows
        torch.save(results, out / f"{scenario}-rank{rank}.pt")
    elif scenario == "weights":  # plain weights into a pipeline, each rank reading its own
        from pipesched.train import load_model

        for source in ("plain.pt", "plain"):
            torch.manual_seed(5)
            pipe = pipeline(mlp(0.0).apply(_reinit), pp, mesh)
            load_model(pipe, str(out / source))
            results[source] = own_parameters(pipe)
        wide = pipeline(mlp(0.0, out=2 if rank == 0 else 3), pp, mesh)
        before = own_parameters(wide)
        try:
            load_model(wide, str(out / "plain.pt"))
        except CheckpointError as err:
            results["error"] = str(err)
        results["unchanged"] = all(
            torch.equal(before[n], p) for n, p in own_parameters(wide).items()
        )
        torch.save(results, out / f"weights-rank{rank}.pt")
    elif scenario == "misfit":
        acc = accumulator(pipeline(mlp(0.0, out=2 if rank == 0 else 3), pp, mesh))
        before = own_parameters(acc.pipe)
        try:
            acc.load(str(out / "plain"))
        except CheckpointError as err:
            results["error"] = str(err)
        results["unchanged"] = all(
            torch.equal(before[n], p) for n, p in own_parameters(acc.pipe).items()
        )
        try:  # no checkpoint on any rank: "start afresh", as in one process
            acc.load(str(out / "absent"))
        except FileNotFoundError:
            results["absent"] = True
        torch.save(results, out / f"misfit-rank{rank}.pt")
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
