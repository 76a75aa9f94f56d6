"""torchrun as users run it: two agents meeting by c10d rendezvous, and an elastic restart.

Two ``torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d`` agents on
this host stand in for two nodes; each runs ``examples/torchrun_train.py`` at
pp=2 x dp=2 in float64. The final parameters (read from the example's last
committed checkpoint) are compared with one process training the same
windows on both replicas' batches. float64, rtol 1e-10: the runs differ
only in summation order (the dp all-reduce, micro-batch splits), and AdamW,
dividing by each gradient's running magnitude, amplifies that where a
gradient is tiny: in float32 the same comparison differed by up to 5e-5
(absolute, an attention bias) after these 3 windows, a gap no fixed
tolerance tells from a real error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

import pipesched
from pipesched import GradientAccumulator, Pipeline
from pipesched.train import model_state
from tests.distributed.launch import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_train.py"
WINDOWS = 3
TIMEOUT = 100.0  # seconds for the whole job; each test takes 30-60 s on two busy cores

pytestmark = pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="torchrun is not installed",
)


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchrun_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(windows: int) -> dict[str, torch.Tensor]:
    """One process, no mesh: each step trains on both replicas' batches of that step."""
    ex = _example()
    pipe = Pipeline(ex.model(torch.float64), chunks=2 * ex.CHUNKS, devices=["cpu"])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)  # as the example's
    acc = GradientAccumulator(
        pipe, optimizer, accumulation_steps=ex.STEPS_PER_WINDOW, max_grad_norm=1.0
    )
    for step in range(windows * ex.STEPS_PER_WINDOW):
        (ids0, labels0, n0), (ids1, labels1, n1) = ex.batch(step, 0), ex.batch(step, 1)
        acc.step(
            torch.cat([ids0, ids1]),
            torch.cat([labels0, labels1]),
            loss_fn=ex.token_sum,
            num_items=n0 + n1,
        )
    assert acc.windows == windows
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def _children() -> dict[int, list[int]]:
    """Each live process's children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def _kill_all(agents: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILLs every agent and all its workers (each worker in a session of its own)."""
    for agent in agents:  # stopped, an agent starts no worker while its tree is read
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGSTOP)
    children = _children()
    doomed: list[int] = []
    pending = [a.pid for a in agents]
    while pending:
        pid = pending.pop()
        doomed.append(pid)
        pending.extend(children.get(pid, []))
    for pid in reversed(doomed):  # descendants first: none is orphaned before it is killed
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for agent in agents:
        agent.wait()


def _two_nodes(out: Path, env: dict[str, str], max_restarts: int) -> list[tuple[int | None, str]]:
    """Runs the example under two c10d agents at once; each agent's exit code and output."""
    port = free_port()
    environment = {
        **os.environ,
        **env,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU, even on a GPU machine
        "PYTHONPATH": os.pathsep.join(
            [str(Path(pipesched.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    command = [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nnodes", "2", "--nproc_per_node", "2"),
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}"),
        *("--rdzv_id", f"pipesched-{port}", "--max_restarts", str(max_restarts)),
        *(str(EXAMPLE), "--dp", "2", "--windows", str(WINDOWS)),
        *("--checkpoint", str(out / "ckpt"), "--resume", "auto", "--dtype", "float64"),
    ]
    logs = [out / f"agent{k}.log" for k in range(2)]
    agents = []
    try:
        for log in logs:
            with open(log, "wb") as f:
                agents.append(
                    subprocess.Popen(
                        command,
                        env=environment,
                        cwd=out,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT
        codes: list[int | None] = []
        for agent in agents:
            try:
                codes.append(agent.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        _kill_all(agents)  # whatever happened: no agent or worker outlives the test
    return [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]


def _assert_ran(exits: list[tuple[int | None, str]]) -> str:
    output = "\n".join(f"--- agent {k} (exit {c}) ---\n{o}" for k, (c, o) in enumerate(exits))
    assert [code for code, _ in exits] == [0, 0], output[-6000:]
    return output


def _assert_equal(trained: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert trained.keys() == reference.keys()
    for name, tensor in reference.items():
        assert trained[name].dtype == torch.float64, name
        torch.testing.assert_close(trained[name], tensor, rtol=1e-10, atol=1e-12, msg=name)
    first = next(iter(reference))
    assert not torch.equal(reference[first], _example().model(torch.float64).state_dict()[first])


def test_two_agents_c10d_restart_after_a_rank_is_killed_and_match_one_process(
    tmp_path: Path,
) -> None:
    # Two agents meet by c10d rendezvous (pp=2 x dp=2 across them). Global rank 3 dies
    # before step 1 of window 1 (the second window, half done); with --max-restarts 1
    # every worker restarts, resumes from window 0's committed checkpoint by itself, and
    # the job ends equal to one process that was never interrupted. One job checks both
    # the multi-node launch and the restart: each costs about 20 s of two busy cores.
    kill = {
        "PIPESCHED_EXAMPLE_KILL_AT": "1,1,3",
        # Without it the restarted workers can read the first attempt's gloo addresses
        # from the agents' shared store (pytorch/pytorch#135712); docs/distributed.md.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    output = _assert_ran(_two_nodes(tmp_path, kill, max_restarts=1))
    assert "pp=2 x dp=2" in output and f"step {2 * WINDOWS} | loss" in output
    assert "rank 3: killed in window 1, step 1" in output
    assert f"resumed from {tmp_path / 'ckpt'} at step 2" in output
    _assert_equal(model_state(str(tmp_path / "ckpt")), _reference(WINDOWS))
