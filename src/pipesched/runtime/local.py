"""The local runtime: one thread per schedule worker, running its actions in the schedule's order.

One worker per schedule worker, not per device: two stages on "cpu" run in
two threads, truly in parallel (torchgpipe keys its threads by device, so on
CPU all stages share one thread). A lone worker, as on each rank of a mesh,
runs in the calling thread: a worker thread there took a tiny two-rank 1F1B
step from 18 to 29 ms. Each worker runs exactly the Actions the
Schedule lists for it, in that order, and waits only for the data an action
needs; the Schedule was validated, so the order cannot deadlock. Between
stages the autograd graph is cut (each stage's input is a fresh leaf) so that
each backward can run on its own stage's thread, when the schedule says;
the forward-only path keeps the graph whole instead, for autograd-transparent
``pipe(x)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipesched.checkpoint import checkpoint
from pipesched.errors import ConfigError
from pipesched.rng import StepSeed
from pipesched.runtime.backward import backward_full, backward_input
from pipesched.runtime.fused_linear import FusedLinearMode, worth_fusing
from pipesched.runtime.mailbox import Aborted, Mailbox
from pipesched.runtime.streams import (
    Stream,
    copy_to,
    new_stream,
    record_event,
    use_stream,
    wait_event,
)
from pipesched.runtime.threads import ThreadState
from pipesched.runtime.tree import map_tensors, tensors
from pipesched.schedule import BACKWARD, FORWARD, Action, Event, Schedule, Timeline
from pipesched.seeding import StageSeeding

__all__ = ["LocalRuntime", "StepInputs"]

LossFn = Callable[..., torch.Tensor]


@dataclass
class StepInputs:
    """One call's micro-batches and what to do with them.

    Args:
        inputs: stage 0's input of each micro-batch.
        targets: the loss target of each micro-batch, or None.
        loss_fn: applied to the last stage's output (and target); None runs forward only.
        loss_weights: each micro-batch's loss is multiplied by its weight.
        checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed.
        seed: this call's seed for random operations (see :mod:`pipesched.rng`);
            None: drawn from torch's default CPU generator when first needed.
    """

    inputs: list[Any]
    targets: list[Any] | None = None
    loss_fn: LossFn | None = None
    loss_weights: list[float] = field(default_factory=list)
    checkpoint_stop: int = 0
    seed: int | None = None


@dataclass
class _Run:
    """State of one call, shared by its worker threads."""

    step: StepInputs
    detach: bool
    mailbox: Mailbox = field(default_factory=Mailbox)
    saved: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    pending_weights: dict[tuple[int, int], Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    error: tuple[BaseException, Action, int] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    timeline: Timeline | None = None
    origin_wall: float = 0.0
    seed: StepSeed = field(default_factory=StepSeed)


class LocalRuntime:
    """Runs schedules over stage modules placed on devices, in one process.

    Args:
        stages: the stage modules, ``stages[s]`` already on ``devices[placement[s]]``.
        devices: the device of each schedule worker.
        num_threads: intra-op threads each worker may use.
        fused: per stage, the ids of the parameters whose ``linear`` weight
            gradients a step may accumulate in the GEMM; of them, only weights
            large enough to gain are fused
            (:func:`~pipesched.runtime.fused_linear.worth_fusing`); None: never.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device],
        num_threads: int,
        fused: Sequence[frozenset[int]] | None = None,
    ) -> None:
        self.stages = list(stages)
        self.devices = list(devices)
        self.num_threads = num_threads
        self.fused = None if fused is None else worth_fusing(self.stages, fused)
        self._streams: list[Stream] = [new_stream(d) for d in self.devices]
        self.seeding = [StageSeeding({}, s, torch.device("cpu"), adaptive=False) for s in stages]
        """How each stage seeds its random draws (:mod:`pipesched.seeding`)."""
        self.loss_seeding = StageSeeding({}, self.stages[-1], torch.device("cpu"), adaptive=False)
        """How the loss function's random draws are seeded."""
        self.lock = threading.Lock()
        """Held by the caller for a whole step: steps of one pipeline run one at a time."""
        self.forward_context: Callable[[int], AbstractContextManager[Any]] | None = None
        """Optional: a context manager entered around each forward of stage ``s``
        (e.g. ``torch.autograd.graph.saved_tensors_hooks`` to count saved bytes)."""

    def run(self, schedule: Schedule, step: StepInputs, *, detach: bool) -> _Run:
        """Runs ``schedule``'s actions (only its F where ``step.loss_fn`` is None).

        Returns the run's state: per micro-batch outputs (forward only) or
        weighted losses, and the measured events.

        Raises:
            BaseException: the first exception of any worker, with a note naming
                the stage, micro-batch and worker; every other worker has stopped.
        """
        run = _Run(step, detach)
        state = ThreadState.capture(self.num_threads)
        forward_only = step.loss_fn is None
        rows = [
            [a for a in row if a.kind == FORWARD] if forward_only else list(row)
            for row in schedule.actions
        ]
        origin = time.perf_counter()
        run.origin_wall = time.time()  # the same instant on the wall clock, to align processes
        workers = self.workers(schedule)
        self.start_step(schedule, {w: rows[w] for w in workers})
        run.seed = StepSeed(step.seed)  # after start_step: ranks may have agreed on it there
        if len(workers) == 1:  # one worker (a rank of a mesh): no thread to hand over to
            previous_threads = torch.get_num_threads()
            try:
                self._work(workers[0], rows[workers[0]], schedule, run, state, origin)
            finally:
                torch.set_num_threads(previous_threads)
        else:
            self._start_threads(workers, rows, schedule, run, state, origin)
        self.finish_step(run)
        if run.error is not None:
            error, action, worker = run.error
            error.add_note(
                f"pipesched: raised by stage {action.stage} on micro-batch {action.microbatch} "
                f"(action {action} on worker {worker})"
            )
            raise error
        run.timeline = Timeline(tuple(run.events), schedule.placement)
        return run

    def running_here(self) -> bool:
        """Whether the calling thread is one of this runtime's workers, inside a step."""
        return getattr(_working, "runtime", None) is self

    def _start_threads(
        self,
        workers: list[int],
        rows: list[list[Action]],
        schedule: Schedule,
        run: _Run,
        state: ThreadState,
        origin: float,
    ) -> None:
        """Runs each worker in its own thread and waits for all of them.

        Each worker sets an event when it has finished, however. Why not
        ``Thread.join``: on Python 3.11 a join cut by Ctrl-C can mark a running
        thread as stopped, and the caller would return while the worker still
        runs the step.
        """

        def work(w: int, done: threading.Event) -> None:
            try:
                self._work(w, rows[w], schedule, run, state, origin)
            finally:
                done.set()

        done = [threading.Event() for _ in workers]
        threads = [
            threading.Thread(
                target=work, args=(w, event), name=f"pipesched-worker-{w}", daemon=True
            )
            for w, event in zip(workers, done, strict=True)
        ]
        previous_threads = torch.get_num_threads()
        started: list[threading.Event] = []
        try:
            for thread, event in zip(threads, done, strict=True):
                thread.start()
                started.append(event)
            for event in started:
                event.wait()
        except BaseException:  # Ctrl-C or SystemExit while waiting: stop everyone first
            run.mailbox.abort()
            for event in started:  # a second Ctrl-C goes through: the user insists
                event.wait()
            raise
        finally:
            torch.set_num_threads(previous_threads)

    def _work(
        self,
        w: int,
        actions: list[Action],
        schedule: Schedule,
        run: _Run,
        state: ThreadState,
        origin: float,
    ) -> None:
        handlers: dict[str, Callable[..., float]] = {
            FORWARD: self._forward,
            BACKWARD: self._backward,
        }
        events = []
        action = actions[0] if actions else Action(0, FORWARD, 0)
        previous, _working.runtime = getattr(_working, "runtime", None), self
        try:
            with ExitStack() as stack:
                state.enter(stack)
                stack.enter_context(use_stream(self._streams[w]))
                for action in actions:
                    if run.mailbox.aborted:  # another worker failed, or the caller was interrupted
                        raise Aborted
                    # The handler returns when its inputs had arrived: waiting is not work.
                    start = handlers.get(action.kind, self._weight)(action, w, schedule, run)
                    events.append(Event(action, w, start - origin, time.perf_counter() - origin))
        except Aborted:
            pass
        except BaseException as error:  # a stage's failure stops every worker
            with run.lock:
                first = run.error is None
                if first:
                    run.error = (error, action, w)
            run.mailbox.abort()
            if first:
                self.on_failure(error, action)
        finally:
            _working.runtime = previous
        with run.lock:
            run.events += events

    def _forward(self, action: Action, w: int, schedule: Schedule, run: _Run) -> float:
        s, i = action.stage, action.microbatch
        device, stream = self.devices[w], self._streams[w]
        x = run.step.inputs[i] if s == 0 else self.take(run, FORWARD, s, i, stream)
        start = time.perf_counter()
        x = map_tensors(x, lambda t: copy_to(t, device, stream))
        if run.detach and s > 0:
            x = map_tensors(x, _fresh_leaf)
        # Fused weight-gradient accumulation only where pipesched runs the backward.
        fused = self.fused[s] if self.fused is not None and run.detach else None
        stage = _Seeded(self.stages[s], self.seeding[s], run.seed, i, fused)
        with self.forward_context(s) if self.forward_context else nullcontext():
            if i < run.step.checkpoint_stop and torch.is_grad_enabled():
                # No RNG replay: _Seeded reseeds random operations itself, and torch's
                # replay sets the process-wide generator unlocked (racing other stages).
                y = checkpoint(stage, x, preserve_rng_state=False)
            else:
                y = stage(x)
        if not run.detach and self.seeding[s].recomputes and torch.is_grad_enabled():
            raise ConfigError(
                f"stage {s} checkpoints itself (torch.utils.checkpoint) around random "
                "operations: the backward you run after pipe(x) would recompute them with "
                "other random numbers than the forward drew, giving wrong gradients; train "
                "with pipe.step or GradientAccumulator.step, or turn the model's own "
                "checkpointing off (Pipeline's checkpoint= recomputes stages itself)"
            )
        last = s == schedule.num_stages - 1
        if not last:
            self.put(run, FORWARD, s + 1, i, y, stream)
            if run.step.loss_fn is not None:
                run.saved[s, i] = (x, y)
            return start
        if run.step.loss_fn is None:
            run.outputs[i] = y
            return start
        target = () if run.step.targets is None else (run.step.targets[i],)
        target = map_tensors(target, lambda t: copy_to(t, device, stream))
        with self.loss_seeding.forward(run.seed, i, "loss"):
            loss = run.step.loss_fn(y, *target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise ConfigError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}; "
                "reduce it with .mean() or .sum() (use num_items= with a sum)"
            )
        if not loss.requires_grad:
            why = "an integer tensor" if not loss.is_floating_point() else "detached from the model"
            raise ConfigError(
                f"loss_fn returned a loss that cannot be differentiated ({why}, "
                f"dtype {loss.dtype}); return a floating-point loss computed from the output "
                "without .detach(), .item() or torch.no_grad(), as loss.backward() would need"
            )
        weighted = loss.reshape(()) * run.step.loss_weights[i]
        run.losses[i] = weighted.detach()
        run.saved[s, i] = (x, weighted)
        return start

    def _backward(self, action: Action, w: int, schedule: Schedule, run: _Run) -> float:
        s, i = action.stage, action.microbatch
        device, stream = self.devices[w], self._streams[w]
        x, y = run.saved.pop((s, i))
        if s == schedule.num_stages - 1:
            start = time.perf_counter()
            outputs, grads = [y], None
        else:
            grad_list = self.take(run, BACKWARD, s, i, stream)
            start = time.perf_counter()
            pairs = [
                (t, copy_to(g, device, stream))
                for t, g in zip(tensors(y), grad_list, strict=True)
                if g is not None and t.requires_grad
            ]
            outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
        inputs = list(tensors(x))
        with self.seeding[s].backward(run.seed, i):  # the model's own checkpoints recompute
            if schedule.split_backward:
                input_grads, pending = backward_input(outputs, grads, inputs)
                run.pending_weights[s, i] = pending
            else:
                input_grads = backward_full(outputs, grads, inputs)
        if s > 0:
            self.put(run, BACKWARD, s - 1, i, list(input_grads), stream)
        return start

    # Hooks a runtime across processes overrides: which workers run here, how values
    # travel between stages, and what a failure and the end of a step do.

    def workers(self, schedule: Schedule) -> list[int]:
        """The schedule workers this process runs: all of them."""
        return list(range(schedule.num_workers))

    def take(self, run: _Run, kind: str, stage: int, microbatch: int, stream: Stream) -> Any:
        """The input (F) or output gradient (B) of ``stage`` for ``microbatch``."""
        value, event = run.mailbox.take((kind, stage, microbatch))
        wait_event(stream, event)
        return value

    def put(
        self, run: _Run, kind: str, stage: int, microbatch: int, value: Any, stream: Stream
    ) -> None:
        """Hands ``value`` to ``stage``: its input (F) or its output gradient (B)."""
        run.mailbox.put((kind, stage, microbatch), (value, record_event(stream)))

    def on_failure(self, error: BaseException, action: Action) -> None:
        """Called once, in the failing worker, after every local worker was told to stop."""

    def start_step(self, schedule: Schedule, rows: dict[int, list[Action]]) -> None:
        """Called before the workers start, with the actions each will run."""

    def finish_step(self, run: _Run) -> None:
        """Called after the workers of a step have stopped."""

    def _weight(self, action: Action, w: int, schedule: Schedule, run: _Run) -> float:
        start = time.perf_counter()
        with self.seeding[action.stage].backward(run.seed, action.microbatch):
            run.pending_weights.pop((action.stage, action.microbatch)).run()
        return start


class _Seeded(nn.Module):
    """A stage run for one micro-batch, with its random operations seeded for it.

    Checkpointing recomputes this module, so recomputation (in whichever
    thread runs it) reseeds exactly as the forward did.
    """

    def __init__(
        self,
        stage: nn.Module,
        seeding: StageSeeding,
        seed: StepSeed,
        microbatch: int,
        fused: frozenset[int] | None,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.seeding, self.seed, self.microbatch = seeding, seed, microbatch
        self.fused = fused

    def forward(self, x: Any) -> Any:
        fusing = FusedLinearMode(self.fused) if self.fused else nullcontext()
        with self.seeding.forward(self.seed, self.microbatch), fusing:
            return self.stage(x)


def _fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    """A new autograd leaf sharing ``t``'s data; it requires grad if it can carry one."""
    leaf = t.detach()
    if torch.is_grad_enabled() and (leaf.is_floating_point() or leaf.is_complex()):
        leaf.requires_grad_(True)
    return leaf


_working = threading.local()  # .runtime: the runtime whose worker this thread is, inside a step
