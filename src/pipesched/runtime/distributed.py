"""The runtime across processes: each rank runs its own worker's actions; values cross by p2p.

It is the local runtime with a few hooks changed: a step starts with the
pipeline's ranks agreeing on its shape and seed (:mod:`pipesched.runtime.agreement`);
only this rank's schedule worker runs here; a value for a stage on another
rank travels by point-to-point (:mod:`pipesched.runtime.p2p`), one for a
stage on this rank (interleaved and V schedules) stays in memory; and a
failure is reported to every rank before this one stops
(:mod:`pipesched.runtime.failures`).

The transfers and the agreement use a process group of the pipeline's own
(its pp ranks, with the mesh's timeout). After a failure that group alone is
closed, which makes every rank waiting on this one fail at once; the default
process group and the mesh's groups stay usable, so the user's own error
handling (``dist.get_rank()``, a barrier, a checkpoint) still works.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.distributed.mesh import MeshInfo, wait_kept
from pipesched.distributed.placement import keep_own_stages
from pipesched.errors import ConfigError, RemoteError
from pipesched.runtime.agreement import StepShape, agreed_seed, mismatch
from pipesched.runtime.failures import Failure, FailureChannel
from pipesched.runtime.fused_linear import unshared_parameters
from pipesched.runtime.local import LocalRuntime, StepInputs, _Run
from pipesched.runtime.p2p import Transport
from pipesched.runtime.streams import Stream
from pipesched.schedule import BACKWARD, FORWARD, Action, Event, Schedule, Timeline

__all__ = ["DistributedRuntime", "broadcast_loss"]

_serials = itertools.count()  # every rank builds its pipelines in the same order


class DistributedRuntime(LocalRuntime):
    """Runs pp rank ``info.pp_rank``'s actions of each schedule.

    Args:
        stages: every stage index's module; only this rank's are used (others None).
        placement: the worker (pp rank) of each stage.
        info: this rank's place in the mesh.
        num_threads: intra-op threads for this rank's worker.
        fused: as in :class:`~pipesched.runtime.local.LocalRuntime`.
        keys: per stage, the keys of the dict it receives (a traced model's
            stages), which crosses ranks as a tuple in this order; None: the
            value travels as it is.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module | None],
        placement: tuple[int, ...],
        info: MeshInfo,
        num_threads: int,
        fused: Sequence[frozenset[int]] | None = None,
        keys: Sequence[tuple[str, ...] | None] | None = None,
        on_stage_done: Callable[[int], None] | None = None,
    ) -> None:
        devices = [info.device] * info.pp_size
        super().__init__(stages, devices, num_threads, fused)  # type: ignore[arg-type]
        self.placement = placement
        self.info = info
        self.failures = FailureChannel(next(_serials), info.pp_rank, info.dp_rank, info.timeout)
        self.group: Any = _pipeline_group(info)
        """This pipeline's own process group (its pp ranks); None once closed after a failure."""
        self.stopped: Failure | None = None
        """Why this pipeline stopped, once a step failed (it cannot run again)."""
        self.transport = Transport(info.pp_ranks, info.device, self.failures, self.group)
        self._num_stages = len(placement)
        self.last_origin_wall = 0.0
        self.on_stage_done = on_stage_done
        """Called with a stage's index once it has run its last backward action of a step."""
        self._last_backward: dict[int, Action] = {}
        self._keys = list(keys) if keys is not None else [None] * len(placement)

    @classmethod
    def on_rank(
        cls,
        stages: Sequence[nn.Module],
        placement: tuple[int, ...],
        info: MeshInfo,
        *,
        fuse: bool,
        on_stage_done: Callable[[int], None] | None = None,
    ) -> tuple[DistributedRuntime, list[int], dict[int, tuple[int, ...]]]:
        """This rank's runtime, its own stages' indices, and its parameters tied to other ranks.

        Keeps this rank's stages on its device and frees the others
        (:func:`~pipesched.distributed.placement.keep_own_stages`); ``fuse``:
        fused weight-gradient accumulation for parameters no other stage holds;
        ``on_stage_done``: called with a stage once it has run its last backward
        action of a step.
        """
        own, tied = keep_own_stages(stages, placement, info.pp_rank, info.device)
        kept = [stage if s in own else None for s, stage in enumerate(stages)]
        fused = unshared_parameters(kept) if fuse else None
        # A traced stage passes a dict: it crosses ranks as a tuple in the sender's key order.
        keys = [None, *(getattr(stage, "sends", None) for stage in stages[:-1])]
        runtime = cls(kept, placement, info, torch.get_num_threads(), fused, keys, on_stage_done)
        return runtime, own, tied

    def run(self, schedule: Schedule, step: StepInputs, *, detach: bool) -> _Run:
        """Agrees on the step with the pipeline's other ranks, then runs this rank's actions.

        Sets ``step.seed`` to the agreed seed
        (:func:`~pipesched.runtime.agreement.agreed_seed`).

        Raises:
            ConfigError: the ranks disagree on the step (every rank raises it,
                before any transfer; the pipeline stays usable).
            RemoteError: another rank failed, died or did not answer; or this
                pipeline stopped after an earlier failure.
        """
        if self.stopped is not None:
            raise RemoteError(
                "pipesched: this pipeline stopped after a failed step and its connections to "
                f"the other ranks are closed ({self.stopped.summary}); build a new Pipeline "
                "on every rank, or restart the job from a checkpoint",
                **self.stopped.facts(),
            )
        shape = StepShape.of(
            schedule,
            training=step.loss_fn is not None,
            has_target=step.targets is not None,
            seed=step.seed or 0,  # 0: this rank drew none
            weights=step.loss_weights,
        )
        shapes = self._exchange(shape)
        problem = mismatch(shapes)
        if problem is not None:
            raise ConfigError(f"the ranks of this pipeline disagree on the step: {problem}")
        step.seed = agreed_seed(shapes) or None
        return super().run(schedule, step, detach=detach)

    def _exchange(self, shape: StepShape) -> list[StepShape]:
        """Every pp rank's shape of this step: one all-gather over the pipeline's group."""
        mine = shape.encode().to(self.info.device)
        gathered = [torch.empty_like(mine) for _ in range(self.info.pp_size)]
        start = time.monotonic()
        try:
            dist.all_gather(gathered, mine, group=self.group)
        except Exception as error:
            failure = self.failures.first()
            if failure is None:
                others = [r for r in range(self.info.pp_size) if r != self.info.pp_rank]
                peer = others[0] if len(others) == 1 else None
                what = "waiting for the other ranks to start the step"
                rank = None if peer is None else self.info.pp_ranks[peer]
                failure = self.failures.lost(error, time.monotonic() - start, what, peer, rank)
            self._stop(failure)
            raise failure.error() from error
        return [StepShape.decode(t.tolist()) for t in gathered]

    def workers(self, schedule: Schedule) -> list[int]:
        _check_channel_order(schedule)
        return [self.info.pp_rank]

    def _local(self, stage: int) -> bool:
        return self.placement[stage] == self.info.pp_rank

    def _tag(self, kind: str, stage: int, microbatch: int) -> int:
        return (microbatch * self._num_stages + stage) * 2 + (kind == BACKWARD)

    def start_step(self, schedule: Schedule, rows: dict[int, list[Action]]) -> None:
        """Posts the first receive of each channel; each receive posts the next.

        The data of a transfer then moves while this rank computes, instead of
        after it asks for it.
        """
        receives: dict[Hashable, list[tuple[int, int]]] = {}
        self._last_backward = {a.stage: a for a in rows[self.info.pp_rank] if a.kind != FORWARD}
        for a in rows[self.info.pp_rank]:
            if a.kind == FORWARD and a.stage > 0:
                source = a.stage - 1
            elif a.kind == BACKWARD and a.stage < self._num_stages - 1:
                source = a.stage + 1
            else:
                continue
            if not self._local(source):
                tag = self._tag(a.kind, a.stage, a.microbatch)
                receives.setdefault((a.kind, a.stage), []).append((self.placement[source], tag))
        try:
            self.transport.plan(receives)
        except RemoteError as error:
            self._stop(Failure.of(error), report=False)
            raise

    def _backward(self, action: Action, w: int, schedule: Schedule, run: _Run) -> float:
        start = super()._backward(action, w, schedule, run)
        self._after_backward(action)
        return start

    def _weight(self, action: Action, w: int, schedule: Schedule, run: _Run) -> float:
        start = super()._weight(action, w, schedule, run)
        self._after_backward(action)
        return start

    def _after_backward(self, action: Action) -> None:
        if self.on_stage_done is not None and self._last_backward.get(action.stage) == action:
            self.on_stage_done(action.stage)  # its gradients are final for this step

    def take(self, run: _Run, kind: str, stage: int, microbatch: int, stream: Stream) -> Any:
        source = stage - 1 if kind == FORWARD else stage + 1
        if self._local(source):
            return super().take(run, kind, stage, microbatch, stream)
        what = (
            f"the activation of micro-batch {microbatch} for stage {stage}"
            if kind == FORWARD
            else f"the gradient of micro-batch {microbatch} for stage {stage}"
        )
        value = self.transport.recv(
            self.placement[source], (kind, stage), self._tag(kind, stage, microbatch), what
        )
        keys = self._keys[stage]
        return dict(zip(keys, value, strict=True)) if kind == FORWARD and keys else value

    def put(
        self, run: _Run, kind: str, stage: int, microbatch: int, value: Any, stream: Stream
    ) -> None:
        if self._local(stage):
            super().put(run, kind, stage, microbatch, value, stream)
            return
        keys = self._keys[stage]
        if kind == FORWARD and keys and isinstance(value, dict):
            value = tuple(value[k] for k in keys)
        source = stage - 1 if kind == FORWARD else stage + 1
        what = f"stage {source}" if kind == FORWARD else f"the backward of stage {source}"
        self.transport.send(
            value, self.placement[stage], (kind, stage), self._tag(kind, stage, microbatch), what
        )

    def on_failure(self, error: BaseException, action: Action) -> None:
        if isinstance(error, RemoteError):  # reported by whoever saw it first
            self._stop(Failure.of(error), report=False)
            return
        rank, info = dist.get_rank(), self.info
        message = str(error)
        self._stop(
            Failure(
                "error",
                f"rank {rank} (pp {info.pp_rank}, dp {info.dp_rank}) failed in action {action} "
                f"(stage {action.stage}, micro-batch {action.microbatch}): "
                f"{type(error).__name__}: {message}",
                rank=rank,
                pp_rank=info.pp_rank,
                dp_rank=info.dp_rank,
                action=str(action),
                error_type=type(error).__name__,
                error_message=message,
            )
        )

    def _stop(self, failure: Failure, *, report: bool = True) -> None:
        """Reports ``failure`` (unless ``report`` is False) and closes this pipeline's group.

        Closing it makes every rank blocked on this one fail now instead of at
        the timeout. Only this pipeline's group is closed: the default process
        group and the mesh's groups stay usable for the caller's own handling.
        """
        if report:
            self.failures.report(failure)
        self.stopped = failure
        group, self.group = self.group, None
        self.transport.drop()
        if group is not None:
            with contextlib.suppress(Exception):  # never hide the error being reported
                dist.destroy_process_group(group)
            del group
            gc.collect()  # the connections close when the last reference goes

    def finish_step(self, run: _Run) -> None:
        self.last_origin_wall = run.origin_wall
        if run.error is None:
            try:
                self.transport.finish()
            except RemoteError as error:
                self._stop(Failure.of(error), report=False)
                raise

    def gather_timeline(self, timeline: Timeline) -> Timeline | None:
        """Every pp rank's events of ``timeline``'s step, on pp rank 0 (None on the others).

        A collective over the pipeline's ranks. Clocks are aligned by each
        rank's wall-clock time at the step's start: exact on one machine,
        within the machines' clock skew (NTP: about a millisecond) across
        machines.
        """
        mine = (self.last_origin_wall, [tuple(e) for e in timeline.events])
        gathered: list[Any] = [None] * self.info.pp_size
        dist.all_gather_object(gathered, mine, group=self.info.pp_group)
        if self.info.pp_rank != 0:
            return None
        start = min(origin for origin, _ in gathered)
        events = [
            Event(Action(*action), worker, begin + origin - start, end + origin - start)
            for origin, rank_events in gathered
            for action, worker, begin, end in rank_events
        ]
        return Timeline(tuple(events), self.placement)


def _pipeline_group(info: MeshInfo) -> Any:
    """A new process group of this rank's pipeline, with the mesh's timeout.

    A collective over the whole job: every rank creates every replica's group,
    in the same order, as ``new_group`` requires (ranks laid out as by
    :func:`~pipesched.distributed.mesh.init_mesh`).
    """
    mine = None
    for d in range(info.dp_size):
        ranks = [d * info.pp_size + r for r in range(info.pp_size)]
        group = dist.new_group(ranks, timeout=timedelta(seconds=info.timeout))
        if d == info.dp_rank:
            mine = group
    return mine


def _check_channel_order(schedule: Schedule) -> None:
    """Every stage must run its F, and its B, in increasing micro-batch order.

    Both ends of a stage boundary then walk its transfers in the same order,
    which the layout tracking of :class:`~pipesched.runtime.p2p.Transport`
    relies on. Every built-in schedule does; a custom one may not.
    """
    last: dict[tuple[int, str], int] = {}
    for row in schedule.actions:
        for a in row:
            key = (a.stage, a.kind)
            if a.kind != "W" and last.get(key, -1) > a.microbatch:
                raise ConfigError(
                    f"schedule {schedule.name!r} runs {a} after micro-batch {last[key]} of the "
                    f"same stage and pass; across ranks each stage must run its micro-batches' "
                    "F, and its B, in increasing order: reorder them"
                )
            last[key] = a.microbatch


def broadcast_loss(
    losses: dict[int, torch.Tensor], count: int, last_rank: int, info: MeshInfo
) -> torch.Tensor:
    """The step's loss, computed on the last stage's rank, on every rank of the pipeline."""
    total = torch.zeros((), dtype=torch.float64, device=info.device)
    if losses:
        total += torch.stack([losses[i] for i in range(count)]).sum().double()
    src = info.pp_ranks[last_rank]
    wait_kept(dist.broadcast(total, src=src, group=info.pp_group, async_op=True))
    return total
