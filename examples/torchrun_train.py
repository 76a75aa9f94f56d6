"""A small Transformer language model trained across processes: pipeline (pp) x data (dp) parallel.

Run (CPU, gloo; one process per pipeline rank and replica):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/torchrun_train.py         # pp=2
    .venv/bin/torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py --dp 2  # x dp=2
Each stage sharded over the 2 replicas (FSDP2: parameters, gradients and AdamW state
1/dp per rank; its checkpoints load at any layout too):
    .venv/bin/torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py --dp 2 --shard
Past that, the window's gradients (and the window end's copies) kept in a file, not memory:
    ... examples/torchrun_train.py --dp 2 --shard --grad-backup disk   # or host (GPUs)
Saved at pp=2, resumed at pp=4 (one checkpoint directory, any layout):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/torchrun_train.py \
        --windows 4 --checkpoint ckpt
    .venv/bin/torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py \
        --windows 8 --checkpoint ckpt
Two nodes, restarted once if a rank dies; the restart resumes from the last
committed window by itself (run on each node; HEAD is one of them):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc_per_node 2 \
        --rdzv-backend c10d --rdzv-endpoint HEAD:29500 --rdzv-id job1 --max-restarts 1 \
        examples/torchrun_train.py --dp 2 --checkpoint ckpt --resume auto
Multi-node and SLURM launches: docs/distributed.md ("On a cluster").

Every rank builds the same model; Pipeline(..., mesh=...) keeps only this
rank's stages. Replicas draw different synthetic batches (sequences from a
fixed rule, random lengths, padding labelled -100); GradientAccumulator sums
token losses over each window, all-reduces gradients over "dp" once per
window and divides by the window's token count over all replicas. The batch
of each step is a pure function of (step, dp rank), so a resumed run sees
exactly the batches an uninterrupted one sees.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

from pipesched import GradientAccumulator, Pipeline, init_mesh

VOCAB, WIDTH, HEADS, LAYERS, LENGTH = 64, 64, 4, 4, 32
ROWS, CHUNKS, STEPS_PER_WINDOW = 8, 4, 2  # per replica and step; micro-batches; steps a window
KILL_AT = "PIPESCHED_EXAMPLE_KILL_AT"  # test hook only: "WINDOW,STEP,RANK" (see kill_if_asked)


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
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same weights
    return nn.Sequential(
        Embed(), *(Block() for _ in range(LAYERS)), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
    ).to(dtype)


def batch(step: int, dp_rank: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Step ``step``'s batch on replica ``dp_rank``: a pure function of the two (and ``rows``)."""
    generator = torch.Generator().manual_seed(1_000_003 * step + dp_rank)
    start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    steps = torch.arange(LENGTH + 1)
    sequences = (start + 7 * steps) % VOCAB  # next token = this one + 7
    lengths = torch.randint(4, LENGTH + 1, (rows,), generator=generator)
    ids, labels = sequences[:, :-1].clone(), sequences[:, 1:].clone()
    labels[steps[:-1] >= lengths[:, None]] = -100
    return ids, labels, int((labels != -100).sum())


def kill_if_asked(window: int, step: int, resumed: bool) -> None:
    """Test hook: SIGKILLs this rank before step ``step`` of window ``window`` (0-based).

    Only where ``PIPESCHED_EXAMPLE_KILL_AT`` is "WINDOW,STEP,RANK" and RANK is
    this global rank, and only in the first attempt: torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` is 0 and the run did not resume. (The count
    alone is per agent: an agent that restarts its workers because another
    node rejoins keeps 0.)
    """
    wanted = os.environ.get(KILL_AT)
    if not wanted or resumed or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if tuple(int(v) for v in wanted.split(",")) == (window, step, dist.get_rank()):
        print(f"rank {dist.get_rank()}: killed in window {window}, step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def committed(path: str | None) -> bool:
    """Whether ``path`` holds a committed checkpoint (a first save killed midway leaves none).

    ``acc.save`` writes each version beside the last and commits it by
    replacing ``path/latest`` once every rank has written.
    """
    return path is not None and os.path.isfile(os.path.join(path, "latest"))


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
        help="save a checkpoint (any pp and dp can load it) to DIR after every window",
    )
    parser.add_argument(
        "--resume",
        choices=["auto", "never"],
        default="auto",
        help="auto (default): resume from --checkpoint DIR if it holds a committed checkpoint, "
        "as after an elastic restart; never: start from scratch",
    )
    parser.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="the model's dtype"
    )
    parser.add_argument(
        "--shard", action="store_true", help="shard each stage over the dp replicas (FSDP2)"
    )
    parser.add_argument(
        "--grad-backup",
        choices=["device", "host", "disk"],
        default="device",
        help="where a step keeps what it may have to put back (Pipeline(grad_backup=...))",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    shard = args.dp if args.shard else 1
    mesh = init_mesh(pp=int(os.environ["WORLD_SIZE"]) // args.dp, dp=args.dp, shard=shard)
    pipe = Pipeline(
        model(getattr(torch, args.dtype)),
        chunks=CHUNKS,
        mesh=mesh,
        schedule=args.schedule,
        grad_backup=args.grad_backup,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    accumulator = GradientAccumulator(
        pipe, optimizer, accumulation_steps=STEPS_PER_WINDOW, max_grad_norm=1.0
    )
    info = pipe.mesh
    if dist.get_rank() == 0:
        print(
            f"pp={info.pp_size} x dp={info.dp_size}: stages {pipe.balance} (layers) on "
            f"{info.pp_size} ranks, schedule {args.schedule}"
            + (f", each stage sharded over {info.dp_size} replicas" if args.shard else "")
        )
    resumed = args.resume == "auto" and committed(args.checkpoint)
    if resumed:
        accumulator.load(args.checkpoint)  # every rank; each reads only its stages' shards
        if dist.get_rank() == 0:
            print(f"resumed from {args.checkpoint} at step {accumulator.steps}", flush=True)
    for step in range(accumulator.steps, args.windows * STEPS_PER_WINDOW):
        kill_if_asked(*divmod(step, STEPS_PER_WINDOW), resumed)
        ids, labels, count = batch(step, info.dp_rank)  # replicas see different data
        result = accumulator.step(ids, labels, loss_fn=token_sum, num_items=count)
        if result.stepped and dist.get_rank() == 0:
            print(accumulator.log_line(result), flush=True)
        if result.stepped and args.checkpoint:
            accumulator.save(args.checkpoint)  # committed atomically; every rank its shards
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
