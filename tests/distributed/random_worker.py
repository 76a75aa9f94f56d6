"""One rank of the randomness test: every kind of random call, one 1F1B step at pp=2."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

from pipesched import Pipeline
from pipesched.runtime.mesh import init_mesh
from tests.runtime.stage.random_kinds import KINDS, model_of

ROWS, CHUNKS, BALANCE = 10, 4, [2, 3]


def main() -> None:
    out = Path(sys.argv[2])
    torch.set_default_dtype(torch.float64)
    mesh = init_mesh(pp=2, timeout=30)
    rank = torch.distributed.get_rank()
    results = {}
    for kind in KINDS:
        pipe = Pipeline(
            model_of(kind),
            CHUNKS,
            balance=BALANCE,
            mesh=mesh,
            schedule="1f1b",
            checkpoint="always",
        )
        torch.manual_seed(1)
        x, y = torch.randn(ROWS, 8), torch.randn(ROWS, 8)
        loss = pipe.step(x, y, loss_fn=F.mse_loss)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        results[kind] = (loss, grads)
    torch.save(results, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
