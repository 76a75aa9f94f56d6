"""Running a benchmark script again under torchrun, on 2 local ranks (gloo, or NCCL on GPUs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def under_torchrun(
    script: str, argv: list[str], *, gpus: bool = False, timeout: float | None = None
) -> int:
    """Runs ``script argv`` as 2 torchrun ranks (one intra-op thread each); its exit code.

    Args:
        gpus: let the ranks see the GPUs (``init_mesh`` then takes NCCL, one GPU
            per rank); without, they are hidden and the ranks run gloo on CPU even
            on a GPU machine.
        timeout: seconds before the ranks are killed (exit code 124), or None.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        script,
        *argv,
    ]
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: their own session
        proc.wait()
        return 124
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
