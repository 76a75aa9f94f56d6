"""FSDP2 for pipeline stages: gradients accumulated unsharded, reduce-scattered once on demand.

Why private calls: FSDP2 reduce-scatters from autograd hooks at the end of a
backward, but a pipeline stage runs many backwards per window (and, split, its
weight gradients after them). As ``torch.distributed.pipelining`` does, each
stage accumulates with the reduction off, and the window's end runs the param
groups' ``post_backward`` and the root's final callback by hand.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["accumulate", "reduce_scatter", "shard"]

# A stage's parameters are gathered before each step and stay so through its backwards:
# the pre-backward all-gather this warns that an in-place op on an output view would skip
# has nothing to do here.
warnings.filterwarnings(
    "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
)


def shard(
    modules: list[nn.Module], used: list[nn.Parameter], mesh: DeviceMesh
) -> tuple[list[FSDPModule], list[nn.Parameter]]:
    """``modules`` sharded over ``mesh`` (FSDP2), gathered through steps, summing gradients.

    Args:
        modules: the modules registering a rank's stages' parameters (each stage,
            or a traced stage's owners); ``used`` of their parameters become
            sharded DTensors, the others (another rank's) stay as they are.
        mesh: the ranks that hold a copy of the stages (their replicas): 1-D, or
            2-D (replicate, shard) for HSDP.

    Returns:
        The roots (the modules no other of ``modules`` contains), each sharded
        with what it contains: one param group, so one reduce-scatter, each.
        And the parameters of ``used`` left whole: those two roots share (a
        weight tied between two stages of the rank), which FSDP2 would split
        into two parameters.
    """
    inside = {id(m): {id(c) for c in m.modules()} - {id(m)} for m in modules}
    roots = [m for m in modules if not any(id(m) in inside[id(o)] for o in modules)]
    holders: dict[int, int] = {}
    for root in roots:
        for p in root.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    whole = [p for p in used if holders.get(id(p), 0) > 1]
    keep = {id(p) for p in used} - {id(p) for p in whole}
    sharded: list[FSDPModule] = []
    for root in roots:
        ignored = {p for p in root.parameters() if id(p) not in keep}
        if not any(id(p) in keep for p in root.parameters()):
            continue
        fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None)
        # Now, not at the first forward: a traced stage calls its graph, not the module.
        fully_shard.state(root)._lazy_init()  # type: ignore[attr-defined]
        root.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # a sum
        # A plain SUM, not NCCL's PreMulSum (gloo has none): the factor is 1 anyway.
        root.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        accumulate(root)  # type: ignore[arg-type]
        sharded.append(root)  # type: ignore[arg-type]
    return sharded, whole


def accumulate(module: FSDPModule) -> None:
    """Backwards add into the unsharded gradients and keep the parameters unsharded."""
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)


def reduce_scatter(module: FSDPModule, replicas: Any) -> int:
    """Reduce-scatters the accumulated gradients into the sharded ``.grad``; reshards.

    A param group no backward reached is a no-op. First the ``replicas`` (the
    process group of every rank holding a part of ``module``) agree on which
    parameters have a gradient: one a replica did not reach (a branch only
    another replica's data took) gets zeros there, so every rank reduces the
    same tensors; one no replica reached keeps ``grad is None``. Returns the
    number of param groups (a reduce-scatter each, where they have gradients).
    """
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    groups = [g for each in state._state_ctx.all_states for g in each._fsdp_param_groups]
    params = [fsdp_param.unsharded_param for g in groups for fsdp_param in g.fsdp_params]
    if params:
        device = params[0].device
        reached = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        reached = reached.to(device)
        dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=replicas)
        with torch.no_grad():
            for p, anywhere in zip(params, reached.tolist(), strict=True):
                if anywhere and p.grad is None:
                    p.grad = torch.zeros_like(p)
    for group in groups:
        group.post_backward()
    state._root_post_backward_final_callback()
    module.reshard()
    accumulate(module)
    return len(groups)
