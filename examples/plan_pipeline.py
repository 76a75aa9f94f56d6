"""Let pipesched choose: schedule, cut and checkpoint mode for a GPT-2 with a large vocabulary.

Run: .venv/bin/python examples/plan_pipeline.py [--budget-mib 200]
     (needs transformers: .venv/bin/pip install transformers; nothing is downloaded)

A 6-block GPT-2 (width 192) with a 16k vocabulary: its LM head and the loss
over 16k logits weigh as much as several blocks, so "equal blocks per stage"
leaves the last stage doing most of the work. ``Pipeline(model, chunks=8,
schedule="auto", example_inputs=<one micro-batch>, memory_budget=...)``
profiles every layer once and compares every built-in schedule, each with its
best cut, under each checkpoint mode, plus schedules synthesized for these
costs; it builds the fastest that fits the budget and ``print(pipe.plan)``
shows the whole comparison. Then a few training steps, and the step the
pipeline predicts from its own measured actions beside the measured one.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

from pipesched import Pipeline
from pipesched.partition.call import Call

VOCAB, TOKENS, ROWS, CHUNKS = 16000, 64, 16, 8


def batch(generator: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    """Random token sequences; GPT-2 predicts each next token (its own loss, labels=ids)."""
    ids = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
    return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=None, help="memory per worker")
    args = parser.parse_args()
    logging.set_verbosity_error()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=192, n_layer=6, n_head=4)
    model = GPT2LMHeadModel(config)
    example = Call((), batch(generator, ROWS // CHUNKS))  # one micro-batch, as keywords
    budget = None if args.budget_mib is None else args.budget_mib * 2**20
    pipe = Pipeline(
        model,
        chunks=CHUNKS,
        schedule="auto",
        devices=["cpu", "cpu"],
        example_inputs=example,
        memory_budget=budget,
    )
    print(pipe.plan, end="\n\n")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step in range(1, 6):
        data = batch(generator, ROWS)
        optimizer.zero_grad()
        started = time.perf_counter()
        loss = pipe.step(data, loss_fn=lambda out: out.loss)
        seconds = time.perf_counter() - started
        optimizer.step()
        print(f"step {step}: loss {loss.item():.3f}, {seconds * 1e3:.0f} ms")
    print(f"\npredicted from the last step's actions: {pipe.predict().step_time * 1e3:.0f} ms")
    print(pipe.predict().summary())


if __name__ == "__main__":
    main()
