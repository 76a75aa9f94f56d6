"""Replicas made one model at the build: replica 0's parameters and buffers, as DDP does."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.errors import ConfigError
from pipesched.runtime.mesh import MeshInfo, wait_kept
from pipesched.runtime.placement import is_traced, stage_holders

__all__ = ["sync_replicas"]


def sync_replicas(info: MeshInfo, stages: dict[int, nn.Module]) -> None:
    """Gives this rank's stages the parameters and buffers replica 0's hold, as DDP does
    at construction: replicas built with other weights (another seed) would otherwise
    train apart for good, each window's averaged gradient applied to other weights."""
    tensors: dict[int, torch.Tensor] = {}
    for stage in stages.values():
        traced = is_traced(stage)
        for holder in stage_holders(stage):
            for t in [*holder.parameters(recurse=not traced), *holder.buffers(recurse=not traced)]:
                if t.device.type != "meta":  # (a meta build's tensors are made alike)
                    tensors.setdefault(id(t), t)
    layout = [(tuple(t.shape), str(t.dtype)) for t in tensors.values()]
    layouts: list[Any] = [None] * info.dp_size
    dist.all_gather_object(layouts, layout, group=info.dp_group)
    other = next((d for d, seen in enumerate(layouts) if seen != layouts[0]), None)
    if other is not None:
        first = next(
            (k for k, (a, b) in enumerate(zip(layouts[0], layouts[other], strict=False)) if a != b),
            min(len(layouts[0]), len(layouts[other])),
        )
        raise ConfigError(
            f"replica {other} of pp rank {info.pp_rank} holds other stages than replica 0: "
            f"{len(layouts[other])} parameters and buffers against {len(layouts[0])}, the "
            f"first that differs #{first} "
            f"({_shown(layouts[other], first)} against {_shown(layouts[0], first)}); every "
            "replica must build the same model"
        )
    with torch.no_grad():
        for t in tensors.values():  # replica 0 of this pp rank: global rank pp_rank
            wait_kept(dist.broadcast(t, src=info.pp_rank, group=info.dp_group, async_op=True))


def _shown(layout: list[Any], k: int) -> str:
    return "none" if k >= len(layout) else f"shape {list(layout[k][0])} {layout[k][1]}"
