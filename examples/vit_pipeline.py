"""A Hugging Face ViT, traced and cut into 2 CPU stages automatically, trained on synthetic images.

Run: .venv/bin/python examples/vit_pipeline.py
     (needs transformers: .venv/bin/pip install transformers; nothing is downloaded)

``ViTForImageClassification`` from a small config (32x32 images, 8x8
patches, 4 encoder layers) is not an ``nn.Sequential``: ``Pipeline`` traces
it with torch.export on one example micro-batch, builds its stage graph
(``pipe.stage_graph``, a networkx DiGraph of the traced operations with
their measured costs), and cuts it where the simulated 1F1B step is
shortest (``balance="schedule"``); the table of the cut is printed. The
images are noise plus one of 10 fixed patterns, the pattern being the
label. The model returns an ``ImageClassifierOutput``, so the loss takes
``out["logits"]``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import ViTConfig, ViTForImageClassification
from transformers.utils import logging

from pipesched import Pipeline
from pipesched.partition import layer_graph

CLASSES, BATCH, CHUNKS, STEPS = 10, 32, 4, 30


def batch(patterns: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    noise = torch.randn(BATCH, 3, 32, 32, generator=generator)
    return patterns[labels] + noise, labels


def loss_fn(out: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out["logits"], labels)


def main() -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randn(CLASSES, 3, 32, 32, generator=generator)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=CLASSES,
    )
    model = ViTForImageClassification(config)
    images, _ = batch(patterns, generator)
    pipe = Pipeline(
        model,
        chunks=CHUNKS,
        example_inputs=(images[: BATCH // CHUNKS],),  # one micro-batch
        num_stages=2,
        devices=["cpu", "cpu"],
        schedule="1f1b",
        balance="schedule",
    )
    print(pipe.partition, end="\n\n")
    graph = pipe.stage_graph
    layers = layer_graph(graph).number_of_nodes() - 2  # without the input and output nodes
    print(
        f"stage graph: {graph.number_of_nodes() - 2} traced operations in {layers} layers, "
        f"{graph.number_of_edges()} edges\n"
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=2e-3)
    for step in range(1, STEPS + 1):
        images, labels = batch(patterns, generator)
        loss = pipe.step(images, labels, loss_fn=loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({pipe.last_timeline.summary()})")
    images, labels = batch(patterns, generator)
    pipe.eval()
    with torch.no_grad():
        accuracy = (pipe(images)["logits"].argmax(-1) == labels).float().mean().item()
    print(f"\naccuracy on a fresh batch: {accuracy:.2f}")


if __name__ == "__main__":
    main()
