"""The one loop that runs a worker's actions, in the schedule's order, over any transport.

An action takes its input (from its own worker's memory, or from the
transport), runs its pass (:class:`~pipesched.runtime.passes.StagePasses`) and
hands its result on; the Schedule was validated, so the order cannot
deadlock. Several workers run in threads of their own; a lone worker (each
rank of a mesh) runs in the calling thread.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Protocol

import torch

from pipesched.runtime.mailbox import Aborted
from pipesched.runtime.passes import StagePasses, StepInputs, StepState
from pipesched.runtime.stage.draw_keys import StepSeed
from pipesched.runtime.streams import join_stream, use_stream
from pipesched.runtime.threads import ThreadState
from pipesched.runtime.transport import Transport
from pipesched.runtime.workers import WorkerThreads
from pipesched.schedule import FORWARD, Action, Event, Kind, Schedule, Timeline
from pipesched.schedule.dataflow import Message, message_in, message_out
from pipesched.schedule.transfers import Item, transfer_plan

__all__ = ["Interpreter", "Runtime"]

Pass = Callable[[Action, int, Any, StepState], Any]


class Runtime(Protocol):
    """What a pipeline needs of a runtime, local or on a mesh."""

    passes: StagePasses
    interpreter: Interpreter

    def run(self, schedule: Schedule, step: StepInputs, *, detach: bool) -> StepState:
        """Runs this process's workers of ``schedule`` on ``step``."""


class Interpreter:
    """Runs the workers of a schedule over :class:`StagePasses` and a transport.

    Args:
        passes: the stages of this process and their passes.
        num_threads: intra-op threads each worker may use.
        on_failure: called once, in the failing worker, after every local
            worker was told to stop (a rank reports it to the others).
        on_stage_done: called with a stage once it has run its last backward
            action of a step (its gradients are final: a replica's all-reduce
            may start).
        around_action: called with a stage and True before each of its
            actions, and with False after it (a stage sharded per action
            gathers its parameters, then shards them again).
    """

    def __init__(
        self,
        passes: StagePasses,
        num_threads: int,
        *,
        on_failure: Callable[[BaseException, Action], None] | None = None,
        on_stage_done: Callable[[int], None] | None = None,
        around_action: Callable[[int, bool], None] | None = None,
    ) -> None:
        self.passes = passes
        self.num_threads = num_threads
        self.on_failure = on_failure
        self.on_stage_done = on_stage_done
        self.around_action = around_action
        self.handlers: dict[str, Pass] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.W: self._weight,
        }
        """The pass of each kind of action: one entry per :class:`Kind`, nothing else."""
        self.lock = threading.Lock()
        """Held by the caller for a whole step: steps of one pipeline run one at a time."""
        self.threads = WorkerThreads()
        """The worker threads, kept from one step to the next."""
        self._tables: dict[tuple[int, int, bool, bool], tuple[Schedule, tuple[Step, ...]]] = {}

    def running_here(self) -> bool:
        """Whether the calling thread is one of this interpreter's workers, inside a step."""
        return getattr(_working, "interpreter", None) is self

    def run(
        self,
        schedule: Schedule,
        step: StepInputs,
        transport: Transport,
        workers: Sequence[int],
        *,
        detach: bool,
        cpu: int | None = None,
    ) -> StepState:
        """Runs ``workers``' actions of ``schedule`` (only F where ``step.loss_fn`` is None).

        Returns the step's state: outputs or weighted losses, and its timeline.
        ``cpu``: the one CPU every worker runs on (:class:`ThreadState`), or None.

        Raises:
            BaseException: the first exception of any worker, with a note naming
                the stage, micro-batch and worker; every other worker has stopped.
        """
        state = StepState(step, detach, schedule.split_backward, StepSeed(step.seed))
        if self.passes.whole_backward:
            state.whole = schedule.whole_backwards
        forward_only = step.loss_fn is None
        plan = transfer_plan(schedule)
        rows = {w: _forward_only(plan[w]) if forward_only else plan[w] for w in workers}
        origin = time.perf_counter()
        state.origin_wall = time.time()  # the same instant on the wall clock, to align processes
        transport.start(rows, step.inputs)
        threads = ThreadState.capture(self.num_threads, cpu)
        track_last = self.on_stage_done is not None
        jobs = [(w, self._steps(schedule, w, forward_only, track_last)) for w in workers]
        previous_threads = torch.get_num_threads()
        errors: list[tuple[BaseException, Action, int]] = []
        self.passes.begin()
        # Stages in several threads: tied weights' contributions summed in stage order.
        tied = self.passes.tied if len(jobs) > 1 and detach and not forward_only else None
        if tied is not None:
            tied.begin()
        try:

            def work(w: int, steps: tuple[Step, ...]) -> None:
                self._work(w, steps, schedule, state, transport, threads, origin, errors)

            if len(jobs) == 1:  # one worker (a rank of a mesh): no thread to hand over to
                work(*jobs[0])
            else:
                self._start_threads(jobs, transport, work)
            # The caller's stream waits for the workers' (CUDA): what it queues after the
            # step (the tied sums, the optimizer, a backup's copy) reads finished gradients.
            for stream in self.passes.streams:
                join_stream(stream)
            if tied is not None and not errors:
                tied.finish()
        except BaseException:
            state.seed.put_back()  # users' generators as before the step
            raise
        finally:
            if tied is not None:
                tied.end()
            self.passes.end()
            torch.set_num_threads(previous_threads)
        if errors:
            state.seed.put_back()
            error, action, worker = errors[0]
            error.add_note(
                f"pipesched: raised by stage {action.stage} on micro-batch {action.microbatch} "
                f"(action {action} on worker {worker})"
            )
            raise error
        transport.finish()
        state.timeline = Timeline(tuple(state.events), schedule.placement)
        return state

    def _start_threads(
        self,
        jobs: list[tuple[int, tuple[Step, ...]]],
        transport: Transport,
        work: Callable[[int, tuple[Step, ...]], None],
    ) -> None:
        """Runs each worker in a thread of its own (kept between steps) and waits for all.

        Each worker sets an event when it has finished, however. Why not
        ``Thread.join``: on Python 3.11 a join cut by Ctrl-C can mark a running
        thread as stopped, and the caller would return while the worker still
        runs the step.
        """
        started: list[threading.Event] = []
        try:
            started = self.threads.start(
                [(f"pipesched-worker-{w}", functools.partial(work, w, steps)) for w, steps in jobs]
            )
            for event in started:
                event.wait()
        except BaseException:  # Ctrl-C or SystemExit while waiting: stop everyone first
            transport.abort()
            for event in started:  # a second Ctrl-C goes through: the user insists
                event.wait()
            raise

    def _steps(
        self, schedule: Schedule, w: int, forward_only: bool, track_last: bool
    ) -> tuple[Step, ...]:
        """Worker ``w``'s actions (only F where ``forward_only``) with their messages.

        Worked out once per schedule and kept here: a step of m micro-batches
        runs 2-3 x m x stages actions, and working out each one's messages
        again every step was a visible share of a tiny stage's action.
        """
        key = (id(schedule), w, forward_only, track_last)
        kept = self._tables.get(key)
        if kept is not None and kept[0] is schedule:
            return kept[1]
        num_stages, placement = schedule.num_stages, schedule.placement
        actions = [a for a in schedule.actions[w] if not forward_only or a.kind == FORWARD]
        last = _last_backward(actions) if track_last else {}
        steps: list[Step] = []
        for action in actions:
            inbox, outbox = message_in(action, num_stages), message_out(action, num_stages)
            steps.append(
                (
                    action,
                    -1 if inbox is None else placement[inbox.source],
                    inbox,
                    -1 if outbox is None else placement[outbox.stage],
                    outbox,
                    last.get(action.stage) == action,
                )
            )
        if len(self._tables) >= _KEPT_TABLES:  # a step per size of batch: keep the newest
            del self._tables[next(iter(self._tables))]
        self._tables[key] = (schedule, tuple(steps))
        return self._tables[key][1]

    def _work(
        self,
        w: int,
        steps: tuple[Step, ...],
        schedule: Schedule,
        state: StepState,
        transport: Transport,
        threads: ThreadState,
        origin: float,
        errors: list[tuple[BaseException, Action, int]],
    ) -> None:
        # Why bound up front: each attribute lookup in this loop is paid once per action.
        handlers, now, stream = self.handlers, time.perf_counter, self.passes.streams[w]
        take, put, before = transport.take, transport.put, transport.before
        local: dict[Message, Any] = {}  # values between stages of this worker (a V schedule's turn)
        done, around, whole = self.on_stage_done, self.around_action, state.whole
        times: list[float] = []
        action = steps[0][0] if steps else Action(0, FORWARD, 0)
        previous, _working.interpreter = getattr(_working, "interpreter", None), self
        try:
            with ExitStack() as stack:
                threads.enter(stack)
                stack.enter_context(use_stream(stream))
                for action, source, inbox, target, outbox, last in steps:
                    if transport.aborted:  # another worker failed, or the caller was interrupted
                        raise Aborted
                    before(action)
                    if inbox is None:
                        value = None
                    elif source == w:
                        value = local.pop(inbox)
                    else:
                        value = take(inbox, source, stream)
                    # A W whose B ran the whole backward does nothing: no gather for it.
                    idle = action.kind == Kind.W and (action.stage, action.microbatch) in whole
                    gather = None if idle else around
                    if gather is not None:
                        gather(action.stage, True)
                    # Time from when the input is there: waiting is not work.
                    start = now()
                    result = handlers[action.kind](action, w, value, state)
                    if gather is not None:
                        gather(action.stage, False)
                    if outbox is not None:
                        if target == w:
                            local[outbox] = result
                        else:
                            put(outbox, target, result, stream)
                    times += (start - origin, now() - origin)
                    if last:
                        done(action.stage)  # type: ignore[misc]
        except Aborted:
            pass
        except BaseException as error:  # a stage's failure stops every worker
            with state.lock:
                first = not errors
                errors.append((error, action, w))
            transport.abort()
            if first and self.on_failure is not None:
                self.on_failure(error, action)
        finally:
            _working.interpreter = previous
        events = [
            Event(steps[k][0], w, times[2 * k], times[2 * k + 1]) for k in range(len(times) // 2)
        ]
        with state.lock:
            state.events += events

    def _forward(self, action: Action, w: int, x: Any, state: StepState) -> Any:
        if action.stage == 0:
            x = state.step.inputs[action.microbatch]
        return self.passes.forward(action.stage, action.microbatch, x, state)

    def _backward(self, action: Action, w: int, grads: Any, state: StepState) -> Any:
        return self.passes.backward(action.stage, action.microbatch, grads, state)

    def _weight(self, action: Action, w: int, _: Any, state: StepState) -> None:
        self.passes.weight(action.stage, action.microbatch, state)


def _forward_only(row: Sequence[Item]) -> tuple[Item, ...]:
    return tuple(
        item
        for item in row
        if (item.kind if isinstance(item, Action) else item.message.kind) == FORWARD
    )


Step = tuple[Action, int, Message | None, int, Message | None, bool]
"""One action as a worker runs it: ``(action, source, inbox, target, outbox, last)``: the
message it takes and the worker it comes from, the message it makes and the worker it
goes to (None: none), and whether it is its stage's last backward action of the step."""


def _last_backward(actions: Sequence[Action]) -> dict[int, Action]:
    """Each stage's last B or W action in ``actions``."""
    return {a.stage: a for a in actions if a.kind != FORWARD}


_KEPT_TABLES = 64
"""Workers' action tables kept per interpreter (schedules of as many micro-batch counts)."""

_working = threading.local()  # .interpreter: whose worker this thread is, inside a step
