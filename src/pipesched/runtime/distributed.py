"""The runtime across processes: each rank runs its own worker's actions; values cross by p2p.

A step starts with the pipeline's ranks agreeing on its shape and seed; a
failure is reported to every rank before this one stops. The pipeline's own
process group is the one closed after a failure, so the default group and the
mesh's stay usable for the user's error handling.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.errors import ConfigError, RemoteError
from pipesched.runtime.agreement import StepShape, agreed_seed, batch_digest, mismatch
from pipesched.runtime.failures import Failure, FailureChannel, is_timeout
from pipesched.runtime.interpreter import Interpreter
from pipesched.runtime.link import Link
from pipesched.runtime.mesh import MeshInfo, wait_kept
from pipesched.runtime.ordered import OrderedTransport, signature
from pipesched.runtime.p2p import TaggedTransport, tcp_transport
from pipesched.runtime.passes import StagePasses, StepInputs, StepState
from pipesched.runtime.stage.seeding import StageSeeding
from pipesched.runtime.streams import Stream
from pipesched.runtime.transport import Transport, p2p_mode
from pipesched.schedule import FORWARD, Action, Event, Schedule, Timeline
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item

__all__ = ["DistributedRuntime", "broadcast_loss"]

_serials = itertools.count()  # every rank builds its pipelines in the same order


class DistributedRuntime:
    """Runs pp rank ``info.pp_rank``'s actions of each schedule.

    Args:
        stages: every stage index's module; only this rank's are used (others None).
        placement: the worker (pp rank) of each stage.
        info: this rank's place in the mesh.
        num_threads: intra-op threads for this rank's worker.
        seeding: as in :class:`~pipesched.runtime.passes.StagePasses`.
        fused: as in :class:`~pipesched.runtime.passes.StagePasses`.
        keys: per stage, the keys of the dict it receives (a traced model's
            stages), which crosses ranks as a tuple in this order; None: the
            value travels as it is.
        on_stage_done: called with a stage's index once it has run its last
            backward action of a step.
        around_action: called with a stage's index and True before each of its
            actions, False after it (:class:`~pipesched.runtime.interpreter.Interpreter`).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module | None],
        placement: tuple[int, ...],
        info: MeshInfo,
        num_threads: int,
        seeding: Sequence[StageSeeding],
        fused: Sequence[frozenset[int]] | None = None,
        keys: Sequence[tuple[str, ...] | None] | None = None,
        on_stage_done: Callable[[int], None] | None = None,
        around_action: Callable[[int, bool], None] | None = None,
    ) -> None:
        devices = [info.device] * info.pp_size
        self.passes = StagePasses(stages, devices, placement, seeding, fused)
        self.interpreter = Interpreter(
            self.passes,
            num_threads,
            on_failure=self._on_failure,
            on_stage_done=on_stage_done,
            around_action=around_action,
        )
        self.placement = placement
        self.info = info
        self.failures = FailureChannel(next(_serials), info.pp_rank, info.dp_rank, info.timeout)
        self.group: Any = _pipeline_group(info)
        """This pipeline's own process group (its pp ranks); None once closed after a failure."""
        self.stopped: Failure | None = None
        """Why this pipeline stopped, once a step failed (it cannot run again)."""
        link = Link(info.pp_ranks, info.device, self.failures, self.group)
        self.mode = p2p_mode(dist.get_backend(self.group), roomy=tcp_transport())
        """The p2p transport: ``"tagged"`` (gloo) or ``"ordered"`` (NCCL's rules)."""
        p2p: Transport = (
            OrderedTransport(link)
            if self.mode == "ordered"
            else TaggedTransport(link, len(placement))
        )
        self.transport: Transport = _Keyed(p2p, keys) if keys and any(keys) else p2p
        self.stats = p2p.stats
        """What this pipeline's transfers did (:class:`~pipesched.runtime.link.TransferStats`)."""
        self.last_origin_wall = 0.0
        self._kept_work: Any = None

    def run(self, schedule: Schedule, step: StepInputs, *, detach: bool) -> StepState:
        """Agrees on the step with the pipeline's other ranks, then runs this rank's actions.

        Sets ``step.seed`` to the agreed seed
        (:func:`~pipesched.runtime.agreement.agreed_seed`).

        Raises:
            ConfigError: the ranks disagree on the step (every rank raises it,
                before any transfer; the pipeline stays usable).
            RemoteError: another rank failed, died or did not answer; or this
                pipeline stopped after an earlier failure.
        """
        if not dist.is_initialized():
            raise ConfigError(
                "this pipeline's process group was destroyed "
                "(torch.distributed.destroy_process_group() ran on this rank), so its ranks "
                "cannot talk any more; destroy the process group only after the last step, "
                "or call init_mesh again and build a new Pipeline on every rank"
            )
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
            shapes=[signature(x) for x in step.inputs] if self.mode == "ordered" else None,
            contents=batch_digest([step.inputs, step.targets]),
        )
        shapes = self._exchange(shape)
        problem = mismatch(shapes)
        if problem is not None:
            raise ConfigError(f"the ranks of this pipeline disagree on the step: {problem}")
        step.seed = agreed_seed(shapes) or None
        try:
            state = self.interpreter.run(
                schedule, step, self.transport, [self.info.pp_rank], detach=detach
            )
        except RemoteError as error:  # a transfer failed outside any action (posting, finishing)
            if self.stopped is None:
                self._stop(Failure.of(error), report=False)
            raise
        self.last_origin_wall = state.origin_wall
        return state

    def any_rank(
        self,
        flag: bool,
        *,
        replicas: bool,
        doing: str = "waiting for the other ranks to finish the step",
    ) -> bool:
        """Whether ``flag`` holds on any rank of this pipeline (``replicas``: of every replica).

        A collective: a MAX all-reduce of one integer over the pipeline's group,
        then over "dp" where ``replicas`` (every replica's step must then rerun:
        their gradients were summed during it). ``doing`` says what this rank
        was doing, in a failure's message.

        Raises:
            RemoteError: another rank failed, died or did not answer.
        """
        return self.highest(int(flag), replicas=replicas, doing=doing) > 0

    def highest(self, value: int, *, replicas: bool, doing: str) -> int:
        """The largest ``value`` over this pipeline's ranks (``replicas``: every replica's):
        :meth:`any_rank`'s collective, for a value that names a rank."""
        t = torch.tensor([value], device=self.info.device)

        def reduce() -> None:
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            work.wait()
            # Kept until the next step (or a stop): a script may exit right after this
            # step, and gloo's thread must not free the work then (see wait_kept).
            self._kept_work = work

        self._collective(reduce, doing)
        if replicas and self.info.dp_size > 1:
            start = time.monotonic()
            try:
                wait_kept(
                    dist.all_reduce(
                        t, op=dist.ReduceOp.MAX, group=self.info.dp_group, async_op=True
                    )
                )
            except Exception as error:  # another replica's pipeline failed or died
                reported = self.failures.first()  # the channel is every replica's
                if reported is not None:
                    raise reported.error() from error
                raise RemoteError(
                    "pipesched: another replica did not finish the step (its pipeline failed, "
                    f"died or hung; its ranks' errors say which): {error}",
                    kind="timeout"
                    if is_timeout(error, time.monotonic() - start, self.info.timeout)
                    else "died",
                ) from error
        return int(t.item())

    def _exchange(self, shape: StepShape) -> list[StepShape]:
        """Every pp rank's shape of this step: one all-gather over the pipeline's group."""
        mine = shape.encode().to(self.info.device)
        gathered = [torch.empty_like(mine) for _ in range(self.info.pp_size)]
        self._collective(
            lambda: dist.all_gather(gathered, mine, group=self.group),
            "waiting for the other ranks to start the step",
        )
        return [StepShape.decode(t.tolist()) for t in gathered]

    def _collective(self, call: Callable[[], Any], what: str) -> None:
        """Runs ``call`` (a collective over the pipeline's group); a failure stops the pipeline."""
        start = time.monotonic()
        try:
            call()
        except Exception as error:
            failure = self.failures.first()
            if failure is None:
                others = [r for r in range(self.info.pp_size) if r != self.info.pp_rank]
                peer = others[0] if len(others) == 1 else None
                rank = None if peer is None else self.info.pp_ranks[peer]
                failure = self.failures.lost(error, time.monotonic() - start, what, peer, rank)
            self._stop(failure)
            raise failure.error() from error

    def _on_failure(self, error: BaseException, action: Action) -> None:
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
        self._kept_work = None  # it holds the group's connections open
        group, self.group = self.group, None
        self.transport.abort()
        if group is not None:
            with contextlib.suppress(Exception):  # never hide the error being reported
                dist.destroy_process_group(group)
            del group
            gc.collect()  # the connections close when the last reference goes

    def gather_timeline(self, timeline: Timeline, *, everywhere: bool = False) -> Timeline | None:
        """Every pp rank's events of ``timeline``'s step, on pp rank 0 (None on the others).

        A collective over the pipeline's ranks (``everywhere``: the timeline on
        every rank). Clocks are aligned by each rank's wall-clock time at the
        step's start: exact on one machine, within the machines' clock skew
        (NTP: about a millisecond) across machines.
        """
        mine = (self.last_origin_wall, [tuple(e) for e in timeline.events])
        gathered: list[Any] = [None] * self.info.pp_size
        dist.all_gather_object(gathered, mine, group=self.info.pp_group)
        if self.info.pp_rank != 0 and not everywhere:
            return None
        start = min(origin for origin, _ in gathered)
        events = [
            Event(Action(*action), worker, begin + origin - start, end + origin - start)
            for origin, rank_events in gathered
            for action, worker, begin, end in rank_events
        ]
        return Timeline(tuple(events), self.placement)


class _Keyed:
    """A p2p transport for traced stages, whose inputs are dicts: they cross as tuples.

    Args:
        transport: the transport that carries the tuples.
        keys: per stage, the keys of the dict it receives, in the sender's order.
    """

    def __init__(self, transport: Transport, keys: Sequence[tuple[str, ...] | None]) -> None:
        self._transport = transport
        self._keys = list(keys)
        self.stats = transport.stats

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        self._transport.start(rows, inputs)

    def before(self, action: Action) -> None:
        self._transport.before(action)

    def finish(self) -> None:
        self._transport.finish()

    def abort(self) -> None:
        self._transport.abort()

    @property
    def aborted(self) -> bool:
        return self._transport.aborted

    def take(self, message: Message, peer: int, stream: Stream) -> Any:
        value = self._transport.take(message, peer, stream)
        keys = self._keys[message.stage]
        return dict(zip(keys, value, strict=True)) if message.kind == FORWARD and keys else value

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        keys = self._keys[message.stage]
        if message.kind == FORWARD and keys and isinstance(value, dict):
            value = tuple(value[k] for k in keys)
        self._transport.put(message, peer, value, stream)


def _pipeline_group(info: MeshInfo) -> Any:
    """A new process group of this rank's pipeline, with the mesh's timeout.

    A collective over the whole job: every rank creates every replica's group,
    in the same order, as ``new_group`` requires (ranks laid out as by
    :func:`~pipesched.runtime.mesh.init_mesh`).
    """
    mine = None
    for d in range(info.dp_size):
        ranks = [d * info.pp_size + r for r in range(info.pp_size)]
        group = dist.new_group(ranks, timeout=timedelta(seconds=info.timeout))
        if d == info.dp_rank:
            mine = group
    return mine


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
