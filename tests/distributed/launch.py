"""Spawn a few gloo processes running tests/distributed/worker.py, bounded in time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


@dataclass(frozen=True)
class Exit:
    rank: int
    code: int | None  # None: still running at the deadline (then killed)
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    scenario: str, world: int, out: Path, timeout: float = 90.0, worker: Path = WORKER
) -> list[Exit]:
    """Runs ``worker scenario out`` on ``world`` ranks like torchrun; kills at the deadline."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
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
