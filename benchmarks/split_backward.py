"""What splitting a stage's backward into B and W costs, on the blocks users run.

Run: .venv/bin/python benchmarks/split_backward.py [--rounds 9] [--only NAME] [--keep-heap]
[--glibc-defaults]

One intra-op thread. Each model is one middle stage (its input a fresh leaf that
requires grad, its output given a random gradient), run as pipesched's runtime
runs it:

- whole: the forward as a 1f1b step runs it, then ``backward_full``.
- B, W: the forward with its layers deferring (``deferral``, as a zero-bubble
  step runs it), then ``backward_input`` (B) and, after it,
  ``WeightGradients.run`` (W).
- mode: B + W with the forward run under ``DeferredWeightsMode`` as a whole (the
  way before layers deferred; traced stages still run so), over the whole backward.
- checkpoint="always": one forward plus the whole backward, against B (which
  recomputes the forward once) plus W, the forward run under pipesched's
  checkpoint (not timed: both rows run it).
- /ckpt: B + W with checkpointing over the checkpointed whole backward (what
  1F1B pays for a checkpointed micro-batch: torch's checkpoint costs more than
  one forward by itself).
- forward: the plain forward, the forward with its layers deferring (F layers)
  and under the mode (F mode): what deferral costs the forward. ``--overhead``
  prints only that, on the same stages at width 16 (2 x 4 tokens), where the
  forward is nearly all Python: what two stage threads serialize on the GIL.
- graph: B + W as pipesched split the backward before the mode (a graph analysis
  per B, one autograd call per weight group in W; ``backward_input`` without a
  store), over the whole backward.

Times are this thread's CPU time (``--clock wall`` for wall time): on a shared
machine a pass descheduled for another process's turn is not charged for it
(its page faults are). Contenders alternate within each round (in reverse
order every other round); medians over the rounds, the ratios as medians of
the per-round ratios, and the ratios of the bests (the least disturbed rounds
on a shared machine). Target: B + W <= 1.05 x whole, and with checkpointing
B + W <= 1.05 x (forward + whole); PASS/FAIL per row (on the median ratios).

Under each row, the minor page faults per pass (medians): B holds each deferred
op's input and output gradient until W, so its heap grows past the forward's,
and with glibc's thresholds as they start glibc gives what W frees back to the
system (trims the heap), so the next B faults those pages in again. As a
pipeline with a CPU worker does when built, the benchmark first raises glibc's
adaptive thresholds (:mod:`pipesched.runtime.heap`); ``--glibc-defaults`` does
not: what the rows cost with those faults. ``--keep-heap`` instead sets glibc's
trim threshold to 1 GiB and its mmap threshold to 32 MiB (``mallopt``; the
environment variables ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``
do the same).

Models (width 256, micro-batch 8 x 64 tokens; the MLP: 512 rows of 1024):
4 x nn.TransformerEncoderLayer(256, 4, 1024, dropout=0, batch_first=True);
4 HF GPT-2 blocks from a GPT2Config (n_embd 256, 4 heads, dropout 0, eager attention);
4 timm-style ViT blocks written here (LayerNorm, qkv Linear, proj, MLP, drop-path 0.1);
4 x (Linear(1024, 1024) + ReLU).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipesched.runtime.backward import backward_full, backward_input
from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore
from pipesched.runtime.deferred_layers import Deferral, deferral
from pipesched.runtime.heap import keep_freed_memory
from pipesched.runtime.stage.recompute import checkpoint

LIMIT = 1.05


class DropPath(nn.Module):
    """timm's drop_path: a whole sample's residual branch dropped with probability ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x.div(keep) * mask


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class VitBlock(nn.Module):
    """timm's ``Block``: pre-norm attention and MLP, each residual branch drop-pathed."""

    def __init__(self, dim: int, heads: int, drop_path: float = 0.1) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class Gpt2Blocks(nn.Module):
    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = GPT2Config(
            n_embd=width, n_head=4, n_layer=n, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        config._attn_implementation = "eager"
        self.blocks = nn.ModuleList(GPT2Block(config, layer_idx=k) for k in range(n))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            out = block(x)
            x = out[0] if isinstance(out, tuple) else out
        return x


def models(width: int = 256) -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    """The four stages (the MLP 4x as wide), at ``width`` (``--overhead``: 16, on 2 x 4 tokens)."""
    rows = (8, 64) if width == 256 else (2, 4)

    def encoder() -> nn.Module:
        return nn.Sequential(
            *(
                nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0, batch_first=True)
                for _ in range(4)
            )
        )

    def mlp() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(4 * width, 4 * width), nn.ReLU()]
        return nn.Sequential(*layers)

    return {
        f"TransformerEncoderLayer({width}) x4": (encoder, (*rows, width)),
        f"GPT-2 block ({width}) x4": (lambda: Gpt2Blocks(4, width), (*rows, width)),
        f"ViT block ({width}) x4": (
            lambda: nn.Sequential(*(VitBlock(width, 4) for _ in range(4))),
            (*rows, width),
        ),
        f"Linear({4 * width})+ReLU x4": (mlp, (rows[0] * rows[1], 4 * width)),
    }


def overhead(rounds: int) -> None:
    """What deferral adds to a forward where compute is nearly nothing (width 16, 8 tokens):
    the Python a split backward's forward runs, which two stage threads serialize on."""
    print(
        f"forward overhead, width 16, 2 x 4 tokens: medians of {rounds} rounds (us, {CLOCK_NAME})"
    )
    print(f"{'model':34} {'plain':>7} {'layers':>7} {'mode':>7}  {'+layers':>7} {'+mode':>7}")
    for name, (build, shape) in models(16).items():
        model = build().train()
        x = torch.randn(*shape).requires_grad_()
        contexts: dict[str, Deferral] = {
            "plain": lambda store: torch.enable_grad(),
            "layers": deferral(model),
            "mode": DeferredWeightsMode,
        }
        times: dict[str, list[float]] = {k: [] for k in contexts}
        for r in range(rounds + 2):
            for how in list(contexts) if r % 2 else list(contexts)[::-1]:
                start = CLOCK()
                for _ in range(20):
                    with contexts[how](WeightStore()):
                        model(x)
                if r >= 2:  # two rounds of warm-up
                    times[how].append((CLOCK() - start) / 20 * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{name:34} {med['plain']:7.0f} {med['layers']:7.0f} {med['mode']:7.0f}  "
            f"{med['layers'] - med['plain']:7.0f} {med['mode'] - med['plain']:7.0f}"
        )


class _Deferred(nn.Module):
    """The stage run deferring, as pipesched's checkpointed forward."""

    def __init__(self, stage: nn.Module, store: WeightStore, defer: Deferral) -> None:
        super().__init__()
        self.stage, self.store, self.defer = stage, store, defer

    def forward(self, x: Tensor) -> Tensor:
        with self.defer(self.store):
            return self.stage(x)  # type: ignore[no-any-return]


CLOCK = time.thread_time
"""This thread's CPU time (``--clock wall``: ``time.perf_counter``)."""
CLOCK_NAME = "thread CPU time"


_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = CLOCK()
    out = fn()
    return CLOCK() - start, out


def _timed(t: dict[str, float], key: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn``: its time into ``t[key]``, its minor page faults into ``t[key + "_faults"]``."""
    faults = resource.getrusage(_RUSAGE).ru_minflt
    t[key], out = _clock(fn)
    t[key + "_faults"] = resource.getrusage(_RUSAGE).ru_minflt - faults
    return out


def keep_heap() -> bool:
    """Sets glibc's trim threshold to 1 GiB and its mmap threshold to 32 MiB (glibc's
    ceiling): freed memory stays in the heap; True where it could."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(
        mallopt(m_trim_threshold, 1 << 30) == 1 and mallopt(m_mmap_threshold, 32 << 20) == 1
    )


def _whole(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float]) -> None:
    model.zero_grad(set_to_none=True)
    t["forward"], y = _clock(lambda: model(leaf))
    _timed(t, "whole", lambda y=y: backward_full([y], [g], [leaf]))


def _split(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float], mode: bool) -> None:
    """B and W, the forward deferring layer by layer (``mode``: under the mode as a whole)."""
    model.zero_grad(set_to_none=True)
    store = WeightStore()
    defer = DeferredWeightsMode if mode else deferral(model)
    suffix = "_mode" if mode else ""

    def deferred_forward() -> Tensor:
        with defer(store):
            return model(leaf)  # type: ignore[no-any-return]

    t["forward" + (suffix or "_layers")], y = _clock(deferred_forward)
    _, w = _timed(t, "B" + suffix, lambda y=y: backward_input([y], [g], [leaf], store))
    del y
    _timed(t, "W" + suffix, w.run)


def _split_layers(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float]) -> None:
    _split(model, leaf, g, t, mode=False)


def _split_mode(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float]) -> None:
    _split(model, leaf, g, t, mode=True)


def _graph_split(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float]) -> None:
    """The split without the mode: a graph analysis per B, an autograd call per W group."""
    model.zero_grad(set_to_none=True)
    y = model(leaf)
    t["graph"], (_, w) = _clock(lambda y=y: backward_input([y], [g], [leaf]))
    del y
    t["graph"] += _clock(w.run)[0]


class _Plain(nn.Module):
    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Tensor) -> Tensor:
        return self.stage(x)  # type: ignore[no-any-return]


def _whole_checkpointed(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float]) -> None:
    """What 1F1B pays for a checkpointed micro-batch: the recomputing whole backward."""
    model.zero_grad(set_to_none=True)
    y = checkpoint(_Plain(model), leaf, preserve_rng_state=True)
    _timed(t, "whole_ckpt", lambda y=y: backward_full([y], [g], [leaf]))


def _split_checkpointed(model: nn.Module, leaf: Tensor, g: Tensor, t: dict[str, float]) -> None:
    model.zero_grad(set_to_none=True)
    store = WeightStore()
    y = checkpoint(_Deferred(model, store, deferral(model)), leaf, preserve_rng_state=True)
    _, w = _timed(t, "B_ckpt", lambda y=y: backward_input([y], [g], [leaf], store))
    del y
    _timed(t, "W_ckpt", w.run)


def one_round(model: nn.Module, x: Tensor, g: Tensor, k: int) -> dict[str, float]:
    """Every contender once, in turn (reversed every other round)."""
    t: dict[str, float] = {}
    leaf = x.detach().requires_grad_()
    contenders = [
        _whole, _split_layers, _whole_checkpointed, _split_checkpointed, _split_mode, _graph_split
    ]  # fmt: skip
    for run in contenders if k % 2 == 0 else contenders[::-1]:
        run(model, leaf, g, t)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--only", default=None, help="run the models whose name contains this")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument(
        "--overhead", action="store_true", help="only what deferral adds to a tiny forward"
    )
    parser.add_argument(
        "--keep-heap", action="store_true", help="glibc keeps freed memory (no page faults)"
    )
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="glibc's thresholds as they start, not raised as a CPU pipeline raises them",
    )
    args = parser.parse_args()
    if args.keep_heap and not keep_heap():
        parser.error("--keep-heap needs glibc's mallopt")
    if not args.glibc_defaults:
        keep_freed_memory()  # as building a pipeline with a CPU worker does
    global CLOCK, CLOCK_NAME
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    torch.manual_seed(0)
    clock = CLOCK_NAME = "thread CPU time" if args.clock == "cpu" else "wall time"
    if args.overhead:
        overhead(max(args.rounds, 21))
        return
    heap = ", heap kept (mallopt)" if args.keep_heap else ""
    heap += ", glibc's thresholds as they start" if args.glibc_defaults else ""
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds, medians (ms, {clock}){heap}")
    header = (
        f"{'model':34} {'whole':>7} {'B':>7} {'W':>7} {'B+W':>7} {'ratio':>6}  "
        f"{'F+whole':>8} {'B+W ckpt':>8} {'ratio':>6} {'/ckpt':>6}  {'F':>6} {'F layers':>8} "
        f"{'F mode':>7} {'mode':>6} {'graph':>6}"
    )
    print(header)
    verdicts = []
    bests: list[tuple[str, float, float, float, float]] = []
    for name, (build, shape) in models().items():
        if args.only and args.only not in name:
            continue
        model = build().train()
        x, g = torch.randn(*shape), torch.randn(*shape)
        for k in range(2):  # warm up
            one_round(model, x, g, k)
        gc.collect()
        gc.disable()  # no collection inside a timed pass
        try:
            rounds = [one_round(model, x, g, k) for k in range(args.rounds)]
        finally:
            gc.enable()
        med = {k: statistics.median(r[k] for r in rounds) * 1e3 for k in rounds[0]}
        ratio = statistics.median((r["B"] + r["W"]) / r["whole"] for r in rounds)
        ratio_ckpt = statistics.median(
            (r["B_ckpt"] + r["W_ckpt"]) / (r["forward"] + r["whole"]) for r in rounds
        )
        graph = statistics.median(r["graph"] / r["whole"] for r in rounds)
        by_mode = statistics.median((r["B_mode"] + r["W_mode"]) / r["whole"] for r in rounds)
        to_ckpt = statistics.median((r["B_ckpt"] + r["W_ckpt"]) / r["whole_ckpt"] for r in rounds)
        best = {k: min(r[k] for r in rounds) for k in rounds[0]}
        bests.append(
            (
                name,
                (best["B"] + best["W"]) / best["whole"],
                (best["B_ckpt"] + best["W_ckpt"]) / (best["forward"] + best["whole"]),
                best["forward_layers"] / best["forward"],
                best["forward_mode"] / best["forward"],
            )
        )
        ok = ratio <= LIMIT and ratio_ckpt <= LIMIT
        verdicts.append(ok)
        print(
            f"{name:34} {med['whole']:7.2f} {med['B']:7.2f} {med['W']:7.2f} "
            f"{med['B'] + med['W']:7.2f} {ratio:6.3f}  {med['forward'] + med['whole']:8.2f} "
            f"{med['B_ckpt'] + med['W_ckpt']:8.2f} {ratio_ckpt:6.3f} {to_ckpt:6.3f}  "
            f"{med['forward']:6.2f} {med['forward_layers']:8.2f} {med['forward_mode']:7.2f} "
            f"{by_mode:6.3f} {graph:6.3f}  "
            f"{'PASS' if ok else 'FAIL'}"
        )
        passes = ("whole", "B", "W", "whole_ckpt", "B_ckpt", "W_ckpt")
        faults = (f"{k} {statistics.median(r[k + '_faults'] for r in rounds):.0f}" for k in passes)
        print("  page faults:", ", ".join(faults))
    if not verdicts:
        parser.error(f"--only {args.only!r} names none of: {', '.join(models())}")
    print("ratios: medians of the per-round ratios; target <=", LIMIT)
    print(
        "on the bests (min over rounds): B+W / whole, B+W ckpt / (F + whole), "
        "F layers / F, F mode / F"
    )
    for name, split, ckpt, layers, forward in bests:
        print(f"  {name:34} {split:6.3f} {ckpt:6.3f} {layers:6.3f} {forward:6.3f}")
    print("PASS" if all(verdicts) else "FAIL")


if __name__ == "__main__":
    main()
