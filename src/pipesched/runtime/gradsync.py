"""What replicas and pipeline ranks agree on once per window: gradients, counts, norms.

Once per accumulation window, never per step; a stage's all-reduces start as
soon as its last backward of the window's last step is done, overlapped with
the rest of the step. :class:`LocalSync` is the identity, so one
:class:`~pipesched.GradientAccumulator` serves both.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipesched.runtime.compat.fsdp import reduce_scatter, shard
from pipesched.runtime.mesh import MeshInfo, wait_kept
from pipesched.runtime.placement import record_replacement, stage_holders, stage_parameters
from pipesched.runtime.replicas import sync_replicas

__all__ = ["BUCKET_BYTES", "GradientSync", "LocalSync", "Sync"]

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce (as DDP's default bucket_cap_mb)."""


class Sync(Protocol):
    """What a pipeline's replicas and ranks reduce at a window's end."""

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over data-parallel replicas."""

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""

    def failed_rank(self, ok: bool) -> int | None:
        """A global rank where ``ok`` is False (the highest), or None where it holds on every
        rank: :meth:`all_true` that names a rank."""

    def gradients(self) -> None:
        """Sums gradients over replicas (and over ranks that share a parameter)."""

    def before_step(self) -> None:
        """Readies the stages for a step: sharded stages gather their parameters."""

    def started(self) -> None:
        """The step's snapshot is taken: stages sharded per action shard their parameters."""

    def after_step(self, committed: bool) -> None:
        """After a step (``committed``, or put back): sharded stages shard their parameters
        again, reduce-scattering the window's gradients after its last step."""

    def window_ends(self, ending: bool = True) -> None:
        """The next step is the window's last: reductions may start as its stages finish.

        ``window_ends(False)`` takes it back (the step failed before running).
        """

    def drop_started(self) -> None:
        """The running step was put back: the reductions it started are not the window's."""

    def stage_done(self, stage: int) -> None:
        """Called when ``stage`` has run its last backward action of a step."""

    @property
    def summing_in_step(self) -> bool:
        """Whether the running step sums gradients over replicas as its stages finish."""

    def norm(self, parameters: list[nn.Parameter]) -> float:
        """The global 2-norm of all gradients of the whole model."""

    def summed_gradients(self, parameters: list[nn.Parameter]) -> dict[int, torch.Tensor]:
        """Copies of the window's gradients so far, summed as its end would; ``.grad`` untouched.

        Keyed by ``id(parameter)``, for those of ``parameters`` this rank
        computes with that have a gradient on some replica (a checkpoint
        taken mid-window holds the window's one logical gradient).
        """


class LocalSync:
    """One process holds the whole model and the only replica: everything is the identity."""

    def sum(self, values: list[float]) -> list[float]:
        return values

    def all_true(self, flag: bool) -> bool:
        return flag

    def failed_rank(self, ok: bool) -> int | None:
        return None if ok else 0

    def gradients(self) -> None:
        return None

    def before_step(self) -> None:
        return None

    def started(self) -> None:
        return None

    def after_step(self, committed: bool) -> None:
        return None

    def window_ends(self, ending: bool = True) -> None:
        return None

    def stage_done(self, stage: int) -> None:
        return None

    def drop_started(self) -> None:
        return None

    @property
    def summing_in_step(self) -> bool:
        return False

    def norm(self, parameters: list[nn.Parameter]) -> float:
        grads = [
            g if g.layout == torch.strided else g.coalesce().values()  # sparse: its values
            for g in (p.grad for p in parameters)
            if g is not None
        ]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def summed_gradients(self, parameters: list[nn.Parameter]) -> dict[int, torch.Tensor]:
        return {id(p): p.grad.detach().clone() for p in parameters if p.grad is not None}


class GradientSync:
    """Reductions over the mesh for one rank's parameters.

    Args:
        info: this rank's place in the mesh.
        model: the pipeline, whose parameters come in an order every replica
            shares; only those this rank's stages compute with are reduced (a
            traced model's pipeline also holds other ranks' ones, on "meta").
        tied: for each parameter shared with stages on other pp ranks, the
            sorted pp ranks that hold it.
        stages: this rank's stages by index. A stage's own parameters (no
            other stage holds them) form its buckets, reduced as soon as the
            stage is done in a window's last step; the rest are reduced at the
            window's end. On a mesh with ``shard_mesh``, each stage is sharded
            (FSDP2) here, before anything reads its parameters: it keeps them
            gathered through a window and reduce-scatters once, at its end.
    """

    def __init__(
        self,
        info: MeshInfo,
        model: nn.Module,
        tied: dict[int, tuple[int, ...]],
        stages: dict[int, nn.Module],
    ) -> None:
        before = {s: stage_parameters(stage) for s, stage in stages.items()}
        if info.dp_size > 1:
            sync_replicas(info, stages)
        self.sharded: list[Any] = []
        whole: list[nn.Parameter] = []  # left whole on a sharded mesh: all-reduced
        if info.shard_mesh is not None:  # this rank's stages' modules, each once
            holders = {id(m): m for stage in stages.values() for m in stage_holders(stage)}
            shared = [p for params in before.values() for p in params]
            self.sharded, whole = shard(list(holders.values()), shared, info.shard_mesh)
        used = {s: stage_parameters(stage) for s, stage in stages.items()}
        if self.sharded:  # the shards replace the parameters: where tied too, and in ``tied``
            new = {id(o): n for s in stages for o, n in zip(before[s], used[s], strict=True)}
            _replace(model, new)
            for s in stages:  # (an optimizer built before the Pipeline follows them)
                for o, n in zip(before[s], used[s], strict=True):
                    if n is not o:
                        record_replacement(o, n)
            tied = {id(new[k]) if k in new else k: ranks for k, ranks in tied.items()}
        mine = {id(p) for params in used.values() for p in params}
        owners = {s: {id(m) for m in stage_holders(stage)} for s, stage in stages.items()}
        self._stage_groups = {  # what each stage gathers around its actions (reshard="action")
            s: [g for g in self.sharded if any(id(m) in ids for m in cast(nn.Module, g).modules())]
            for s, ids in owners.items()
        }
        self.per_action = bool(self.sharded) and info.reshard == "action"
        self.info = info
        self.parameters = [p for p in model.parameters() if id(p) in mine]
        self._whole = {id(p) for p in whole}
        self.tied = tied
        self.all_reduces = 0  # gradient all-reduces run so far (tests count them)
        self.reduce_scatters = 0  # of sharded stages' param groups (tests count them)
        self.overlapped = 0  # of which started before the window's end (tests count them)
        self._stage_buckets, self._rest = _stage_buckets(self.parameters, used, tied)
        self._armed = False
        self._reduce_after_step = False
        self._in_flight: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []
        self._dropped: deque[Any] = deque(maxlen=64)  # freed by Python, not gloo's thread
        self.highest: Callable[..., int] | None = None
        """The pipeline runtime's agreement (``DistributedRuntime.highest``), given once it
        is built: :meth:`failed_rank` then runs over the pipeline's own group, a lost or hung
        rank raised as a ``RemoteError``, the default group left usable."""
        # One group per set of pp ranks sharing parameters, for each replica. Every rank
        # creates every group in the same order, as new_group requires; but only the ranks
        # of a pipeline know its tied sets, so they are gathered first.
        sets: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sets, sorted(set(tied.values())))
        self._tied_groups: dict[tuple[int, ...], Any] = {}
        for ranks in sorted({tuple(r) for per_rank in sets for r in per_rank}):
            for d in range(info.dp_size):
                group = dist.new_group(
                    [d * info.pp_size + r for r in ranks], timeout=timedelta(seconds=info.timeout)
                )
                if d == info.dp_rank and info.pp_rank in ranks:
                    self._tied_groups[ranks] = group

    def sum(self, values: list[float]) -> list[float]:
        if self.info.dp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.info.device)
        wait_kept(dist.all_reduce(t, group=self.info.dp_group, async_op=True))
        return [float(v) for v in t.tolist()]

    def all_true(self, flag: bool) -> bool:
        return self.failed_rank(flag) is None

    def failed_rank(self, ok: bool) -> int | None:
        mine = 0 if ok else dist.get_rank() + 1
        if self.highest is not None:  # over the pipeline's own groups, failures explained
            found = self.highest(
                mine, replicas=True, doing="waiting for the other ranks to end the window"
            )
        else:
            t = torch.tensor([mine], dtype=torch.int64, device=self.info.device)
            wait_kept(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
            found = int(t.item())
        return None if found == 0 else found - 1

    def gradients(self) -> None:
        """All-reduces this rank's gradients over "dp", in buckets; tied ones over their pp ranks.

        A parameter with no gradient on every replica keeps ``grad is None``.
        Waits for the all-reduces started during the step, then runs the rest.
        """
        self._armed = False
        if self.sharded and self.info.dp_size > 1:  # what the shards left whole
            kept = [p for p in self.parameters if id(p) in self._whole]
            for bucket in _buckets(kept, BUCKET_BYTES):
                self._start(bucket, self.info.dp_group)
            self._finish_in_flight()
        if self.info.dp_size > 1 and not self.sharded:
            started = {id(p) for params, _, _ in self._in_flight for p in params}
            for stage_buckets in self._stage_buckets.values():
                for bucket in stage_buckets:
                    if id(bucket[0]) not in started:
                        self._start(bucket, self.info.dp_group)
            for bucket in self._rest:
                self._start(bucket, self.info.dp_group)
            self._finish_in_flight()
        for ranks, group in self._tied_groups.items():
            shared = [p for p in self.parameters if self.tied.get(id(p)) == ranks]
            for bucket in _buckets(shared, BUCKET_BYTES):
                self._start(bucket, group)
            self._finish_in_flight()

    def before_step(self) -> None:
        for stage in self.sharded:
            stage.unshard()  # the step's parameters: what its snapshot sets aside

    def started(self) -> None:
        if self.per_action:  # each stage gathers them again around each of its actions
            for stage in self.sharded:
                stage.reshard()

    def around_action(self, stage: int, starting: bool) -> None:
        """Gathers ``stage``'s parameters before an action of it, shards them after."""
        for group in self._stage_groups.get(stage, ()):
            if starting:
                group.unshard()
            else:
                group.reshard()

    def after_step(self, committed: bool) -> None:
        # Between steps a sharded stage holds its shards (the optimizer's parameters); the
        # window's gradients so far stay on the gathered parameters, hidden, until its end.
        reduce = committed and self._reduce_after_step
        if committed:  # a step put back is run again (a rerun), or the window's end is undone
            self._reduce_after_step = False
        for stage in self.sharded:
            if reduce:
                self.reduce_scatters += reduce_scatter(stage, self.info.dp_group)
            else:
                stage.reshard()

    def window_ends(self, ending: bool = True) -> None:
        # A sharded stage reduce-scatters after the window's last step: outside its
        # transaction, into the shards the window's end then reads.
        self._reduce_after_step = ending and bool(self.sharded)
        self._armed = ending and self.info.dp_size > 1 and not self.sharded

    def drop_started(self) -> None:
        # Kept, not waited for: a failed replica may never answer (a rerun's own
        # reductions follow these on the same groups, in the same order on every replica).
        self._dropped.extend(work for _, _, work in self._in_flight)
        self._in_flight = []

    @property
    def summing_in_step(self) -> bool:
        return self._armed

    def stage_done(self, stage: int) -> None:
        if not self._armed:
            return
        for bucket in self._stage_buckets.get(stage, ()):
            self._start(bucket, self.info.dp_group)
            self.overlapped += 1

    def summed_gradients(self, parameters: list[nn.Parameter]) -> dict[int, torch.Tensor]:
        wanted = {id(p) for p in parameters}
        saved = [(p, p.grad) for p in self.parameters]
        kept = (self.all_reduces, self.overlapped, self._armed)
        try:  # the window's own reductions, run on copies: .grad is put back after
            for p in self.parameters:
                p.grad = None if p.grad is None else p.grad.detach().clone()
            self.gradients()
            return {
                id(p): p.grad for p in self.parameters if id(p) in wanted and p.grad is not None
            }
        finally:
            for p, grad in saved:
                p.grad = grad
            self.all_reduces, self.overlapped, self._armed = kept

    def _start(self, params: list[nn.Parameter], group: Any) -> None:
        """Starts one all-reduce (SUM) of these parameters' gradients and has-gradient flags."""
        device = self.info.device
        flat = [
            _local(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device)
            for p in params
        ]
        present = torch.tensor(
            [p.grad is not None for p in params], dtype=params[0].dtype, device=device
        )
        buffer = torch.cat([*flat, present])
        work = dist.all_reduce(buffer, group=group, async_op=True)
        self.all_reduces += 1
        self._in_flight.append((params, buffer, work))

    def _finish_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        for params, buffer, work in in_flight:
            work.wait()
            self._unpack(params, buffer)

    def _unpack(self, params: list[nn.Parameter], buffer: torch.Tensor) -> None:
        offset = 0
        for p, any_grad in zip(params, buffer[-len(params) :].tolist(), strict=True):
            local = _local(p)
            n = local.numel()
            if any_grad:
                summed = buffer[offset : offset + n].view_as(local).to(local.device)
                if local is p:
                    p.grad = summed.clone()
                else:  # a shard: a new DTensor gradient (the old one may be put back)
                    grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                    _local(grad).copy_(summed)
                    p.grad = grad
            offset += n

    def norm(self, parameters: list[nn.Parameter]) -> float:
        # [whole, sharded]: each replica holds the same whole gradients, and its own shards.
        squares = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        for p in parameters:
            ranks = self.tied.get(id(p))
            if p.grad is None or (ranks is not None and ranks[0] != self.info.pp_rank):
                continue  # a shared parameter counts once, on the first rank holding it
            sharded = isinstance(p.grad, DTensor)  # else whole (a weight tied within a rank)
            squares[int(sharded)] += _local(p.grad.detach()).double().pow(2).sum()
        if self.sharded:  # over the ranks of a shard group (HSDP: its innermost dim)
            mesh = self.info.shard_mesh
            group = mesh.get_group(mesh.ndim - 1)  # type: ignore[union-attr]
            wait_kept(dist.all_reduce(squares[1:], group=group, async_op=True))
        wait_kept(dist.all_reduce(squares, group=self.info.pp_group, async_op=True))
        return math.sqrt(float(squares.sum()))


def _replace(model: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Registers each of ``new`` (by the id of the parameter it replaces) wherever that was."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in new and new[id(p)] is not p:
                module.register_parameter(name, new[id(p)])


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its shard where ``t`` is a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _stage_buckets(
    parameters: list[nn.Parameter],
    stages: dict[int, list[nn.Parameter]],
    tied: dict[int, tuple[int, ...]],
) -> tuple[dict[int, list[list[nn.Parameter]]], list[list[nn.Parameter]]]:
    """Buckets of each stage's own parameters, and buckets of the others, in ``parameters`` order.

    A stage's own parameters: no other stage of this rank holds them and no
    other pp rank shares them, so they are final once the stage is done.
    """
    holders: dict[int, list[int]] = {}
    for s, used in stages.items():
        for p in used:
            holders.setdefault(id(p), []).append(s)
    own: dict[int, list[nn.Parameter]] = {s: [] for s in stages}
    rest: list[nn.Parameter] = []
    for p in parameters:
        users = holders.get(id(p), [])
        if len(users) == 1 and id(p) not in tied:
            own[users[0]].append(p)
        else:
            rest.append(p)
    return {s: _buckets(ps, BUCKET_BYTES) for s, ps in own.items() if ps}, _buckets(
        rest, BUCKET_BYTES
    )


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
