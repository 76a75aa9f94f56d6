"""One rank of a planner test: `python plan_worker.py SCENARIO OUT_DIR` under torchrun-like env.

Scenario ``auto``: ``Pipeline(schedule="auto")`` on a pp=2 mesh. Rank 1's
first layer sleeps in its forward, so its profile differs from rank 0's and
alone it would choose another cut: the ranks must still build rank 0's pick.
Each rank saves the pick, its own plan's pick, the losses of two SGD steps and
its parameters afterwards.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
from torch import nn

from pipesched import Pipeline
from pipesched.planning import plan_model
from pipesched.runtime.mesh import init_mesh

CHUNKS, STEPS = 4, 2


class Slow(nn.Module):
    """The identity, slow on one rank: a rank-dependent profile."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds and torch.compiler.is_compiling() is False:
            time.sleep(self.seconds)
        return x


def model(seconds: float) -> nn.Sequential:
    """The test's model (the test builds it too, with seconds=0, as its reference)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(nn.Linear(8, 16), Slow(seconds), *blocks, nn.Linear(16, 512)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 512, (16,), generator=generator)


def run(out: str, mesh: object) -> None:
    rank = torch.distributed.get_rank()
    x, _ = batch(0)
    net = model(0.02 if rank == 1 else 0.0)
    own = plan_model(net, (x[:4],), 2, CHUNKS, num_threads=1, synthesized=False)
    pipe = Pipeline(net, CHUNKS, schedule="auto", mesh=mesh, example_inputs=(x[:4],))
    assert pipe.plan.report is not None
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        losses.append(float(pipe.step(x, y, loss_fn=nn.functional.cross_entropy)))
        optimizer.step()
    pick = pipe.plan.report.pick
    torch.save(
        {
            "pick": (pick.schedule, pick.counts, pick.checkpoint),
            "own": (own.pick.schedule, own.pick.counts, own.pick.checkpoint),
            "built": (pipe.schedule_name, tuple(pipe.balance), pipe.checkpoint),
            "losses": losses,
            "params": {
                n: p.detach().clone() for n, p in pipe.named_parameters() if p.device.type != "meta"
            },
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


def main() -> None:
    out = sys.argv[2]
    mesh = init_mesh(pp=2, timeout=30)
    run(out, mesh)
    # Collected before the group goes: a gloo work freed at exit aborts the process
    # ("terminate called without an active exception", pytorch/pytorch#190489).
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
