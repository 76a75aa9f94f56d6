"""Token-level language-model training with accumulation windows over uneven, padded sequences.

Run: .venv/bin/python examples/accumulate_tokens.py

A tiny next-token model (embedding + MLP over a window of 4 previous tokens)
is cut into 2 CPU stages and trained with the zero-bubble ZB-H1 schedule.
Sequences have random lengths, padded with label -100, so micro-batches and
steps hold very different token counts. The loss is a SUM over tokens and
`num_items` counts the real ones; GradientAccumulator divides once per
window by the window's token count, which equals one big batch's token mean
(the `loss / accumulation_steps` recipe would not). Prints the one-line log
per window.
"""

from __future__ import annotations

import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline

VOCAB, CONTEXT, WIDTH = 32, 4, 128
BATCH, MAX_LEN, CHUNKS, WINDOW, WINDOWS = 16, 24, 4, 4, 10


class Context(nn.Module):
    """(batch, length) token ids -> (batch, length, CONTEXT * WIDTH): each position sees
    the embeddings of itself and the 3 tokens before it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, WIDTH)  # VOCAB is the padding id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padded = nn.functional.pad(tokens, (CONTEXT - 1, 0), value=VOCAB)
        windows = padded.unfold(1, CONTEXT, 1)  # (batch, length, CONTEXT)
        return self.embed(windows).flatten(2)


def model() -> nn.Sequential:
    return nn.Sequential(
        Context(),
        nn.Linear(CONTEXT * WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, VOCAB),
    )


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequences from a fixed rule (next = 3 * current + 1 mod VOCAB, with noise),
    of random lengths, right-padded; labels are -100 on padding."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    steps = torch.arange(MAX_LEN + 1)
    sequences = (start * 3**steps + (3**steps - 1) // 2) % VOCAB
    noise = torch.rand(sequences.shape, generator=generator) < 0.05
    sequences[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=generator)
    lengths = torch.randint(2, MAX_LEN + 1, (BATCH,), generator=generator)
    tokens, labels = sequences[:, :-1].clone(), sequences[:, 1:].clone()
    pad = steps[:-1] >= lengths[:, None]
    tokens[pad], labels[pad] = VOCAB, -100
    return tokens, labels, int((~pad).sum())


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def main() -> None:
    torch.manual_seed(0)
    pipe = Pipeline(model(), CHUNKS, balance=[3, 3], devices=["cpu", "cpu"], schedule="zb-h1")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    accumulator = GradientAccumulator(pipe, optimizer, accumulation_steps=WINDOW, max_grad_norm=1.0)
    generator = torch.Generator().manual_seed(1)
    tokens_seen = 0
    for _ in range(WINDOWS * WINDOW):
        tokens, labels, count = batch(generator)
        tokens_seen += count
        result = accumulator.step(tokens, labels, loss_fn=token_sum, num_items=count)
        if result.stepped:
            print(
                f"{accumulator.log_line(result)} | {tokens_seen} tokens "
                f"| grad norm {result.grad_norm:.3g}"
            )
            tokens_seen = 0


if __name__ == "__main__":
    main()
