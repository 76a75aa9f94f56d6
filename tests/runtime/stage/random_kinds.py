"""Modules that draw random numbers in every way users' models do: one per kind, (N, 8) -> (N, 8).

Shared by tests/runtime/stage/test_rng.py (one process) and tests/distributed/random_worker.py
(a mesh).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Functional(nn.Module):
    """``F.dropout`` in a custom module's forward."""

    def forward(self, x):
        return F.dropout(x, 0.5, self.training)


class Attention(nn.Module):
    """``nn.MultiheadAttention``'s attention dropout (two tokens of width 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        t = x.reshape(-1, 2, 4)
        return self.attn(t, t, t, need_weights=False)[0].reshape(-1, 8)


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention(dropout_p=...)``."""

    def forward(self, x):
        t = x.reshape(-1, 2, 2, 2)  # batch, heads, tokens, width
        p = 0.5 if self.training else 0.0
        return F.scaled_dot_product_attention(t, t, t, dropout_p=p).reshape(-1, 8)


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer(dropout=0.3)``: dropout modules and attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.3, batch_first=True)

    def forward(self, x):
        return self.layer(x.reshape(-1, 2, 4)).reshape(-1, 8)


class RandLikeMask(nn.Module):
    """A ``torch.rand_like`` mask."""

    def forward(self, x):
        return x * (torch.rand_like(x) > 0.4) / 0.6


class DropPath(nn.Module):
    """timm's stochastic depth: a per-sample ``bernoulli_`` keep mask on a residual branch."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 8)

    def forward(self, x):
        keep = x.new_empty(x.shape[0], 1).bernoulli_(0.6)
        return x + self.branch(x) * keep / 0.6


class Bernoulli(nn.Module):
    """``torch.bernoulli`` of input-dependent probabilities."""

    def forward(self, x):
        return x * torch.bernoulli(torch.sigmoid(x.detach()))


class GaussianNoise(nn.Module):
    """Additive ``torch.randn_like`` noise."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


class NormalInPlace(nn.Module):
    """Multiplicative noise from ``normal_``, twice in one forward (two draws, one module)."""

    def forward(self, x):
        a = torch.empty_like(x).normal_(1.0, 0.2)
        b = torch.empty_like(x).normal_(1.0, 0.2)
        return x * a * b


class Multinomial(nn.Module):
    """Columns sampled by ``torch.multinomial``."""

    def forward(self, x):
        index = torch.multinomial(torch.ones(8), 8, replacement=True)
        return x[:, index]


class Permute(nn.Module):
    """Columns shuffled by ``torch.randperm``."""

    def forward(self, x):
        return x[:, torch.randperm(8)]


class Uniform(nn.Module):
    """``uniform_`` noise made on the fly."""

    def forward(self, x):
        return x * x.new_empty(x.shape).uniform_(0.5, 1.5)


KINDS: dict[str, type[nn.Module] | object] = {
    "Dropout": lambda: nn.Dropout(0.5),
    "F.dropout": Functional,
    "AlphaDropout": lambda: nn.AlphaDropout(0.3),
    "RReLU": nn.RReLU,
    "MultiheadAttention": Attention,
    "SDPA dropout": SDPA,
    "TransformerEncoderLayer": Encoder,
    "rand_like mask": RandLikeMask,
    "drop-path bernoulli_": DropPath,
    "bernoulli": Bernoulli,
    "randn_like noise": GaussianNoise,
    "normal_ twice": NormalInPlace,
    "multinomial": Multinomial,
    "randperm": Permute,
    "uniform_": Uniform,
}
"""Name -> a callable building one random module of that kind."""


def model_of(kind: str) -> nn.Sequential:
    """Linear, random, Linear, random, Linear (5 layers), the same weights for a given kind."""
    make = KINDS[kind]
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        make(),  # type: ignore[operator]
        nn.Linear(8, 8),
        make(),  # type: ignore[operator]
        nn.Linear(8, 8),
    )
