"""Spawn a few gloo processes running a worker script like torchrun, bounded in time.

Why a fork server: a worker spends most of its life importing torch (about two
seconds of CPU each, tens of launches per suite on two cores). Python's
``forkserver`` imports torch and pipesched once, in a process with no threads
yet, and forks each rank from it, so a rank starts with them loaded. A worker
whose subject is the interpreter's own exit (atexit, threads alive at
shutdown) runs as a fresh ``python worker.py`` instead: ``fresh=True``.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.export",
    "networkx",
    "pipesched.pipeline.facade",
    "pipesched.train",
]


@dataclass(frozen=True)
class Exit:
    rank: int
    code: int | None  # None: still running at the deadline (then killed)
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        # gloo on CPU even on a GPU machine (init_mesh would choose NCCL there).
        "CUDA_VISIBLE_DEVICES": "",
    }


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _run_worker(worker: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """A forked rank: the caller's environment and torchrun's, output to ``log``, the script."""
    os.environ.clear()  # the fork server's is the one of the suite's start
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(1)
    sys.argv = [worker, *argv]
    sys.path.insert(0, str(Path(worker).parent))  # as `python worker.py` has it
    try:
        runpy.run_path(worker, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def launch(
    scenario: str,
    world: int,
    out: Path,
    timeout: float = 90.0,
    worker: Path = WORKER,
    *,
    fresh: bool = False,
) -> list[Exit]:
    """Runs ``worker scenario out`` on ``world`` ranks like torchrun; kills at the deadline.

    Args:
        fresh: each rank a new interpreter (``python worker.py``), not forked.
    """
    if fresh:
        return _launch_fresh(scenario, world, out, timeout, worker)
    port = free_port()
    context = _context()
    logs = [Path(out) / f".rank{rank}.log" for rank in range(world)]
    Path(out).mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, **_environment(rank, world, port)}
        proc = context.Process(
            target=_run_worker, args=(str(worker), [scenario, str(out)], env, str(logs[rank]))
        )
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + timeout
    exits = []
    for rank, proc in enumerate(procs):
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.exitcode is None:
            for p in procs:
                p.kill()
            proc.join()
            exits.append(Exit(rank, None, logs[rank].read_text()))
            continue
        exits.append(Exit(rank, proc.exitcode, logs[rank].read_text()))
    return exits


def _launch_fresh(scenario: str, world: int, out: Path, timeout: float, worker: Path) -> list[Exit]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **_environment(rank, world, port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), scenario, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    exits = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            exits.append(Exit(rank, proc.returncode, output))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            output, _ = proc.communicate()
            exits.append(Exit(rank, None, output))
    return exits
