"""Fused weight-gradient accumulation (the default) against ``fuse_weight_grads=False``.

Run: .venv/bin/python benchmarks/fusion.py [--seconds 30] [--widths 64 256 1024]
                                           [--models mlp transformer gpt2] [--sweep]

Per model and width, the same model's ``Pipeline.step`` time (2 CPU stages,
1F1B, checkpoint="never", 4 micro-batches of 32 rows) with the default
``fuse_weight_grads=True`` and with ``False``, alternated step by step
(ABBA) so that machine noise hits both alike, for about ``--seconds`` a row
(at least ``--rounds`` steps each); the median step times are printed, and
"fused" says how many of the model's weights the default step fuses. Target
(pipesched issue 14): default <= 1.02x unfused at every width, and ahead
wherever it fuses (width 1024).

- mlp: 8 x (Linear(w, w) + ReLU), nn.Sequential, batch 128.
- transformer: 4 x nn.TransformerEncoderLayer(w, w // 64 heads, 4w feed-forward,
  no dropout, batch_first), nn.Sequential, 8 sequences of 16 tokens.
- gpt2: Hugging Face GPT2LMHeadModel (4 blocks, n_embd w, vocabulary 512, tied
  embedding and head) returning logits, traced (``example_inputs=``,
  ``num_stages=2``), 8 sequences of 16 tokens; skipped without transformers.

``--sweep`` first prints, for one Linear(w, w) and 32 rows, the fused path's
forward + backward (4 micro-batches accumulating into ``.grad``) against
autograd's, in this thread's CPU time: where the fused path starts to gain is
what :data:`pipesched.runtime.fused_linear.MIN_FUSED_BYTES` was chosen from.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.fused_linear import (
    MIN_FUSED_BYTES,
    FusedLinearMode,
    _FusedLinear,
    unshared_parameters,
    worth_fusing,
)

CHUNKS, ROWS, SEQUENCE = 4, 32, 16
"""Micro-batches per step, rows per micro-batch (sequence models: 2 sequences of 16 tokens)."""


def mlp(width: int) -> tuple[nn.Module, torch.Tensor, dict[str, object]]:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(CHUNKS * ROWS, width), {"balance": [8, 8]}


def transformer(width: int) -> tuple[nn.Module, torch.Tensor, dict[str, object]]:
    layers = [
        nn.TransformerEncoderLayer(
            width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True
        )
        for _ in range(4)
    ]
    x = torch.randn(CHUNKS * ROWS // SEQUENCE, SEQUENCE, width)
    return nn.Sequential(*layers), x, {"balance": [2, 2]}


def gpt2(width: int) -> tuple[nn.Module, torch.Tensor, dict[str, object]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=512,
        n_positions=SEQUENCE,
        n_embd=width,
        n_layer=4,
        n_head=max(1, width // 64),
        bos_token_id=0,
        eos_token_id=0,
    )

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gpt2(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, 512, (CHUNKS * ROWS // SEQUENCE, SEQUENCE))
    return Logits(), ids, {"example_inputs": (ids[: ROWS // SEQUENCE],), "num_stages": 2}


MODELS = {"mlp": mlp, "transformer": transformer, "gpt2": gpt2}


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:  # next-token labels
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())
    return nn.functional.mse_loss(out, target)


def pipeline_step(name: str, width: int, fuse: bool) -> tuple[Callable[[], None], str]:
    """A function running one step of the model's pipeline, and how many weights fuse."""
    torch.manual_seed(0)
    model, x, how = MODELS[name](width)
    pipe = Pipeline(
        model,
        CHUNKS,
        devices=["cpu", "cpu"],
        schedule="1f1b",
        checkpoint="never",
        fuse_weight_grads=fuse,
        **how,  # type: ignore[arg-type]
    )
    target = torch.randint_like(x, 512) if name == "gpt2" else torch.randn_like(x)

    def run() -> None:
        pipe.step(x, target, loss_fn=loss_fn)
        pipe.zero_grad(set_to_none=True)

    fused = fused_weights(run)  # also the first step, a warm-up
    weights = sum(p.dim() == 2 for p in model.parameters())
    return run, f"{fused}/{weights}"


def fused_weights(run: Callable[[], None]) -> int:
    """How many distinct weights ``run`` accumulates through the fused path."""
    seen: set[int] = set()
    original = _FusedLinear.forward

    def recording(ctx: Any, x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.add(id(weight))
        return original(ctx, x, weight, *args)

    _FusedLinear.forward = staticmethod(recording)  # type: ignore[method-assign]
    try:
        run()
    finally:
        _FusedLinear.forward = staticmethod(original)  # type: ignore[method-assign]
    return len(seen)


def compare(name: str, width: int, seconds: float, least: int) -> None:
    """Prints one row: default vs unfused step time, medians of alternating steps."""
    default, fused = pipeline_step(name, width, True)
    unfused, _ = pipeline_step(name, width, False)
    runs = {"default": default, "unfused": unfused}
    times: dict[str, list[float]] = {"default": [], "unfused": []}
    for run in runs.values():  # warm-up
        run()
    start = time.perf_counter()
    for run in runs.values():  # how long a pair of steps takes
        run()
    rounds = max(least, int(seconds / (time.perf_counter() - start)))
    for r in range(rounds):
        for key in ("default", "unfused") if r % 2 == 0 else ("unfused", "default"):
            start = time.perf_counter()
            runs[key]()
            times[key].append(time.perf_counter() - start)
    d, u = statistics.median(times["default"]), statistics.median(times["unfused"])
    verdict = "ok" if d <= 1.02 * u else "MISSED"
    if not fused.startswith("0/"):  # where it fuses, it should gain
        verdict += ", ahead" if d < u else ", not ahead"
    ms = f"{1000 * d:>13.1f}{1000 * u:>13.1f}"
    print(f"{name:<12}{width:>6}{fused:>9}{rounds:>8}{ms}{d / u:>9.3f}  {verdict}", flush=True)


def sweep(rounds: int) -> None:
    """One Linear(w, w), 32 rows, 4 micro-batches: fused path vs autograd, thread CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"one Linear(w, w), {CHUNKS} micro-batches of {ROWS} rows, fp32, 1 thread, us per call")
    print(f"{'w':>6}{'MiB':>7}{'fused':>10}{'autograd':>10}{'gain':>8}  fused by default")
    for width in (128, 256, 384, 512, 640, 768, 1024, 1536):
        layer = nn.Linear(width, width)
        x, g = torch.randn(ROWS, width), torch.randn(ROWS, width)
        allowed = unshared_parameters([layer])[0]

        def step(
            fuse: bool,
            layer: nn.Module = layer,
            x: torch.Tensor = x,
            g: torch.Tensor = g,
            allowed: frozenset[int] = allowed,
        ) -> None:
            for _ in range(CHUNKS):
                xi = x.detach().requires_grad_()
                if fuse:
                    with FusedLinearMode(allowed):
                        out = layer(xi)
                else:
                    out = layer(xi)
                out.backward(g)
            layer.zero_grad(set_to_none=True)

        reps = max(3, int(4e8 // (width * width * ROWS * CHUNKS * 6)))
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for fuse in (True, False) if r % 2 == 0 else (False, True):
                start = time.thread_time()
                for _ in range(reps):
                    step(fuse)
                times[fuse].append((time.thread_time() - start) / reps / CHUNKS)
        f, a = statistics.median(times[True]), statistics.median(times[False])
        worth = bool(worth_fusing([layer], [allowed])[0])
        mib = width * width * 4 / 2**20
        print(
            f"{width:>6}{mib:>7.2f}{1e6 * f:>10.1f}{1e6 * a:>10.1f}{1e6 * (a - f):>8.1f}  {worth}"
        )
    torch.set_num_threads(threads)
    print(f"MIN_FUSED_BYTES = {MIN_FUSED_BYTES} ({MIN_FUSED_BYTES / 2**20:g} MiB)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30, help="per row, about")
    parser.add_argument("--rounds", type=int, default=7, help="per row at least")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sweep", action="store_true", help="first the one-layer break-even")
    args = parser.parse_args()
    if args.sweep:
        sweep(args.rounds)
    try:
        import transformers  # noqa: F401
    except ImportError:
        args.models = [m for m in args.models if m != "gpt2"]
    print(
        f"Pipeline.step, 2 CPU stages, 1f1b, {CHUNKS} micro-batches of {ROWS} rows; medians of "
        f"alternating steps, about {args.seconds:g} s a row (a shared machine: noisy)"
    )
    print(
        f"{'model':<12}{'width':>6}{'fused':>9}{'rounds':>8}{'default ms':>13}{'unfused ms':>13}"
        f"{'ratio':>10}  <= 1.02x"
    )
    for name in args.models:
        for width in args.widths:
            compare(name, width, args.seconds, args.rounds)


if __name__ == "__main__":
    main()
