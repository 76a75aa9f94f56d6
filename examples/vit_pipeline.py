"""A Hugging Face ViT, pipelined with one line and called as ViT is, trained on synthetic images.

Run: .venv/bin/python examples/vit_pipeline.py
     (needs transformers: .venv/bin/pip install transformers; nothing is downloaded)

``Pipeline(model, chunks=4, devices=["cpu", "cpu"])`` wraps
``ViTForImageClassification`` from a small config (32x32 images, 8x8 patches,
4 encoder layers) as it is. The first step traces it with torch.export on that
step's first micro-batch, builds its stage graph (``pipe.stage_graph``, a
networkx DiGraph of the traced operations with their measured costs) and cuts
it where both stages take the same time; the table of the cut is printed. The
batch is what ViT takes, ``{"pixel_values": ..., "labels": ...}``, and the
loss is ViT's own ``out.loss``. The images are noise plus one of 10 fixed
patterns, the pattern being the label.
"""

from __future__ import annotations

import torch
from transformers import ViTConfig, ViTForImageClassification
from transformers.utils import logging

from pipesched import Pipeline
from pipesched.partition import layer_graph

CLASSES, BATCH, CHUNKS, STEPS = 10, 32, 4, 30


def batch(patterns: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    noise = torch.randn(BATCH, 3, 32, 32, generator=generator)
    return {"pixel_values": patterns[labels] + noise, "labels": labels}


def new_model() -> ViTForImageClassification:
    """A small ViT: 32x32 images, 8x8 patches, 4 encoder layers."""
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=CLASSES,
    )
    return ViTForImageClassification(config)


def main() -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randn(CLASSES, 3, 32, 32, generator=generator)
    pipe = Pipeline(new_model(), chunks=CHUNKS, devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=2e-3)
    for step in range(1, STEPS + 1):
        loss = pipe.step(batch(patterns, generator), loss_fn=lambda out: out.loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:  # cut at the first step
            print(pipe.partition, end="\n\n")
            graph = pipe.stage_graph
            layers = layer_graph(graph).number_of_nodes() - 2  # without input and output
            print(
                f"stage graph: {graph.number_of_nodes() - 2} traced operations in {layers} "
                f"layers, {graph.number_of_edges()} edges\n"
            )
        if step % 5 == 0 or step == 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({pipe.last_timeline.summary()})")
    data = batch(patterns, generator)
    pipe.eval()
    with torch.no_grad():
        out = pipe(**data)  # ViT's own ImageClassifierOutput, loss included
    accuracy = (out.logits.argmax(-1) == data["labels"]).float().mean().item()
    print(f"\n{type(out).__name__}: loss {out.loss:.3f}, accuracy on a fresh batch {accuracy:.2f}")


if __name__ == "__main__":
    main()
