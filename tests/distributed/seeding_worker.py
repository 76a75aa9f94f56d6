"""One rank of the mesh seeding test: draws appear where none were learned; the ranks rerun.

Scenarios (argv[1]):
- "late" (pp=2): stage 1's ``LateNoise`` starts drawing at step 2, the loss at
  step 3: a tripwire on pp rank 1 only; both ranks must rerun those steps.
- "late-dp" (pp=2, dp=2): ``LateNoise`` switched on in replica 0 only, every
  step a window of its own (gradients summed during the step): every replica
  must rerun with it. Each rank runs the steps twice, learning (tripwires) and
  seeded throughout, and saves both.
- "failed-rerun" (pp=2, dp=2, windows of 2 steps): at a window's last step
  ``LateNoise`` draws in forward and in backward, the latter on another thread
  (as an autograd thread of a device would), so the rerun trips again and
  the step fails (UnseededDraws) on every rank; ``flush()`` then ends the
  window as if that step never ran. Saved: that run and one that skips the step.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

from pipesched import GradientAccumulator, Pipeline
from pipesched.runtime.mesh import init_mesh
from pipesched.runtime.stage.seeding import UnseededDraws

ROWS, CHUNKS, BALANCE, STEPS = 8, 4, [3, 3], 5
NOISE_FROM, LOSS_NOISE_FROM = 2, 3


class BackwardNoise(torch.autograd.Function):
    """The identity, whose backward draws."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        # Drawn on another thread, as an autograd thread of a CUDA device would: no seeding
        # reaches it (one on the stage's thread is seeded in the rerun).
        noise: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: noise.append(torch.rand(())))
        thread.start()
        thread.join()
        return g * (1 + 0.1 * noise[0])


class LateNoise(nn.Module):
    """Draws only once switched on (``back``: in backward too): a place never seen drawing."""

    def __init__(self) -> None:
        super().__init__()
        self.on = self.back = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.1 * torch.randn_like(x) if self.on else x
        return BackwardNoise.apply(x) if self.back else x


class NoisyLoss:
    """Mean squared error, plus a random term once switched on."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(y, t)
        return loss * (1 + 0.1 * torch.rand(())) if self.on else loss


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 8), LateNoise(), nn.Linear(8, 8)
    ).double()


def data(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    return (
        torch.randn(ROWS, 8, generator=g, dtype=torch.float64),
        torch.randn(ROWS, 8, generator=g, dtype=torch.float64),
    )


def train(
    pipe: Pipeline, noise: LateNoise, replica: int, noisy_replicas: set[int]
) -> list[torch.Tensor]:
    """STEPS SGD steps; the noise switched on at its steps in ``noisy_replicas``."""
    loss_fn = NoisyLoss()
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=1
    )
    torch.manual_seed(1)
    losses = []
    for step in range(STEPS):
        noise.on = step >= NOISE_FROM and replica in noisy_replicas
        loss_fn.on = step >= LOSS_NOISE_FROM and replica in noisy_replicas
        losses.append(acc.step(*data(step, replica), loss_fn=loss_fn).loss)
    return losses


def seeded_throughout(pipe: Pipeline) -> Pipeline:
    for seeding in pipe.engine.seedings:
        seeding.permanent, seeding.full = True, {True: True, False: True}
    return pipe


def failed_rerun(mesh: object, fail: bool) -> dict[str, object]:
    """Steps 0-2, then (``fail``) a window's last step that fails twice, then flush()."""
    net = model()
    pipe = Pipeline(net, CHUNKS, balance=BALANCE, mesh=mesh, schedule="1f1b")
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2
    )
    torch.manual_seed(1)
    for step in range(3):
        acc.step(*data(step, pipe.mesh.dp_rank), loss_fn=F.mse_loss)
    raised = None
    if fail:
        net[4].on = net[4].back = True
        try:
            acc.step(*data(3, pipe.mesh.dp_rank), loss_fn=F.mse_loss)
        except UnseededDraws as error:
            raised = type(error).__name__
        net[4].on = net[4].back = False
    acc.flush()
    params = {n: p.detach().clone() for n, p in pipe.named_parameters() if p.device.type != "meta"}
    return {"raised": raised, "params": params}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_default_dtype(torch.float64)  # as the test's reference
    dp = 1 if scenario == "late" else 2
    mesh = init_mesh(pp=2, dp=dp, timeout=30)
    rank = torch.distributed.get_rank()
    if scenario == "failed-rerun":
        results = {"failed": failed_rerun(mesh, True), "skipped": failed_rerun(mesh, False)}
        torch.save(results, out / f"rank{rank}.pt")
        torch.distributed.destroy_process_group()
        return
    results = {}
    for kind in ("learning", "throughout"):
        net = model()
        pipe = Pipeline(net, CHUNKS, balance=BALANCE, mesh=mesh, schedule="1f1b")
        if kind == "throughout":
            seeded_throughout(pipe)
        losses = train(pipe, net[4], pipe.mesh.dp_rank, {0})
        results[kind] = {
            "losses": losses,
            "params": {  # this rank's own
                n: p.detach().clone() for n, p in pipe.named_parameters() if p.device.type != "meta"
            },
            "reruns": pipe.engine.reruns,
            # Stage seeding learned: hooks and tripwires, not the whole forward.
            "watching": [s.watching for s in pipe.engine.seedings],
        }
        if scenario == "late":
            break
    torch.save(results, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
