"""GPT-2 from Hugging Face, traced and cut into 2 CPU stages automatically, trained on tokens.

Run: .venv/bin/python examples/gpt2_pipeline.py          # 2 CPU stages in one process
     .venv/bin/torchrun --standalone --nproc_per_node 2 examples/gpt2_pipeline.py
                                                        # 2 ranks (gloo), a stage each
     (needs transformers: .venv/bin/pip install transformers; nothing is downloaded)

A 4-block GPT-2 built from a small config (``GPT2LMHeadModel`` with tied input
and output embeddings) is wrapped in a module that returns only the logits
(``use_cache=False``: a cache object is not a tensor and cannot cross stages).
``Pipeline(model, chunks=4, example_inputs=(ids,), num_stages=2)`` traces it
with torch.export, profiles every operation on the CPU and cuts between the
layers so that both stages take the same time; the table of the cut is
printed. The embedding (stage 0) and the LM head (stage 1) are one
Parameter, which gets the sum of both stages' gradients, as in the plain
model. Training uses 1F1B on sequences that follow a fixed rule (next token
= 3 x token + 1 mod 64, with 5% noise), with the summed token loss divided by
the batch's token count, through ``GradientAccumulator`` (under torchrun it
also sums the tied embedding's gradient over the two ranks). Then
``pipe.eval()`` turns dropout off (attention dropout included) for the
accuracy on a fresh batch.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

from pipesched import GradientAccumulator, Pipeline
from pipesched.distributed import init_mesh

VOCAB, LENGTH, BATCH, CHUNKS, STEPS = 64, 32, 16, 4, 40


class GPT2Logits(nn.Module):
    """Token ids in, logits out: what a pipeline stage can carry."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=64,
            n_layer=4,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=ids, use_cache=False).logits


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of the rule x -> 3x + 1 (mod VOCAB) with noise; labels are the next tokens."""
    x = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    tokens = [x]
    for _ in range(LENGTH):
        x = (3 * x + 1) % VOCAB
        noise = torch.rand(x.shape, generator=generator) < 0.05
        x = torch.where(noise, torch.randint(0, VOCAB, x.shape, generator=generator), x)
        tokens.append(x)
    sequence = torch.cat(tokens, dim=1)
    return sequence[:, :-1], sequence[:, 1:]


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def main() -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = GPT2Logits()
    example, _ = batch(generator)
    torchrun = "RANK" in os.environ
    where = {"mesh": init_mesh(pp=2)} if torchrun else {"devices": ["cpu", "cpu"]}
    pipe = Pipeline(
        model,
        chunks=CHUNKS,
        example_inputs=(example[: BATCH // CHUNKS],),  # one micro-batch
        num_stages=2,
        schedule="1f1b",
        **where,
    )
    first = not torchrun or pipe.mesh.pp_rank == 0  # type: ignore[union-attr]
    say = print if first else (lambda *args, **kwargs: None)
    say(pipe.partition, end="\n\n")
    tied = model.gpt2.lm_head.weight is model.gpt2.transformer.wte.weight
    say(f"lm_head.weight is transformer.wte.weight: {tied} (used by stages 0 and 1)\n")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=1)
    for step in range(1, STEPS + 1):
        ids, labels = batch(generator)
        result = acc.step(ids, labels, loss_fn=token_sum, num_items=labels.numel())
        if step % 5 == 0 or step == 1:
            timeline = pipe.gather_timeline()  # every rank's actions (a collective), on rank 0
            if timeline is not None:
                print(f"step {step:3d}  loss {result.loss:.3f}  ({timeline.summary()})")
    ids, labels = batch(generator)
    pipe.eval()  # dropout off, attention dropout included
    with torch.no_grad():
        logits = pipe(ids)  # under torchrun: on the last stage's rank only
    if logits is not None:
        accuracy = (logits.argmax(-1) == labels).float().mean().item()
        print(f"\nnext-token accuracy on a fresh batch: {accuracy:.2f} (the rule alone gives 0.95)")


if __name__ == "__main__":
    main()
