"""Small models for the partition tests: a U-Net-like CNN with long skips, GPT-2 and ViT configs."""

from __future__ import annotations

import torch
from torch import nn


class Down(nn.Module):
    """Halves the resolution, doubles the channels."""

    def __init__(self, cin: int, cout: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.norm = _norm(norm, cout)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.conv(x))))


class Up(nn.Module):
    """Doubles the resolution and joins the skip tensor of the same level."""

    def __init__(self, cin: int, cout: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = nn.Conv2d(2 * cout, cout, 3, padding=1)
        self.norm = _norm(norm, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.up(x), skip], dim=1)
        return torch.relu(self.norm(self.conv(x)))


class UNet(nn.Module):
    """A U-Net: every encoder level's output skips to the decoder level of its size.

    With 4 stages the outermost skip (``stem`` to ``up.2``) crosses every cut.
    """

    def __init__(self, channels: int = 4, depth: int = 3, norm: type[nn.Module] = nn.GroupNorm):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        widths = [channels * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(Down(widths[i], widths[i + 1], norm) for i in range(depth))
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i], norm) for i in reversed(range(depth)))
        self.head = nn.Conv2d(channels, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(x)
        for up in self.up:
            x = up(x, skips.pop())
        return self.head(x)


def _norm(kind: type[nn.Module], channels: int) -> nn.Module:
    return nn.GroupNorm(2, channels) if kind is nn.GroupNorm else kind(channels)


class GPT2Logits(nn.Module):
    """GPT2LMHeadModel without its cache: token ids in, logits out."""

    def __init__(self, dropout: float = 0.0, layers: int = 2) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_embd=32,
            n_layer=layers,
            n_head=2,
            vocab_size=100,
            n_positions=64,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=ids, use_cache=False).logits


def vit(layers: int = 2) -> nn.Module:
    """A ViTForImageClassification of 32x32 images, 8x8 patches, 10 classes, no dropout."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        num_labels=10,
    )
    return ViTForImageClassification(config)
