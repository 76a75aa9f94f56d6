"""One rank of tests/distributed/test_fsdp.py: pp=2 x dp=2 with each stage sharded (FSDP2).

``python fsdp_worker.py CONFIGS OUT`` under torchrun's environment, 4 ranks. CONFIGS
is ``model:schedule:checkpoint`` items joined by ``,``; each trains WINDOWS windows
of sharded_worker.STEPS steps (AdamW, clipping, a scheduler) on a sharded mesh, and
``model:1f1b:never:whole`` on the replicated one. Each rank writes, per config, the
full parameters it holds, its parameter + gradient + optimizer-state bytes after the
last window's optimizer step (its gradients and
the state of the window before), and the reduce-scatters and all-reduces it ran.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipesched import GradientAccumulator, Pipeline
from pipesched.runtime.mesh import init_mesh
from tests.distributed import sharded_worker as w

WINDOWS = 3
PP, DP = 2, 2
BALANCE = {2: [4, 4], 4: [2, 2, 2, 2]}


def pipeline(name: str, schedule: str, checkpoint: str, mesh: Any) -> Pipeline:
    stages = 4 if schedule in ("interleaved-1f1b", "zb-v") else 2
    if name == "traced":
        return Pipeline(
            w.tied_lm(), 2, split_points=["fc2"], mesh=mesh, num_stages=2,
            example_inputs=(w.tokens(0)[0][:2],), schedule=schedule, checkpoint=checkpoint,
        )  # fmt: skip
    return Pipeline(
        w.mlp(0.0), 2, balance=BALANCE[stages], mesh=mesh, schedule=schedule,
        checkpoint=checkpoint,
    )  # fmt: skip


def local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def held_bytes(acc: GradientAccumulator) -> int:
    """This rank's parameter + gradient + optimizer-state bytes."""
    params = [p for p in acc.pipe.parameters() if not p.is_meta]
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        v
        for opt in acc.optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return local_bytes(params) + local_bytes(grads) + local_bytes(state)


def run(config: str, rank: int) -> dict[str, Any]:
    name, schedule, checkpoint, *whole = config.split(":")
    mesh = init_mesh(pp=PP, dp=DP, shard=1 if whole else DP, timeout=60)
    pipe = pipeline(name, schedule, checkpoint, mesh)
    acc = w.accumulator(pipe)
    optimizer = acc.optimizers[0]
    step, held = optimizer.step, []

    def measured(*args: Any, **kwargs: Any) -> Any:
        held.append(held_bytes(acc))  # the window's gradients are there, and the state
        return step(*args, **kwargs)

    optimizer.step = measured  # type: ignore[method-assign]
    w.train(acc, range(WINDOWS * w.STEPS), mesh.get_local_rank("dp"), DP)
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in pipe.named_parameters()
        if not p.is_meta
    }
    sync = pipe._cuts.current[1].sync  # the engine's GradientSync
    result = {
        "params": params,
        "bytes": held[-1],
        "reduce_scatters": sync.reduce_scatters,
        "all_reduces": sync.all_reduces,
        "sharded": [type(s).__name__ for s in sync.sharded],
        "optimizer_state": len(optimizer.state),
    }
    del acc, pipe
    gc.collect()
    return result


def main(configs: str, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    init_mesh(pp=PP, dp=DP, timeout=60)  # the process group
    rank = dist.get_rank()
    results = {config: run(config, rank) for config in configs.split(",")}
    torch.save(results, out / f"rank{rank}.pt")
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
