"""One rank of a meta-device test: `python meta_worker.py SCENARIO OUT_DIR` under torchrun-like env.

Scenarios: ``seq`` and ``gpt`` train a model built on the meta device and the
same model built normally (initialized by ``pipesched.initialize`` with the
same function), and save both runs; ``rss`` measures this rank's resident
memory growth while a Pipeline of a large meta model is built, then of the
same model built normally.
"""

from __future__ import annotations

import gc
import math
import os
import sys

import torch
from torch import nn

import pipesched
from pipesched.runtime.mesh import init_mesh

PP = 2
CHUNKS = 4
STEPS = 2
VOCAB, WIDTH, CONTEXT = 13, 16, 8


def mlp() -> nn.Sequential:
    """A small fp64 MLP; every layer has reset_parameters."""
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)
    ).double()


class Attention(nn.Module):
    """Causal self-attention; its mask is a non-persistent buffer computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", causal_mask(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(WIDTH)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        return self.proj(scores.softmax(-1) @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln2, self.fc, self.out = (
            nn.LayerNorm(WIDTH),
            nn.Linear(WIDTH, 4 * WIDTH),
            nn.Linear(4 * WIDTH, WIDTH),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-style language model (not an nn.Sequential: traced), head tied to the embedding."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def causal_mask() -> torch.Tensor:
    return torch.tril(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool))


def gpt_init(name: str, module: nn.Module) -> None:
    """GPT-2's initialization, and the attention mask computed again (it is not a parameter)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, Attention):
        module.mask.copy_(causal_mask())


def build(scenario: str, meta: bool) -> nn.Module:
    """The scenario's model: on the meta device, or built normally and initialized as on meta."""
    torch.manual_seed(0)
    make = {"seq": mlp, "gpt": lambda: GPT().double()}[scenario]
    if meta:
        with torch.device("meta"):
            return make()
    return pipesched.initialize(make(), gpt_init if scenario == "gpt" else None)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randn(
        10, 3, generator=g, dtype=torch.float64
    )


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (8, CONTEXT), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train(scenario: str, meta: bool, **where: object) -> tuple[list[float], dict, object]:
    """Builds the pipeline, runs STEPS SGD steps; returns losses, this process's parameters."""
    model = build(scenario, meta)
    gpt = scenario == "gpt"
    extra: dict[str, object] = {"example_inputs": (tokens(0)[0][:2],)} if gpt else {}
    pipe = pipesched.Pipeline(
        model,
        CHUNKS,
        schedule="1f1b",
        init_weights=gpt_init if gpt else None,
        **extra,
        **where,  # type: ignore[arg-type]
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = tokens(step) if gpt else batch(step)
        loss = pipe.step(x, y, loss_fn=token_loss if gpt else nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    params = {n: p.detach().clone() for n, p in pipe.named_parameters() if not p.is_meta}
    return losses, params, pipe


FIELD = "RssAnon:"
"""Anonymous resident memory (VmRSS less the pages of shared libraries and files)."""


def rss() -> int:
    """This process's resident anonymous memory now, in bytes (RssAnon of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(FIELD):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def big_mlp(width: int = 2048, layers: int = 10) -> nn.Sequential:
    """About ``layers * width**2 * 4`` bytes of fp32 parameters (168 MB by default)."""
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def measure_rss(mesh: object) -> dict[str, float]:
    """Construction growth of this rank's RSS: meta build first, then the whole-model build.

    A small meta model is built first: what any first Pipeline costs (code and
    caches torch and gloo initialize on first use, about 30 MiB) is not the model's.
    """
    with torch.device("meta"):
        pipesched.Pipeline(big_mlp(64, 4), CHUNKS, mesh=mesh)
        model = big_mlp()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = rss()
    pipe = pipesched.Pipeline(model, CHUNKS, mesh=mesh)
    meta_growth = rss() - before
    own = sum(p.numel() * p.element_size() for p in pipe.parameters() if not p.is_meta)
    before = rss()
    whole = big_mlp()
    normal_built = rss() - before  # every rank holds the whole model until the Pipeline frees it
    normal = pipesched.Pipeline(whole, CHUNKS, mesh=mesh)
    normal_growth = rss() - before
    del normal, whole
    return {
        "param_bytes": param_bytes,
        "own_bytes": own,
        "meta_growth": meta_growth,
        "normal_built": normal_built,
        "normal_growth": normal_growth,
    }


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    mesh = init_mesh(pp=PP, timeout=30)
    run(scenario, out, mesh)  # its pipelines are freed when it returns
    # Collected before the group goes: a gloo work freed at exit aborts the process
    # ("terminate called without an active exception", pytorch/pytorch#190489).
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run(scenario: str, out: str, mesh: object) -> None:
    """Runs ``scenario`` on this rank and writes its result under ``out``."""
    rank = torch.distributed.get_rank()
    if scenario == "rss":
        result: dict[str, object] = measure_rss(mesh)
    else:
        meta_losses, meta_params, pipe = train(scenario, True, mesh=mesh)
        normal_losses, normal_params, _ = train(scenario, False, mesh=mesh)
        result = {
            "meta": (meta_losses, meta_params),
            "normal": (normal_losses, normal_params),
            "balance": pipe.balance,
            "estimated": pipe.partition.estimated,
            "table": str(pipe.partition),
        }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
