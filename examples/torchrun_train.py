"""A small Transformer language model trained across processes: pipeline (pp) x data (dp) parallel.

Run (CPU, gloo; one process per pipeline rank and replica):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/torchrun_train.py         # pp=2
    .venv/bin/torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py --dp 2  # x dp=2
Saved at pp=2, resumed at pp=4 (one checkpoint directory, any layout):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/torchrun_train.py \
        --windows 4 --checkpoint ckpt
    .venv/bin/torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py \
        --windows 8 --checkpoint ckpt
Multi-node and SLURM launches: docs/distributed.md.

Every rank builds the same model; Pipeline(..., mesh=...) keeps only this
rank's stages. Replicas draw different synthetic batches (sequences from a
fixed rule, random lengths, padding labelled -100); GradientAccumulator sums
token losses over each window, all-reduces gradients over "dp" once per
window and divides by the window's token count over all replicas.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from pipesched import GradientAccumulator, Pipeline, init_mesh

VOCAB, WIDTH, HEADS, LAYERS, LENGTH = 64, 64, 4, 4, 32


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """A causal pre-norm Transformer layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.layer(x, src_mask=mask, is_causal=True)


def model() -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same weights
    return nn.Sequential(
        Embed(), *(Block() for _ in range(LAYERS)), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
    )


def batch(generator: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    steps = torch.arange(LENGTH + 1)
    sequences = (start + 7 * steps) % VOCAB  # next token = this one + 7
    lengths = torch.randint(4, LENGTH + 1, (rows,), generator=generator)
    ids, labels = sequences[:, :-1].clone(), sequences[:, 1:].clone()
    labels[steps[:-1] >= lengths[:, None]] = -100
    return ids, labels, int((labels != -100).sum())


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="resume from DIR if it holds a checkpoint (saved at any pp and dp); save every window",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = init_mesh(pp=int(os.environ["WORLD_SIZE"]) // args.dp, dp=args.dp)
    pipe = Pipeline(model(), chunks=4, mesh=mesh, schedule=args.schedule)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    accumulator = GradientAccumulator(pipe, optimizer, accumulation_steps=2, max_grad_norm=1.0)
    info = pipe.mesh
    generator = torch.Generator().manual_seed(100 + info.dp_rank)  # replicas see different data
    if dist.get_rank() == 0:
        print(
            f"pp={info.pp_size} x dp={info.dp_size}: stages {pipe.balance} (layers) on "
            f"{info.pp_size} ranks, schedule {args.schedule}"
        )
    if args.checkpoint and os.path.isdir(args.checkpoint):
        accumulator.load(args.checkpoint)  # every rank; each reads only its stages' shards
        for _ in range(accumulator.steps):  # the data stream continues where it was
            batch(generator, rows=8)
        if dist.get_rank() == 0:
            print(f"resumed from {args.checkpoint} at step {accumulator.steps}")
    for _ in range(accumulator.steps, args.windows * 2):
        ids, labels, count = batch(generator, rows=8)
        result = accumulator.step(ids, labels, loss_fn=token_sum, num_items=count)
        if result.stepped and dist.get_rank() == 0:
            print(accumulator.log_line(result), flush=True)
        if result.stepped and args.checkpoint:
            accumulator.save(args.checkpoint)  # one checkpoint, every rank its shards
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
