"""What replicas and pipeline ranks agree on once per window: gradients, counts, norms.

Once per accumulation window, never per step: each stage's gradients are
all-reduced over the "dp" dimension in buckets (parameters shared by stages
on different pp ranks are summed over those ranks too); item counts and
losses are summed over "dp"; the inf/NaN verdict and the squared gradient
norm are combined over every rank. The local runtime uses :class:`LocalSync`,
where all of this is the identity, so :class:`GradientAccumulator` is one
class for both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipesched.distributed.mesh import MeshInfo

__all__ = ["BUCKET_BYTES", "GradientSync", "LocalSync", "Sync"]

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce (as DDP's default bucket_cap_mb)."""


class Sync(Protocol):
    """What a pipeline's replicas and ranks reduce at a window's end."""

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over data-parallel replicas."""

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""

    def gradients(self) -> None:
        """Sums gradients over replicas (and over ranks that share a parameter)."""

    def norm(self, parameters: list[nn.Parameter]) -> float:
        """The global 2-norm of all gradients of the whole model."""


class LocalSync:
    """One process holds the whole model and the only replica: everything is the identity."""

    def sum(self, values: list[float]) -> list[float]:
        return values

    def all_true(self, flag: bool) -> bool:
        return flag

    def gradients(self) -> None:
        return None

    def norm(self, parameters: list[nn.Parameter]) -> float:
        grads = [p.grad for p in parameters if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


class GradientSync:
    """Reductions over the mesh for one rank's parameters.

    Args:
        info: this rank's place in the mesh.
        parameters: this rank's parameters, in an order every replica shares.
        tied: for each parameter shared with stages on other pp ranks, the
            sorted pp ranks that hold it.
    """

    def __init__(
        self, info: MeshInfo, parameters: Iterable[nn.Parameter], tied: dict[int, tuple[int, ...]]
    ) -> None:
        self.info = info
        self.parameters = list(parameters)
        self.tied = tied
        self.all_reduces = 0  # gradient all-reduces run so far (tests count them)
        # One group per set of pp ranks sharing parameters, for each replica. Every rank
        # creates every group in the same order, as new_group requires; but only the ranks
        # of a pipeline know its tied sets, so they are gathered first.
        sets: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sets, sorted(set(tied.values())))
        self._tied_groups: dict[tuple[int, ...], Any] = {}
        for ranks in sorted({tuple(r) for per_rank in sets for r in per_rank}):
            for d in range(info.dp_size):
                group = dist.new_group([d * info.pp_size + r for r in ranks])
                if d == info.dp_rank and info.pp_rank in ranks:
                    self._tied_groups[ranks] = group

    def sum(self, values: list[float]) -> list[float]:
        if self.info.dp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t, group=self.info.dp_group)
        return [float(v) for v in t.tolist()]

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=self.info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) == 0

    def gradients(self) -> None:
        """All-reduces this rank's gradients over "dp", in buckets; tied ones over their pp ranks.

        A parameter with no gradient on every replica keeps ``grad is None``.
        """
        if self.info.dp_size > 1:
            for bucket in _buckets(self.parameters, BUCKET_BYTES):
                self._reduce(bucket, self.info.dp_group)
        for ranks, group in self._tied_groups.items():
            shared = [p for p in self.parameters if self.tied.get(id(p)) == ranks]
            for bucket in _buckets(shared, BUCKET_BYTES):
                self._reduce(bucket, group)

    def _reduce(self, params: list[nn.Parameter], group: Any) -> None:
        """One all-reduce (SUM) of these parameters' gradients and a has-gradient flag each."""
        device = self.info.device
        flat = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device)
            for p in params
        ]
        present = torch.tensor(
            [p.grad is not None for p in params], dtype=params[0].dtype, device=device
        )
        buffer = torch.cat([*flat, present])
        dist.all_reduce(buffer, group=group)
        self.all_reduces += 1
        offset = 0
        for p, any_grad in zip(params, buffer[-len(params) :].tolist(), strict=True):
            n = p.numel()
            if any_grad:
                p.grad = buffer[offset : offset + n].view_as(p).to(p.device).clone()
            offset += n

    def norm(self, parameters: list[nn.Parameter]) -> float:
        squares = torch.zeros((), dtype=torch.float64, device=self.info.device)
        for p in parameters:
            ranks = self.tied.get(id(p))
            if p.grad is None or (ranks is not None and ranks[0] != self.info.pp_rank):
                continue  # a shared parameter counts once, on the first rank holding it
            squares += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(squares, group=self.info.pp_group)
        return math.sqrt(float(squares))


def _buckets(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype, up to ``limit`` bytes of gradients each."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
