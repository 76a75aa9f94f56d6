"""A Hugging Face BERT classifier, pipelined with one line, on padded sequences with a mask.

Run: .venv/bin/python examples/bert_pipeline.py
     (needs transformers: .venv/bin/pip install transformers; nothing is downloaded)

``Pipeline(model, chunks=4, devices=["cpu", "cpu"])`` wraps a 4-layer
``BertForSequenceClassification`` from a small config as it is, and is called
as BERT is: ``pipe.step({"input_ids": ..., "attention_mask": ..., "labels":
...}, loss_fn=lambda out: out.loss)``. The first step traces it (the mask
included) and cuts it into two stages of equal time. The sequences have
lengths from 8 to 24 tokens, padded to 24 and masked; the label says whether
token 7 appears among the real tokens; the padding is all 7s, so only the
mask tells them apart. A ``GradientAccumulator`` runs windows of 2 steps.
"""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification
from transformers.utils import logging

from pipesched import GradientAccumulator, Pipeline

VOCAB, LENGTH, BATCH, CHUNKS, STEPS = 32, 24, 32, 4, 60
NEEDLE = 7


def batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    lengths = torch.randint(8, LENGTH + 1, (BATCH,), generator=generator)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    labels = ((ids == NEEDLE) & mask.bool()).any(dim=1).long()
    ids = torch.where(mask.bool(), ids, NEEDLE)  # padding of needles: only the mask hides them
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    pipe = Pipeline(model, chunks=CHUNKS, devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=2)
    for step in range(1, STEPS + 1):
        result = acc.step(batch(generator), loss_fn=lambda out: out.loss)
        if step == 1:
            print(pipe.partition, end="\n\n")
        if result.stepped and result.window % 5 == 0:
            print(acc.log_line(result))
    data = batch(generator)
    pipe.eval()
    with torch.no_grad():
        out = pipe(**data)
    accuracy = (out.logits.argmax(-1) == data["labels"]).float().mean().item()
    share = data["labels"].float().mean().item()
    print(f"\n{type(out).__name__}: accuracy on a fresh batch {accuracy:.2f} ")
    print(f"(always guessing the commoner label gives {max(share, 1 - share):.2f})")


if __name__ == "__main__":
    main()
