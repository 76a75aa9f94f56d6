"""Whole tensors to and from the shards a sharded mesh's stages hold (FSDP2 DTensors).

Why whole: a checkpoint holds the model under its plain names, readable at any
layout and in one process. A save gathers each shard whole (a collective over the
stage's replicas, one tensor at a time); a load keeps this rank's part of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["gathered", "like_live", "optimizer_like_live"]


def gathered(value: Any) -> Any:
    """``value`` whole: a DTensor's full tensor (every replica calls it, in one order)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def like_live(value: Any, live: Any) -> Any:
    """A loaded whole tensor as ``live`` holds it: this rank's shard where ``live`` is one."""
    if not isinstance(live, DTensor) or isinstance(value, DTensor):
        return value
    local = value.to(device=live.device, dtype=value.dtype)
    return distribute_tensor(local, live.device_mesh, live.placements, src_data_rank=None)


def optimizer_like_live(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> dict[str, Any]:
    """An optimizer ``state_dict`` whose per-parameter tensors are shaped as its parameters.

    A tensor of a parameter's shape is sharded as that parameter is; step
    counts and other scalars stay as they are.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_parameter = {
        index: {
            key: like_live(v, params[index])
            if isinstance(v, torch.Tensor) and v.shape == params[index].shape and v.dim() > 0
            else v
            for key, v in entries.items()
        }
        for index, entries in state["state"].items()
    }
    return {**state, "state": per_parameter}
