"""Memory per rank: a model built on the meta device vs the whole model built on every rank.

Run: .venv/bin/python benchmarks/memory.py [--layers 32 --width 4096]
     (it launches pp = 1, 2 and 4 gloo processes per build itself, one intra-op thread each)

Model: ``layers`` x Linear(width, width) (32 x 4096^2 fp32: 2.0 GiB of
parameters), chunks 4, batch 8, cut by parameters. For each pp, two builds:

- whole: today's torchrun script, ``model = build()`` on every rank, then
  ``Pipeline(model, mesh=...)``, which keeps this rank's stages and frees the rest.
- meta: ``with torch.device("meta"): model = build()``, then the same
  Pipeline: each rank allocates and initializes only its own stages.

Per rank: the resident anonymous memory (``RssAnon``) the build added
(model construction + Pipeline), the largest it reached during the build,
and the process's peak resident memory (``VmHWM``: torch's own ~0.3 GiB
included) after one training step (parameters + their gradients).

Then sharded data parallel (``--dp``, default 2) at pp=2: the same model at
``--dp-layers`` x Linear(``--dp-width``) trained with AdamW for ``--steps`` steps
(windows of 2) on zb-v (two stages per rank), each stage replicated on every
replica (``init_mesh(pp, dp)``), sharded over them (``shard=dp``, FSDP2,
gathered once per step) or sharded and gathered around each action
(``reshard="action"``). Per rank: the parameter + gradient + AdamW-state bytes
it holds at the last window's optimizer step (its own shards only), the most
parameter bytes it held whole at any forward, the median step time of the steps
after the first window, and VmHWM.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

GIB = 2**30


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Peak:
    """The highest RssAnon seen while it runs (sampled every 5 ms in a thread)."""

    def __init__(self) -> None:
        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status("RssAnon"))


def rank_main(build: str, layers: int, width: int) -> None:
    """One rank: build, measure, one step, report one JSON line."""
    import torch
    from torch import nn

    from pipesched import Pipeline
    from pipesched.runtime.mesh import init_mesh

    pp = int(os.environ["WORLD_SIZE"])
    mesh = init_mesh(pp=pp, timeout=600)

    def model() -> nn.Sequential:
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    with torch.device("meta"):  # the first Pipeline's one-time costs, not the model's
        Pipeline(nn.Sequential(*(nn.Linear(8, 8) for _ in range(pp))), 4, mesh=mesh)
    torch.distributed.barrier()
    before, peak = _status("RssAnon"), _Peak()
    start = time.perf_counter()
    if build == "meta":
        with torch.device("meta"):
            whole = model()
    else:
        whole = model()
    pipe = Pipeline(whole, 4, mesh=mesh)
    seconds = time.perf_counter() - start
    built, held = peak.stop() - before, _status("RssAnon") - before
    own = sum(p.numel() * p.element_size() for p in pipe.parameters() if not p.is_meta)
    torch.distributed.barrier()
    x = torch.randn(8, width)
    pipe.step(x, torch.randn(8, width), loss_fn=nn.functional.mse_loss)
    torch.distributed.barrier()
    report = {
        "build": build,
        "pp": pp,
        "rank": mesh.get_rank(),
        "own": own,
        "held": held,
        "built_peak": built,
        "seconds": seconds,
        "step_peak": _status("VmHWM"),
    }
    print("RESULT " + json.dumps(report), flush=True)
    del pipe
    torch.distributed.destroy_process_group()


def rank_dp(build: str, layers: int, width: int, steps: int) -> None:
    """One rank of pp=2 x dp: replicated or sharded stages; bytes held and step times."""
    import statistics

    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    from pipesched import GradientAccumulator, Pipeline
    from pipesched.runtime.mesh import init_mesh

    dp = int(os.environ["WORLD_SIZE"]) // 2
    shard = 1 if build == "dp-whole" else dp
    reshard = "action" if build == "dp-action" else "step"
    mesh = init_mesh(pp=2, dp=dp, shard=shard, reshard=reshard, timeout=600)
    torch.manual_seed(0)
    pipe = Pipeline(
        nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))), 4, mesh=mesh,
        schedule="zb-v",
    )  # fmt: skip
    whole: list[int] = [0]

    def count_whole(*_: object) -> None:  # at each stage's forward: parameters held whole
        params = [p for p in pipe.parameters() if not p.is_meta and not isinstance(p, DTensor)]
        whole.append(sum(p.numel() * p.element_size() for p in params))

    for stage in pipe.stages:
        if stage is not None:
            stage.register_forward_pre_hook(count_whole)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=2)
    held: list[int] = []
    step = optimizer.step

    def local(tensors: list[torch.Tensor]) -> int:
        parts = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in parts if not t.is_meta)

    def measured(*args: object, **kwargs: object) -> object:
        params = [p for p in pipe.parameters() if not p.is_meta]
        state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        grads = [p.grad for p in params if p.grad is not None]
        held.append(local(params) + local(grads) + local(state))
        return step(*args, **kwargs)

    optimizer.step = measured  # type: ignore[method-assign]
    times = []
    for _ in range(steps):
        x = torch.randn(8, width)
        torch.distributed.barrier()
        start = time.perf_counter()
        acc.step(x, torch.randn(8, width), loss_fn=nn.functional.mse_loss)
        times.append(time.perf_counter() - start)
    report = {
        "build": build,
        "pp": 2,
        "dp": dp,
        "rank": mesh.get_rank(),
        "held": held[-1],
        "whole": max(whole),
        "step_ms": 1000 * statistics.median(times[2:]),
        "step_peak": _status("VmHWM"),
    }
    print("RESULT " + json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()


def launch(
    build: str, pp: int, layers: int, width: int, timeout: float, steps: int = 0
) -> list[dict]:
    """Runs ``pp`` ranks of this script (torchrun's environment, gloo); their reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(pp):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(pp),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(pp),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        argv = [
            sys.executable, __file__, "--rank", build, f"--layers={layers}", f"--width={width}",
            f"--steps={steps}",
        ]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    reports = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"{build} pp={pp}: no result within {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise SystemExit(f"{build} pp={pp}: a rank exited {proc.returncode}")
        reports += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--dp", type=int, default=2, help="replicas of the sharded rows (0: none)")
    parser.add_argument("--dp-layers", type=int, default=8)
    parser.add_argument("--dp-width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    builds = ("meta", "whole", "dp-whole", "dp-shard", "dp-action")
    parser.add_argument("--rank", choices=builds, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank in ("meta", "whole"):
        rank_main(args.rank, args.layers, args.width)
        return
    if args.rank is not None:
        rank_dp(args.rank, args.layers, args.width, args.steps)
        return
    params = args.layers * (args.width**2 + args.width) * 4
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}), {params / GIB:.2f} GiB "
        "of fp32 parameters; chunks 4, batch 8, balance='params'"
    )
    print(
        "RssAnon growth by the build (model + Pipeline): 'held' after it, 'peak' during it; "
        "'step peak': the process's VmHWM after one training step"
    )
    header = ("pp", "rank", "build", "own params", "held", "peak", "build s", "step peak")
    rows = [header]
    for pp in args.pp:
        for build in ("whole", "meta"):
            for r in sorted(launch(build, pp, args.layers, args.width, args.timeout), key=_rank):
                rows.append(
                    (
                        str(pp),
                        str(r["rank"]),
                        build,
                        _gib(r["own"]),
                        _gib(r["held"]),
                        _gib(r["built_peak"]),
                        f"{r['seconds']:.1f}",
                        _gib(r["step_peak"]),
                    )
                )
    _table(rows)
    if args.dp > 0:
        _data_parallel(args)


def _data_parallel(args: argparse.Namespace) -> None:
    """The sharded rows beside the replicated ones, one run."""
    params = args.dp_layers * (args.dp_width**2 + args.dp_width) * 4
    print(
        f"\npp=2 x dp={args.dp}: {args.dp_layers} x Linear({args.dp_width}), "
        f"{params / GIB:.3f} GiB of fp32 parameters, AdamW, windows of 2 steps; 'held': "
        "parameters + gradients + AdamW state at the last window's optimizer step"
    )
    header = (
        "pp",
        "dp",
        "rank",
        "stages",
        "held",
        "ratio",
        "whole in step",
        "step ms",
        "step peak",
    )
    rows = [header]
    runs = {
        build: sorted(
            launch(build, 2 * args.dp, args.dp_layers, args.dp_width, args.timeout, args.steps),
            key=_rank,
        )
        for build in ("dp-whole", "dp-shard", "dp-action")
    }
    for build, reports in runs.items():
        for r, whole in zip(reports, runs["dp-whole"], strict=True):
            rows.append(
                (
                    "2",
                    str(args.dp),
                    str(r["rank"]),
                    {"dp-whole": "replicated", "dp-shard": "sharded", "dp-action": "per action"}[
                        build
                    ],
                    _gib(r["held"]),
                    f"{r['held'] / whole['held']:.2f}",
                    _gib(r["whole"]),
                    f"{r['step_ms']:.0f}",
                    _gib(r["step_peak"]),
                )
            )
    _table(rows)


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def _rank(report: dict) -> int:
    return int(report["rank"])


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


if __name__ == "__main__":
    main()
