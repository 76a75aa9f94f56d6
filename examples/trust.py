"""What you can trust: dropout that repeats exactly, and a step that fails changing nothing.

Run: .venv/bin/python examples/trust.py

A Transformer encoder with dropout 0.1 everywhere (nn.TransformerEncoderLayer:
dropout modules and attention dropout) and a drop-path (a per-sample
bernoulli_ mask) is cut into 2 CPU stages. It shows, printing each check:

1. The same torch.manual_seed gives the same losses, bitwise, whether the
   stages recompute their forward in backward or not (checkpoint modes), and
   on a second run: every random draw is a function of (step seed,
   micro-batch, place in the model), not of thread timing.
2. A stage that raises half-way through a step (a flaky data problem,
   simulated) leaves the gradients and the accumulation window exactly as
   before it: retrying the same batch gives the parameters of a run that
   never failed.
"""

from __future__ import annotations

import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline

WIDTH, TOKENS, BATCH, CHUNKS, STEPS = 32, 8, 16, 4, 6


class DropPath(nn.Module):
    """Stochastic depth around a block (timm's drop_path): a sample's branch is dropped whole."""

    def __init__(self, block: nn.Module, p: float) -> None:
        super().__init__()
        self.block, self.p = block, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x + self.block(x)
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - self.p)
        return x + self.block(x) * keep / (1 - self.p)


class Flaky(nn.Module):
    """Raises once, on the call given, as a flaky input pipeline or device might."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            self.fail_at = None
            raise RuntimeError("transient failure in stage 1")
        return x


def model(flaky: Flaky) -> nn.Sequential:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.1, batch_first=True)  # noqa: E731
    return nn.Sequential(
        layer(),
        DropPath(nn.Linear(WIDTH, WIDTH), 0.2),
        layer(),
        flaky,
        layer(),
        nn.Linear(WIDTH, 1),
    )


def train(checkpoint: str, fail_at: int | None = None) -> tuple[list[float], torch.Tensor]:
    flaky = Flaky()
    pipe = Pipeline(
        model(flaky),
        CHUNKS,
        balance=[2, 4],
        devices=["cpu", "cpu"],
        schedule="1f1b",
        checkpoint=checkpoint,
    )
    acc = GradientAccumulator(
        pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3), accumulation_steps=2
    )
    torch.manual_seed(1)
    losses = []
    for step in range(STEPS):
        x, y = torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, 1)
        if step == 3 and fail_at is not None:
            flaky.calls, flaky.fail_at = 0, fail_at
        try:
            result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
        except RuntimeError as error:
            print(f"  step {step}: {error}; retrying the same batch")
            result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
        losses.append(result.loss)
    return losses, torch.cat([p.detach().flatten() for p in pipe.parameters()])


def main() -> None:
    runs = {mode: train(mode) for mode in ("never", "except_last", "always")}
    again, _ = train("always")
    reference, params = runs["never"]
    print("losses (checkpoint='never'):", " ".join(f"{v:.5f}" for v in reference))
    for mode, (losses, _) in runs.items():
        print(f"1. checkpoint={mode!r:14} losses bitwise equal to 'never': {losses == reference}")
    print(f"1. a second run, same seed:          losses bitwise equal: {again == reference}")
    _, retried = train("never", fail_at=3)
    print(
        f"2. a failed step retried: parameters bitwise equal to a clean run: "
        f"{torch.equal(retried, params)}"
    )


if __name__ == "__main__":
    main()
