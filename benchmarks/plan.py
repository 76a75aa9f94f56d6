"""The planner's pick against "equal layers per stage + 1F1B" at the same memory budget, measured.

Run: .venv/bin/python benchmarks/plan.py [--rounds 9] [--vocab 32000]

Model: a Hugging Face GPT-2 built from a small config (8 blocks, width 256,
4 heads, 64 positions, no dropout) with a 32k vocabulary: its embedding and
its LM head (tied, as GPT-2's are) with the token loss over 32k logits are
each heavier than several blocks. Batch: 16 sequences of 64 tokens, chunks 8,
the model's own loss (``labels=``). Two CPU workers (one thread each) in one
process.

- baseline: ``Pipeline(model, 8, split_points=["transformer.h.4"],
  schedule="1f1b", checkpoint="never")``: half the blocks per stage, the
  embedding on the first, the head and loss on the last.
- plan Hx: ``Pipeline(model, 8, schedule="auto", example_inputs=<one
  micro-batch>, memory_budget=H * B)`` with B the baseline's own peak memory
  as the planner estimates it (parameters, their gradients, held
  activations). At 1x the plan must fit exactly what the baseline uses; at
  1.1x it may use a tenth more, as on a device with some headroom (the
  baseline fits either budget).

After three warm-up steps each, every round steps each pipeline twice in a
row, pipelines alternating, and times the second step (the first lets memory
settle after the other pipelines' steps, as in a training loop of one); the
medians of the rounds are compared. Also printed: the planner's table, and
each pipeline's predicted step (``pipe.predict()`` after the last step).
Target: plan >= 15% faster than the baseline (ratio <= 0.85).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

from pipesched import Pipeline
from pipesched.partition.call import Call
from pipesched.planning import plan_layers
from pipesched.planning.measure import layer_costs

BLOCKS, WIDTH, HEADS, TOKENS, ROWS, CHUNKS = 8, 256, 4, 64, 16, 8


def gpt2(vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=TOKENS,
        n_embd=WIDTH,
        n_layer=BLOCKS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def batch(vocab: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, TOKENS), generator=generator)
    return {"input_ids": ids, "labels": ids}


def loss_fn(out: object) -> torch.Tensor:
    return out.loss  # type: ignore[attr-defined, no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--headroom",
        type=float,
        nargs="+",
        default=[1.0, 1.1],
        help="budgets to plan for, as multiples of the baseline's own peak",
    )
    args = parser.parse_args()
    logging.set_verbosity_error()
    devices = ["cpu", "cpu"]
    example = Call((), batch(args.vocab, ROWS // CHUNKS, 1))
    print(
        f"GPT-2: {BLOCKS} blocks, width {WIDTH}, vocab {args.vocab}; batch {ROWS} x {TOKENS} "
        f"tokens, chunks {CHUNKS}; 2 CPU workers; load average {os.getloadavg()[0]:.2f}\n"
    )
    baseline = Pipeline(
        gpt2(args.vocab),
        CHUNKS,
        split_points=["transformer.h.4"],
        schedule="1f1b",
        checkpoint="never",
        devices=devices,
        example_inputs=example,
    )
    # The baseline's peak memory as the planner counts it: the budget both must meet.
    costs, _ = layer_costs(gpt2(args.vocab), example, num_threads=1)
    own = plan_layers(
        costs,
        2,
        CHUNKS,
        schedules=["1f1b"],
        checkpoints=["never"],
        counts=baseline.balance,
        synthesized=False,
    )
    budget = own.pick.peak_bytes
    pipes = {"baseline": baseline}
    peaks = {"baseline": budget}
    for headroom in args.headroom:
        started = time.perf_counter()
        plan = Pipeline(
            gpt2(args.vocab),
            CHUNKS,
            schedule="auto",
            devices=devices,
            example_inputs=example,
            memory_budget=headroom * budget,
        )
        seconds = time.perf_counter() - started
        assert plan.plan.report is not None
        print(f"budget {headroom:g} x the baseline's peak: planned in {seconds:.1f} s")
        print(plan.plan, end="\n\n")
        name = f"plan {headroom:g}x"
        pipes[name], peaks[name] = plan, plan.plan.report.pick.peak_bytes
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for pipe in pipes.values():
        for _ in range(3):  # warm-up: the allocator settles over a few steps
            pipe.step(batch(args.vocab, ROWS, 0), loss_fn=loss_fn)
    for r in range(args.rounds):
        data = batch(args.vocab, ROWS, r + 2)
        for name, pipe in pipes.items():
            pipe.step(data, loss_fn=loss_fn)  # settles after the other pipelines' steps
            started = time.perf_counter()
            pipe.step(data, loss_fn=loss_fn)
            times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(t) for name, t in times.items()}
    header = f"{'pipeline':<10} {'schedule':<12} {'checkpoint':<27} {'balance':<22}"
    print(
        f"{header} {'predicted':>10} {'measured':>10} {'best':>9} {'peak (est.)':>12} {'ratio':>6}"
    )
    for name, pipe in pipes.items():
        predicted = pipe.predict().step_time
        modes = pipe.checkpoint if isinstance(pipe.checkpoint, str) else ",".join(pipe.checkpoint)
        print(
            f"{name:<10} {pipe.schedule_name:<12} {modes:<27} {pipe.balance!s:<22} "
            f"{predicted * 1e3:8.1f} ms {median[name] * 1e3:7.1f} ms "
            f"{min(times[name]) * 1e3:6.1f} ms {peaks[name] / 2**20:8.1f} MiB "
            f"{median[name] / median['baseline']:6.3f}"
        )
    print(
        f"\nbaseline peak (the 1x budget): {budget / 2**20:.1f} MiB per worker; target: a plan "
        ">= 15% faster than the baseline (ratio <= 0.85) within its budget"
    )


if __name__ == "__main__":
    main()
