"""What a GPU machine shows, in one table: the CUDA tests, the local runtime on CUDA, NCCL pp=2.

Run: make gpu-check    (or .venv/bin/python benchmarks/gpu_check.py [--rounds 9])
     --on-cpu runs every part on CPU (gloo) to check this script itself; its numbers mean nothing.

Without a CUDA device it prints one line saying so and exits 0. With one, three
parts, each in a process of its own with a time limit (a hang or crash in one is
a row of the table, not the end of the run):

- tests: ``pytest -m cuda``, every CUDA-only test (the ``cuda`` marker).
- local: the local runtime on the GPUs present (2 stages: one per GPU with 2+,
  both on cuda:0 with one, which still runs 2 streams and their events):
  16 x (Linear(WIDTH) + ReLU) in bf16, chunks 8; the plain model, pipesched
  gpipe / 1f1b / zb-h1 (checkpoint="never") and torchgpipe's GPipe on the same
  devices, balance and chunks, alternated round by round, median step time.
  A pipesched row is ok when its loss equals the plain model's (bf16 tolerance).
- nccl: with 2+ GPUs, 2 torchrun ranks (``init_mesh(pp=2)`` takes NCCL), 1F1B:
  the parameters after 3 SGD steps in fp64 equal a single-process reference's
  (ok/FAIL), then the median 1F1B step of the benchmark MLP. Skipped, with the
  reason, below 2 GPUs.

The exit code is 0 when every part is ok or skipped, 1 otherwise; the table is
printed either way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch
from _torchrun import under_torchrun
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
LAYERS, CHUNKS, STEPS = 16, 8, 3
Row = tuple[str, str, str]  # what was checked, ok / FAIL / skipped, the numbers


def bench_mlp(width: int, dtype: torch.dtype) -> nn.Sequential:
    """LAYERS x (Linear(width, width) + ReLU), the same weights every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(dtype)


def synchronize(devices: list[torch.device]) -> None:
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


# --- part: tests --------------------------------------------------------------------------


def run_tests(timeout: float, on_cpu: bool) -> Row:
    """``pytest -m cuda``, counted from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cuda.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", f"--junitxml={report}"]
        paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        if on_cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return "CUDA tests (pytest -m cuda)", "FAIL", f"timed out after {timeout:.0f} s"
        if not report.exists():
            return "CUDA tests (pytest -m cuda)", "FAIL", f"pytest exited {done.returncode}"
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    numbers = f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped"
    ok = done.returncode == 0 and failed == 0
    if not ok:
        sys.stdout.write(done.stdout[-4000:])
    return "CUDA tests (pytest -m cuda)", "ok" if ok else "FAIL", numbers


# --- part: local --------------------------------------------------------------------------


def local_part(rounds: int, on_cpu: bool) -> list[Row]:
    """The local runtime on the devices present, side by side with torchgpipe and plain."""
    from pipesched import Pipeline

    count = 0 if on_cpu else torch.cuda.device_count()
    names = ["cpu", "cpu"] if on_cpu else [f"cuda:{min(s, count - 1)}" for s in range(2)]
    devices = [torch.device(n) for n in names]
    dtype = torch.float32 if on_cpu else torch.bfloat16
    width, batch = (256, 64) if on_cpu else (4096, 1024)
    loss_fn = nn.functional.mse_loss
    torch.manual_seed(1)
    x = torch.randn(batch, width, dtype=dtype, device=devices[0])
    y = torch.randn(batch, width, dtype=dtype, device=devices[-1])
    balance = [LAYERS, LAYERS]
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    plain = bench_mlp(width, dtype).to(devices[0])
    y0 = y.to(devices[0])
    runs["plain"] = lambda: _backward(loss_fn(plain(x), y0))
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = Pipeline(
            bench_mlp(width, dtype),
            CHUNKS,
            balance=balance,
            devices=names,
            schedule=schedule,
            checkpoint="never",
        )
        runs[f"pipesched {schedule}"] = lambda pipe=pipe: pipe.step(x, y, loss_fn=loss_fn)
    try:
        from torchgpipe import GPipe
    except ImportError:
        gpipe = None
    else:
        gpipe = GPipe(
            bench_mlp(width, dtype),
            balance=balance,
            devices=names,
            chunks=CHUNKS,
            checkpoint="never",
        )
        runs["torchgpipe GPipe"] = lambda: _backward(loss_fn(gpipe(x), y))
    losses: dict[str, float] = {}
    failed: list[Row] = []  # a contender that raises is a row, the others still run
    for name, fn in list(runs.items()):  # warm-up
        try:
            losses[name] = float(fn().detach().float())
        except Exception as error:
            first = str(error).splitlines()[0][:100]
            failed.append((f"local {name}", "FAIL", f"{type(error).__name__}: {first}"))
            del runs[name]
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            synchronize(devices)
            start = time.perf_counter()
            runs[name]()
            synchronize(devices)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    where = "+".join(names)
    rows: list[Row] = []
    for name, t in median.items():
        numbers = f"{1000 * t:.2f} ms, {median['plain'] / t:.2f}x plain"
        if "torchgpipe GPipe" in median and name != "torchgpipe GPipe":
            numbers += f", {median['torchgpipe GPipe'] / t:.2f}x torchgpipe"
        ok = abs(losses[name] - losses["plain"]) <= 2e-2 * abs(losses["plain"]) + 1e-6
        rows.append((f"local {name} ({where})", "ok" if ok else "FAIL", numbers))
    if gpipe is None:
        rows.append(("local torchgpipe GPipe", "skipped", "torchgpipe is not installed"))
    return rows + failed


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


# --- part: nccl (under torchrun) ----------------------------------------------------------


def nccl_worker(rounds: int, out: Path) -> None:
    """One of 2 ranks: 1F1B's parameters against one process's, then the step time."""
    import torch.distributed as dist

    from pipesched import Pipeline
    from pipesched.runtime.mesh import init_mesh

    mesh = init_mesh(pp=2, timeout=120)
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )

    def small() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16)
        ).double()

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(100 + step)
        x, y = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
        return x.to(device), y.to(device)

    loss_fn = nn.functional.mse_loss
    pipe = Pipeline(small(), 4, balance=[3, 2], mesh=mesh, schedule="1f1b", checkpoint="never")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    reference = small().to(device)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = data(step)
        pipe.step(x, y, loss_fn=loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    expected = dict(reference.named_parameters())
    worst, compared = 0.0, 0
    for name, p in pipe.named_parameters():
        if p.device.type == "meta":
            continue
        q = expected[name].detach()
        worst = max(worst, float((p.detach().to(q.device) - q).abs().max()))
        compared += 1
    # The benchmark MLP's 1F1B step, timed as the slower rank's.
    width, batch = (256, 64) if device.type == "cpu" else (4096, 1024)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    timed = Pipeline(
        bench_mlp(width, dtype),
        CHUNKS,
        balance=[LAYERS, LAYERS],
        mesh=mesh,
        schedule="1f1b",
        checkpoint="never",
    )
    torch.manual_seed(1)
    x = torch.randn(batch, width, dtype=dtype).to(device)
    y = torch.randn(batch, width, dtype=dtype).to(device)
    timed.step(x, y, loss_fn=loss_fn)  # warm-up
    times = []
    for _ in range(rounds):
        dist.barrier()
        synchronize([device])
        start = time.perf_counter()
        timed.step(x, y, loss_fn=loss_fn)
        synchronize([device])
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    summary = torch.tensor([worst, float(compared)], dtype=torch.float64, device=device)
    dist.all_reduce(summary)  # worst: summed, an upper bound of the max over ranks
    if rank == 0:
        result = {
            "backend": dist.get_backend(),
            "max_abs_diff": float(summary[0]),
            "params_compared": int(summary[1]),
            "params": len(expected),
            "step_s": statistics.median(times),
        }
        out.write_text(json.dumps(result))
    del pipe, timed  # their runtimes' threads and posted receives end before the group does
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def nccl_part(rounds: int, timeout: float, on_cpu: bool) -> Row:
    what = "NCCL pp=2 1F1B (2 ranks)" if not on_cpu else "gloo pp=2 1F1B (2 ranks, --on-cpu)"
    count = torch.cuda.device_count()
    if not on_cpu and count < 2:
        return what, "skipped", f"needs 2 GPUs, {count} visible"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "nccl.json"
        argv = ["--part", "nccl", "--rounds", str(rounds), "--out", str(out)]
        code = under_torchrun(__file__, argv, gpus=not on_cpu, timeout=timeout)
        if code != 0 or not out.exists():
            reason = f"timed out after {timeout:.0f} s" if code == 124 else f"exit code {code}"
            return what, "FAIL", reason
        result = json.loads(out.read_text())
    exact = result["max_abs_diff"] <= 1e-10 and result["params_compared"] == result["params"]
    numbers = (
        f"params after {STEPS} steps vs 1 process: max |diff| {result['max_abs_diff']:.1e} "
        f"({result['params_compared']}/{result['params']}); step {1000 * result['step_s']:.2f} ms"
        f" ({result['backend']})"
    )
    return what, "ok" if exact else "FAIL", numbers


# --- the table ----------------------------------------------------------------------------


def in_subprocess(part: str, rounds: int, timeout: float, on_cpu: bool) -> list[Row]:
    """Runs ``--part part`` in a process of its own, bounded by ``timeout``; its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{part}.json"
        command = [__file__, "--part", part, "--rounds", str(rounds), "--out", str(out)]
        command += ["--on-cpu"] if on_cpu else []
        try:
            done = subprocess.run(
                [sys.executable, *command], capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return [(f"{part} benchmark", "FAIL", f"timed out after {timeout:.0f} s")]
        if done.returncode != 0 or not out.exists():
            sys.stdout.write(done.stdout[-2000:] + done.stderr[-4000:])
            return [(f"{part} benchmark", "FAIL", f"exit code {done.returncode}, output above")]
        return [tuple(row) for row in json.loads(out.read_text())]  # type: ignore[misc]


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    widths = [max(len(r[k]) for r in [("check", "result", "numbers"), *rows]) for k in range(3)]
    for row in [("check", "result", "numbers"), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per part")
    parser.add_argument("--on-cpu", action="store_true", help="check this script on CPU")
    parser.add_argument("--part", choices=["local", "nccl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "nccl":
        nccl_worker(args.rounds, args.out)
        return
    if args.part == "local":
        args.out.write_text(json.dumps(local_part(args.rounds, args.on_cpu)))
        return
    if not args.on_cpu and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__}, {build}, "
            "torch.cuda.is_available() is False); nothing to check"
        )
        return
    if args.on_cpu:
        header = f"gpu-check --on-cpu: torch {torch.__version__}; numbers mean nothing"
    else:
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        header = (
            f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}: {', '.join(sorted(set(gpus)))}; "
            f"median of {args.rounds} rounds"
        )
    rows = [run_tests(args.timeout, args.on_cpu)]
    rows += in_subprocess("local", args.rounds, args.timeout, args.on_cpu)
    rows.append(nccl_part(args.rounds, args.timeout, args.on_cpu))
    print_table(rows, header)
    sys.exit(0 if all(result in ("ok", "skipped") for _, result, _ in rows) else 1)


if __name__ == "__main__":
    main()
