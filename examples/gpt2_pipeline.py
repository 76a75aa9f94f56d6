"""GPT-2 from Hugging Face, pipelined with one line and called as GPT-2 is, trained on tokens.

Run: .venv/bin/python examples/gpt2_pipeline.py          # 2 CPU stages in one process
     .venv/bin/torchrun --standalone --nproc_per_node 2 examples/gpt2_pipeline.py
                                                        # 2 ranks (gloo), a stage each
     (needs transformers: .venv/bin/pip install transformers; nothing is downloaded)

``Pipeline(model, chunks=4, devices=["cpu", "cpu"])`` wraps a 4-block
``GPT2LMHeadModel`` built from a small config (tied input and output
embeddings, its default dropout), as it is: no wrapper, no example input. The
first step traces it with torch.export on that step's first micro-batch
(caching off: ``use_cache=False`` is passed for it), measures every operation
and cuts it where both stages take the same time; the table of the cut is
printed. The embedding (stage 0) and the LM head (stage 1) are one Parameter,
which gets the sum of both stages' gradients, as in the plain model.

The batch is what GPT-2 takes: ``{"input_ids": ..., "labels": ...}``, and the
loss is GPT-2's own ``out.loss``. Some sequences are padded (labels -100), so
micro-batches hold different numbers of tokens; for a token-weighted loss
GPT-2 is asked for the *sum* over tokens (``num_items_in_batch=1``) and
pipesched divides by the batch's token count (``num_items=``). The sequences
follow a fixed rule (next token = 3 x token + 1 mod 64, with 5% noise).
``pipe.eval()`` turns dropout off for the accuracy on a fresh batch (eval mode
gets a cut of its own), and ``pipe(**batch)`` returns GPT-2's own output
type, logits and all.
"""

from __future__ import annotations

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

from pipesched import GradientAccumulator, Pipeline, init_mesh

VOCAB, LENGTH, BATCH, CHUNKS, STEPS = 64, 32, 16, 4, 40


def batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sequences of the rule x -> 3x + 1 (mod VOCAB) with noise; every other one padded."""
    x = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    tokens = [x]
    for _ in range(LENGTH - 1):
        x = (3 * x + 1) % VOCAB
        noise = torch.rand(x.shape, generator=generator) < 0.05
        x = torch.where(noise, torch.randint(0, VOCAB, x.shape, generator=generator), x)
        tokens.append(x)
    ids = torch.cat(tokens, dim=1)
    labels = ids.clone()
    labels[::2, LENGTH // 2 :] = -100  # padding: not predicted, not counted
    return {"input_ids": ids, "labels": labels}


def tokens_of(data: dict[str, torch.Tensor]) -> int:
    """The batch's predicted tokens: GPT-2 predicts token t + 1 from t, padding excluded."""
    return int((data["labels"][:, 1:] != -100).sum())


def new_model() -> GPT2LMHeadModel:
    """A 4-block GPT-2 with tied embeddings and its default dropout."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=4, n_head=4)
    return GPT2LMHeadModel(config)


def main() -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = new_model()
    if "RANK" in os.environ:  # under torchrun: one stage per rank
        pipe = Pipeline(model, chunks=CHUNKS, mesh=init_mesh(pp=2), schedule="1f1b")
    else:
        pipe = Pipeline(model, chunks=CHUNKS, devices=["cpu", "cpu"], schedule="1f1b")
    first = pipe.mesh is None or pipe.mesh.pp_rank == 0
    say = print if first else (lambda *args, **kwargs: None)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)  # before the first step
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=1)
    for step in range(1, STEPS + 1):
        data = batch(generator)
        result = acc.step(
            {**data, "num_items_in_batch": 1},  # GPT-2 returns its summed token loss
            loss_fn=lambda out: out.loss,
            num_items=tokens_of(data),  # pipesched divides the batch's sum by its token count
        )
        if step == 1:
            say(pipe.partition, end="\n\n")  # cut at the first step
            tied = model.lm_head.weight is model.transformer.wte.weight
            say(f"lm_head.weight is transformer.wte.weight: {tied} (stages 0 and 1)\n")
        if step % 5 == 0 or step == 1:
            timeline = pipe.gather_timeline()  # every rank's actions (a collective), on rank 0
            if timeline is not None:
                print(f"step {step:3d}  loss {result.loss:.3f}  ({timeline.summary()})")
    data = batch(generator)
    pipe.eval()  # dropout off, attention dropout included
    with torch.no_grad():  # called as in training (another kind of call would trace again)
        out = pipe(**data, num_items_in_batch=1)  # under torchrun: on the last stage's rank
    if out is not None:
        predicted = out.logits[:, :-1].argmax(-1)
        accuracy = (predicted == data["input_ids"][:, 1:]).float().mean().item()
        print(f"\n{type(out).__name__}: next-token accuracy on a fresh batch {accuracy:.2f}")
        print("(the rule alone gives 0.95)")


if __name__ == "__main__":
    main()
