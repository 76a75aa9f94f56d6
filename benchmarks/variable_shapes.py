"""What micro-batches of their own shapes cost on 2 gloo ranks: the layout exchange vs the step.

Run: .venv/bin/python benchmarks/variable_shapes.py [--rounds 41]
     (it launches itself under torchrun with 2 processes, one intra-op thread each)

Method. A token model (Embedding, 8 x (Linear(256, 256) + GELU), Linear(256,
1024); a token loss summed, divided by ``num_items``), cut into 2 stages on 2
ranks, schedule 1f1b, 8 micro-batches of 2 rows and sequence lengths 96, 160,
64, 192, 128, 112, 144, 128 (2048 tokens): every transfer has a layout of its
own. The same micro-batches run on three pipelines that differ only in how
their transport learns shapes:

- steady: the default on gloo/TCP after the first step: each channel's
  receive buffer is its largest message so far, every message's header
  carries its layout, no notice is sent;
- cold: the same, with every channel's high-water mark forgotten (on both
  ranks) before each step: every step pays what a first step pays (a
  header-only notice before each message, received in a buffer of its size);
- ordered: the exact-size protocol NCCL needs (``PIPESCHED_P2P=ordered``):
  every message under one tag, posted in the schedule's agreed order, each
  receive posted ahead at the size its micro-batch's input shapes gave before
  (a notice and a wait only for shapes not seen yet: here, the first step's).

A fourth pipeline, fixed, runs 8 x 128 tokens: the same FLOPs, one shape.

Two measures. (1) The time each rank's transport spends on layouts while
receiving (:class:`Meter`): each receive's time less its wait for data
posted ahead (that wait is for the sender's compute, there for any shape):
reading a header's layout, copying a message out of a larger buffer, and,
after a notice, receiving the data it announces (posted only then). Per
round, the slower rank's layout time over the step time; median over
rounds. The same receive bookkeeping runs for one shape (``fixed``): the
shape exchange's cost is the difference, varying minus fixed. The target:
in steady state that difference, and the whole receive bookkeeping too, is
< 2% of the step. Sending a notice is one more asynchronous 512-byte isend,
not timed. (2) Step times,
as a cross-check: ``steady / fixed - 1`` is what varying shapes cost in all
(also GEMMs of other sizes, and bubbles between neighbours of other
lengths); ``cold`` is a step in which channels meet messages larger than
any before (in a run of bounded lengths, a few times per channel, early);
``ordered`` is what NCCL's rules cost on the same data. Step times on a
loaded machine only grow, so like ``timeit`` they are compared by each
contender's fastest round; medians and paired ratios are printed beside
them. Contenders alternate round by round in the same two processes; a
round's time is the slower rank's. The machine is shared (2 cores): run it
twice if a number looks odd.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _torchrun import under_torchrun
from torch import nn

VOCAB, WIDTH, LAYERS, ROWS = 1024, 256, 8, 2
VARIED = (96, 160, 64, 192, 128, 112, 144, 128)
FIXED = (128,) * len(VARIED)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(VOCAB, WIDTH)]
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, VOCAB))


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def batches(lengths: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, VOCAB, (ROWS, n), generator=g) for n in lengths]
    ys = [torch.randint(0, VOCAB, (ROWS, n), generator=g) for n in lengths]
    return xs, ys


class Meter:
    """Times what one rank's transport spends on layouts while receiving.

    That is each receive's time less the wait for data posted ahead (which
    is waiting for the sender's compute, there for any shape): reading the
    header's layout, copying a message out of a larger buffer, and after a
    notice the receive of the data it announces (posted only then).
    """

    def __init__(self, transport: Any) -> None:
        self.seconds = 0.0
        self._waiting = 0.0
        self._inside_irecv = False
        link = transport.link
        recv, irecv, wait = transport.take, link.receive, link.wait

        def timed_recv(*args: Any) -> Any:
            start, waited = time.perf_counter(), self._waiting
            value = recv(*args)
            self.seconds += time.perf_counter() - start - (self._waiting - waited)
            return value

        def timed_irecv(*args: Any) -> Any:
            self._inside_irecv = True
            try:
                return irecv(*args)
            finally:
                self._inside_irecv = False

        def timed_wait(*args: Any) -> None:
            start = time.perf_counter()
            try:
                wait(*args)
            finally:
                if not self._inside_irecv:  # a wait for data posted ahead: not layout work
                    self._waiting += time.perf_counter() - start

        transport.take, link.receive, link.wait = timed_recv, timed_irecv, timed_wait


def contenders(rank: int) -> tuple[dict[str, Callable[[], None]], dict[str, Any], dict[str, Meter]]:
    from pipesched import Pipeline
    from pipesched.runtime.mesh import init_mesh

    mesh = init_mesh(pp=2)
    half = 1 + LAYERS  # embedding + 4 blocks | 4 blocks + head
    runs: dict[str, Callable[[], None]] = {}
    transports: dict[str, Any] = {}
    meters: dict[str, Meter] = {}
    for name, lengths in (
        ("steady", VARIED),
        ("cold", VARIED),
        ("ordered", VARIED),
        ("fixed", FIXED),
    ):
        if name == "ordered":  # NCCL's matching rules on gloo (read when the pipeline is built)
            os.environ["PIPESCHED_P2P"] = "ordered"
        pipe = Pipeline(model(), 1, balance=[half, len(model()) - half], mesh=mesh, schedule="1f1b")
        os.environ.pop("PIPESCHED_P2P", None)
        transport = pipe.engine.runtime.transport

        xs, ys = batches(lengths)
        items = sum(y.numel() for y in ys)

        def step(
            pipe: Any = pipe,
            cold: bool = name == "cold",
            xs: Any = xs,
            ys: Any = ys,
            n: int = items,
        ) -> None:
            if cold:  # both ranks forget, between steps (no receive is pending then)
                pipe.engine.runtime.transport._high.clear()
            pipe.step(microbatches=xs, targets=ys, loss_fn=token_sum, num_items=n)

        runs[name] = step
        transports[name] = transport
        meters[name] = Meter(transport)
    return runs, transports, meters


def worker(rounds: int) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    runs, transports, meters = contenders(rank)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    shares: dict[str, list[float]] = {name: [] for name in names}  # layout time / step
    for fn in runs.values():  # warm-up, first layouts exchanged
        dist.barrier()
        fn()
    notices = {name: 0 for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            before, spent = transports[name].stats.notices, meters[name].seconds
            start = time.perf_counter()
            runs[name]()
            elapsed = torch.tensor([time.perf_counter() - start, meters[name].seconds - spent])
            notices[name] = transports[name].stats.notices - before
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's step and layouts
            times[name].append(float(elapsed[0]))
            shares[name].append(float(elapsed[1] / elapsed[0]))
    sent = torch.tensor([notices[name] for name in names])
    dist.all_reduce(sent)  # both ranks' notices (activations one way, gradients the other)
    if rank == 0:
        report(times, shares, rounds, dict(zip(names, sent.tolist(), strict=True)))
    dist.destroy_process_group()


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def report(
    times: dict[str, list[float]],
    shares: dict[str, list[float]],
    rounds: int,
    notices: dict[str, int],
) -> None:
    print(
        f"Embedding + {LAYERS} x Linear({WIDTH}) + GELU + head, 2 stages (1f1b), 8 micro-batches "
        f"of {ROWS} rows, {ROWS * sum(FIXED)} tokens a step; 2 gloo processes, 1 thread each; "
        f"{rounds} alternating rounds"
    )
    best = {name: min(t) for name, t in times.items()}
    share = {name: statistics.median(v) for name, v in shares.items()}
    print(
        f"{'contender':<10}{'best ms':>9}{'median ms':>11}{'notices/step':>14}"
        f"{'layouts % of step':>19}{'best x steady':>15}"
    )
    for name, t in times.items():
        print(
            f"{name:<10}{1000 * best[name]:>9.1f}{1000 * statistics.median(t):>11.1f}"
            f"{notices[name]:>14}{100 * share[name]:>19.2f}{best[name] / best['steady']:>15.3f}"
        )
    print(
        f"varying shapes in all, steady state (steady vs fixed, best rounds): "
        f"{100 * (best['steady'] / best['fixed'] - 1):+.1f}% (paired median "
        f"{100 * (_paired(times, 'steady', 'fixed') - 1):+.1f}%)"
    )
    cost = share["steady"] - share["fixed"]
    verdict = "ok" if cost < 0.02 and share["steady"] < 0.02 else "FAIL"
    print(
        f"target shape exchange < 2% of step time (steady state): {100 * cost:.2f}% more "
        f"receive time than one shape, {100 * share['steady']:.2f}% in all {verdict}; a step "
        f"whose channels grow: {100 * (share['cold'] - share['fixed']):.2f}%; the ordered "
        f"(exact-size) protocol: {100 * (share['ordered'] - share['fixed']):.2f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.rounds)
        return
    sys.exit(under_torchrun(__file__, ["--rounds", str(args.rounds)]))


if __name__ == "__main__":
    main()
