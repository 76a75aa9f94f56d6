"""Running a benchmark script again under torchrun, on 2 local gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun(script: str, argv: list[str]) -> int:
    """Runs ``script argv`` as 2 torchrun ranks (one intra-op thread each); its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
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
    return subprocess.run(command, env=env, check=False).returncode
