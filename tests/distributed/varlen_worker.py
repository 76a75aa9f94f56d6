"""One rank of the variable-shape mesh test: `python varlen_worker.py SCENARIO OUT_DIR`.

pp=2 x dp=2. For every schedule, each replica steps its own lists of
micro-batches (sequence lengths and row counts all different, and a
different number of micro-batches per replica): one window of
GradientAccumulator with ``num_items`` (token sums), one without (token
means weighted by rows), then one plain ``pipe.step``. Two schedules use the
exact-size transfer protocol (NCCL's), the others gloo's larger receives. The gradients each
optimizer was about to apply, and pipe.step's, are saved for the test. Last,
the ranks of a pipeline given lists of other row counts refuse the step.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import ConfigError
from pipesched.runtime.mesh import init_mesh

SCHEDULES = {  # name: balance (4 layers)
    "gpipe": [2, 2],
    "1f1b": [2, 2],
    "zb-h1": [2, 2],
    "interleaved-1f1b": [1, 1, 1, 1],
    "zb-v": [1, 1, 1, 1],
}
EXACT = ("gpipe", "interleaved-1f1b")  # these run the exact-size (ordered) transport, NCCL's
PP, DP, STEPS, VOCAB, WIDTH = 2, 2, 2, 11, 8
# (rows, sequence length) of each micro-batch of a replica's step; step s adds s to lengths
SHAPES = {0: [(2, 7), (1, 19), (3, 3)], 1: [(1, 11), (2, 2), (1, 23), (3, 5), (2, 13)]}


def model() -> nn.Sequential:
    torch.manual_seed(0)

    def encoder() -> nn.Module:
        return nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
        )

    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), encoder(), encoder(), nn.Linear(WIDTH, VOCAB)
    ).double()


def batches(
    schedule: str, window: int, step: int, replica: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """A replica's micro-batches, their labels (the tail of each row is -100) and token count."""
    g = torch.Generator().manual_seed(
        hash((list(SCHEDULES).index(schedule), window, step, replica)) % 2**31
    )
    return micro_batches([(rows, length + step) for rows, length in SHAPES[replica]], VOCAB, g)


def micro_batches(
    shapes: list[tuple[int, int]], vocab: int, g: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Token ids below ``vocab`` and labels of these (rows, length) shapes, second halves -100."""
    xs, ys = [], []
    for rows, length in shapes:
        x = torch.randint(0, vocab, (rows, length), generator=g)
        y = torch.randint(0, vocab, (rows, length), generator=g)
        y[:, (length + 1) // 2 :] = -100
        xs.append(x)
        ys.append(y)
    return xs, ys, int(sum((y != -100).sum() for y in ys))


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def grads(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def run(mesh: object, schedule: str, balance: list[int]) -> dict[str, object]:
    """Two windows (num_items, then row-weighted means) and one pipe.step on ``schedule``."""
    asked = os.environ.get("PIPESCHED_P2P")
    if schedule in EXACT:  # read when the pipeline is built
        os.environ["PIPESCHED_P2P"] = "ordered"
    pipe = Pipeline(model(), 2, balance=balance, mesh=mesh, schedule=schedule)
    os.environ.pop("PIPESCHED_P2P", None)
    if asked is not None:
        os.environ["PIPESCHED_P2P"] = asked
    stats = pipe.engine.runtime.stats
    replica = pipe.mesh.dp_rank
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.0), accumulation_steps=STEPS
    )
    seen: list[dict[str, torch.Tensor]] = []  # each window's gradients, as the optimizer sees them
    acc.optimizers[0].register_step_pre_hook(lambda *_: seen.append(grads(pipe)))
    record: dict[str, object] = {}
    for window, summed in enumerate((True, False)):
        for step in range(STEPS):
            xs, ys, n = batches(schedule, window, step, replica)
            result = acc.step(
                microbatches=xs,
                targets=ys,
                loss_fn=token_sum if summed else token_mean,
                num_items=n if summed else None,
            )
        record[f"window{window}"] = (result.window_loss, result.effective_batch)
    record["grads"] = seen
    pipe.zero_grad(set_to_none=True)
    xs, ys, n = batches(schedule, 2, 0, replica)  # shapes seen before: no notice
    before = stats.notices
    record["step_loss"] = float(
        pipe.step(microbatches=xs, targets=ys, loss_fn=token_sum, num_items=n)
    )
    record["step_grads"] = grads(pipe)
    record["notices"] = (stats.notices, stats.notices - before)
    record["receives"] = (stats.unplanned, stats.unread)
    record["mode"] = pipe.engine.runtime.mode  # tagged, or ordered under PIPESCHED_P2P=ordered
    return record


def disagree(mesh: object) -> dict[str, object]:
    """pp rank 1 is given micro-batches of other row counts, then another batch of the same
    sizes (a rank that skipped one): every rank refuses each step, then steps on."""
    pipe = Pipeline(model(), 2, balance=[2, 2], mesh=mesh, schedule="1f1b")

    def refusal(change) -> str:
        xs, ys, _ = batches("1f1b", 3, 0, pipe.mesh.dp_rank)
        if pipe.mesh.pp_rank == 1:
            xs, ys = change(xs, ys)
        try:
            pipe.step(microbatches=xs, targets=ys, loss_fn=token_mean)
        except ConfigError as error:
            return str(error)
        return ""

    record: dict[str, object] = {
        "refused": refusal(lambda xs, ys: ([x[:1] for x in xs], [y[:1] for y in ys])),
        "other batch": refusal(lambda xs, ys: ([(x + 1) % VOCAB for x in xs], ys)),
    }
    xs, ys, _ = batches("1f1b", 3, 0, pipe.mesh.dp_rank)
    record["then"] = float(pipe.step(microbatches=xs, targets=ys, loss_fn=token_mean))
    return record


def main() -> None:
    out = sys.argv[2]
    mesh = init_mesh(pp=PP, dp=DP, timeout=30)
    results = {schedule: run(mesh, schedule, balance) for schedule, balance in SCHEDULES.items()}
    results["disagree"] = disagree(mesh)
    torch.save(results, os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
