"""The engine: runs one pipeline's steps over its stages, each step a seeded transaction.

A step runs under the runtime's lock (steps from several threads wait for
each other), refused from inside one of the pipeline's own steps, between a
:class:`~pipesched.runtime.transaction.StepSnapshot` and its commit (put back
if anything raises), and once more, seeded throughout, when a stage's tripwire
saw an unseeded draw (:mod:`pipesched.runtime.stage.seeding`); on a mesh, when
one on any rank did, every rank at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import ConfigError
from pipesched.runtime.distributed import DistributedRuntime, broadcast_loss
from pipesched.runtime.fused_linear import unshared_parameters
from pipesched.runtime.gradsync import GradientSync, LocalSync, Sync
from pipesched.runtime.heap import keep_freed_memory
from pipesched.runtime.interpreter import Runtime
from pipesched.runtime.local import LocalRuntime
from pipesched.runtime.mesh import MeshInfo
from pipesched.runtime.passes import StepInputs, StepState
from pipesched.runtime.placement import stage_parameters
from pipesched.runtime.stage.batchnorm import commit_all
from pipesched.runtime.stage.draw_keys import StepSeed, draw_seed, module_names
from pipesched.runtime.stage.seeding import StageSeeding, UnseededDraws
from pipesched.runtime.transaction import InterruptHold, StepSnapshot, deferred_interrupts
from pipesched.schedule import Schedule, Timeline

__all__ = ["Engine", "PendingStep", "RunResult", "Workers"]


@dataclass(frozen=True)
class Workers:
    """Where one pipeline's stages run.

    Args:
        devices: each worker's device (on a mesh: every pp rank's, this rank's device).
        placement: each stage's worker.
        cpu_threads: intra-op threads per CPU worker.
        mesh: this rank's place in the mesh, or None (one process).
    """

    devices: tuple[torch.device, ...]
    placement: tuple[int, ...]
    cpu_threads: int
    mesh: MeshInfo | None = None

    @property
    def stage_devices(self) -> list[torch.device]:
        """The device of each stage."""
        return [self.devices[w] for w in self.placement]


@dataclass(frozen=True)
class RunResult:
    """What one step gives back.

    Args:
        outputs: per micro-batch, the last stage's output (a forward-only step,
            on the last stage's rank).
        losses: per micro-batch, its weighted loss (a training step, on the
            last stage's rank).
        loss: a training step's weighted losses summed, on every rank; else None.
        timeline: this process's actions, measured.
        seconds: the step's wall time, transaction included.
        pending: the step, for its owner to settle (``run(..., settle=False)``); else None.
    """

    outputs: dict[int, Any]
    losses: dict[int, torch.Tensor]
    loss: torch.Tensor | None
    timeline: Timeline
    seconds: float
    pending: PendingStep | None = None


COMMITTED = (
    "this Ctrl-C came after the step had committed: its gradients are in .grad, and "
    "GradientAccumulator counted it (acc.steps); do not step the same batch again"
)
"""The note on a Ctrl-C raised after a step was kept."""

KEPT_NOT_COUNTED = (
    "this error came after the step had committed on this rank (on a mesh a step is kept as "
    "it commits: the ranks decide together), and before its owner counted it: its gradients "
    "are in .grad, but a GradientAccumulator's acc.steps and window do not include them. The "
    "window's gradients no longer match its counts: load the last checkpoint (or zero the "
    "gradients and start the window again) before going on"
)
"""The note on an error in a step's owner after the step was kept (a mesh) but not counted."""


class PendingStep:
    """A step that ran, its gradients in ``.grad``, still undoable: its owner keeps it.

    Why: between a step's commit and its owner's count of it (a
    GradientAccumulator's window position), a Ctrl-C raised at once would
    leave gradients that nothing counts, and a retry of the batch would add
    them twice. So Ctrl-C is held from the commit on: the owner calls
    :meth:`keep`, counts the step, then :meth:`release` (or :meth:`abandon`
    where it failed first). A Ctrl-C held before :meth:`keep` undoes the step
    (in one process; on a mesh, where ranks must agree, a step is kept as it
    commits); one that comes after is raised by :meth:`release` noting that
    the step counts.
    """

    __slots__ = ("_engine", "_hold", "_snapshot", "kept")

    def __init__(self, engine: Engine, snapshot: StepSnapshot, hold: InterruptHold) -> None:
        self._engine, self._snapshot, self._hold = engine, snapshot, hold
        self.kept: bool | None = None
        """Whether :meth:`keep` kept the step (None: not decided yet)."""

    def keep(self) -> bool:
        """Keeps the step, unless a Ctrl-C came since it ran and its handler raises (Python's
        own: ``KeyboardInterrupt``): then the step is undone and that is raised. Returns
        whether it was kept; then call :meth:`release`.

        Why run the handler here: a program's own handler that only notes the
        Ctrl-C (to stop after this step) raises nothing, and the step must count.
        """
        if self.kept is None:
            if self._engine.workers.mesh is None and self._hold.caught:
                try:
                    self._hold.deliver()
                except BaseException:
                    self._undo()
                    raise
            self._engine.keep(self._snapshot)
            self.kept = True
        return self.kept

    def abandon(self, error: BaseException) -> None:
        """Its owner failed with ``error`` before :meth:`keep`: undoes the step (on a mesh it
        was kept: ``error`` then says the step counts) and stops holding Ctrl-C."""
        try:
            if self.kept is None:
                self._undo()
            elif self.kept:
                error.add_note(KEPT_NOT_COUNTED)
        finally:
            self.release()

    def release(self) -> None:
        """Stops holding Ctrl-C, raising one held since :meth:`keep`, noting that the step
        counts."""
        self._hold.release(COMMITTED if self.kept else None)

    def settle(self) -> None:
        """:meth:`keep`, then :meth:`release`."""
        try:
            self.keep()
        finally:
            self.release()

    def _undo(self) -> None:
        self.kept = False
        self._snapshot.restore()
        self._engine.sync.drop_started()
        self._engine.sync.after_step(committed=False)


class Engine:
    """Runs the steps of one cut of a pipeline: its runtime, seeding, transaction and sync.

    Args:
        stages: every stage module (on a mesh, other ranks' ones freed), each
            already on its device.
        own: the indices of this process's stages.
        tied: on a mesh, for each of this rank's parameters (by id) that stages
            on other pp ranks use too, the pp ranks that use it.
        workers: where the stages run.
        model: the module tree a step may change (its parameters and BatchNorm
            layers are put back when a step fails); its module names are the
            places of random draws, so they do not depend on the cut.
        extra_names: modules named for draws besides ``model``'s (a traced
            model's random operations, a Sequential's sites).
        fuse: accumulate ``linear`` weight gradients inside the GEMM where no
            other stage holds the weight.
        grad_backup: where a step keeps the gradients pending before it
            (:mod:`~pipesched.runtime.grad_backup`).

    Attributes:
        runtime: runs a schedule's actions over the stages.
        sync: the reductions over the mesh's replicas (the identity locally).
        seedings: how each stage (and, last, the loss function) seeds its draws.
        reruns: steps rerun seeded throughout after an unseeded draw.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        own: Sequence[int],
        tied: dict[int, tuple[int, ...]],
        workers: Workers,
        *,
        model: nn.Module,
        extra_names: Sequence[nn.Module] = (),
        fuse: bool = True,
        grad_backup: str = "device",
    ) -> None:
        mesh, devices = workers.mesh, workers.stage_devices
        if any(device.type == "cpu" for device in workers.devices):
            keep_freed_memory()  # each pass's freed memory stays mapped for the next
        names = module_names(model, extra_names)
        deferred = mesh is not None  # ranks agree on a spoiled step after it, then rerun
        self.seedings = [
            StageSeeding(
                names, stage, devices[s], adaptive=True, deferred=deferred, label=f"stage {s}"
            )
            for s, stage in enumerate(stages)
        ]
        loss_seeding = StageSeeding(
            {}, stages[-1], devices[-1], adaptive=True, loss=True, deferred=deferred,
            label="the loss_fn",
        )  # fmt: skip
        self.seedings.append(loss_seeding)
        self.model = model
        self.workers = workers
        self.stages = list(stages)
        self.sync: Sync = LocalSync()
        self.runtime: Runtime
        if mesh is None:
            fused = unshared_parameters(stages) if fuse else None
            self.runtime = LocalRuntime(
                stages,
                list(workers.devices),
                workers.placement,
                workers.cpu_threads,
                self.seedings,
                fused,
            )
        else:
            # First: a sharded stage's parameters change here (FSDP2), before the runtime's read.
            self.sync = GradientSync(mesh, model, tied, {s: stages[s] for s in own})
            kept = [stage if s in own else None for s, stage in enumerate(stages)]
            fused = unshared_parameters(kept) if fuse else None
            # A traced stage passes a dict: it crosses ranks as a tuple in the sender's key order.
            keys = [None, *(getattr(stage, "sends", None) for stage in stages[:-1])]
            self.runtime = DistributedRuntime(
                kept,
                workers.placement,
                mesh,
                torch.get_num_threads(),
                self.seedings,
                fused,
                keys,
                on_stage_done=self._stage_done,
                around_action=self.sync.around_action if self.sync.per_action else None,
            )
            self.sync.highest = self.runtime.highest
        self.reruns = 0
        self.grad_backup = grad_backup
        self._snapshot: StepSnapshot | None = None

    def running_here(self) -> bool:
        """Whether the calling thread is one of this engine's workers, inside a step."""
        return self.runtime.interpreter.running_here()

    def run(
        self, schedule: Schedule, step: StepInputs, *, detach: bool, settle: bool = True
    ) -> RunResult:
        """Runs ``step`` on ``schedule`` as a transaction (see the module).

        Args:
            schedule: the schedule for ``len(step.inputs)`` micro-batches.
            step: the micro-batches, loss and recomputation; its ``seed`` is
                drawn here.
            detach: a training step's losses are detached (``pipe.step``);
                else the outputs keep their autograd graph (``pipe(x)``).
            settle: keep the step before returning; else the result's
                ``pending`` is for the caller to settle (Ctrl-C is held until then).

        Raises:
            ConfigError: called from inside one of this pipeline's steps.
            BaseException: what the step raised; nothing it changed remains.
        """
        begin = time.perf_counter()
        if self.running_here():
            raise ConfigError(
                "this Pipeline was called from inside one of its own steps (a stage's "
                "forward or the loss_fn); a step cannot run another of the same pipeline: "
                "call it after the step returns"
            )
        with self.runtime.interpreter.lock:
            try:
                state, pending = self._attempt(schedule, step, detach)
            except UnseededDraws:
                for seeding in self.seedings:
                    seeding.probe()
                self.reruns += 1
                state, pending = self._attempt(schedule, step, detach)
        try:
            loss = None
            if step.loss_fn is not None:
                loss = self._total(state.losses, len(step.inputs))
            timeline = state.timeline or Timeline((), schedule.placement)
            seconds = time.perf_counter() - begin
            result = RunResult(state.outputs, state.losses, loss, timeline, seconds, pending)
        except BaseException as exc:
            pending.abandon(exc)
            raise
        if settle:
            pending.settle()
            return dataclasses.replace(result, pending=None)
        return result

    def gather_timeline(self, timeline: Timeline, *, everywhere: bool = False) -> Timeline | None:
        """``timeline`` with every pp rank's actions, on pp rank 0 (``everywhere``: on all).

        Locally ``timeline`` itself. On a mesh, a collective over the pipeline's ranks.
        """
        if not isinstance(self.runtime, DistributedRuntime):
            return timeline
        return self.runtime.gather_timeline(timeline, everywhere=everywhere)

    def _total(self, losses: dict[int, torch.Tensor], count: int) -> torch.Tensor:
        """The step's weighted losses summed, on every rank."""
        mesh = self.workers.mesh
        if mesh is None:
            return torch.stack([losses[i] for i in range(count)]).sum()
        return broadcast_loss(losses, count, self.workers.placement[-1], mesh)

    def _stage_done(self, stage: int) -> None:
        """A stage's gradients are final for this step: its replicas may start summing them."""
        if self._snapshot is not None:
            with deferred_interrupts():
                self._snapshot.commit_early(stage_parameters(self.stages[stage]))
        self.sync.stage_done(stage)

    def _seed(self) -> int | None:
        """This step's seed for random operations (see ``stage.draw_keys``), or None.

        On a mesh every rank draws it from torch's default CPU generator, and
        they run with pp rank 0's. Otherwise None: drawn at the step's first
        draw, if there is one, so the generator moves exactly when the model
        drew, whatever pipesched learned about where it draws.
        """
        if self.workers.mesh is not None or any(s.recomputes for s in self.seedings):
            return draw_seed()  # before any recomputation juggles the generator (see _attempt)
        return None

    def _attempt(
        self, schedule: Schedule, step: StepInputs, detach: bool
    ) -> tuple[StepState, PendingStep]:
        """One run of the step: committed, Ctrl-C held, if it returns; put back if it raises."""
        self.sync.before_step()
        # Read each time: parameters replaced since (load_state_dict(assign=True)) count too.
        parameters = list(self.model.parameters())
        batch_norms = [m for m in self.model.modules() if isinstance(m, _BatchNorm)]
        with deferred_interrupts():
            self._snapshot = snapshot = StepSnapshot.take(parameters, batch_norms, self.grad_backup)
        try:
            self.sync.started()
            # After a put-back run the generator is back: the seed is its first run's.
            attempt = dataclasses.replace(step, seed=self._seed())
            start = torch.default_generator.get_state()
            state = self.runtime.run(schedule, attempt, detach=detach)
            if self._spoiled_somewhere():
                raise UnseededDraws(  # seen only after the rerun: run() catches the first
                    "a stage on some rank drew random numbers where none were seen before, "
                    "in a step already rerun with every pass of every stage seeded "
                    "throughout: the draw ran where pipesched cannot seed it (another thread "
                    "of the program drawing from torch's default generator, or from a "
                    "generator a stage uses, while the step ran; or an autograd.Function's "
                    "backward or a gradient hook run by an autograd thread of another device). "
                    "The step was put back on every rank; give that thread a torch.Generator "
                    "of its own, or draw the backward's noise in the forward and save it"
                )
            if self.model.training:
                commit_all(self.model)  # deferred BatchNorm statistics of the whole batch
            _settle_generators(start, state.seed, snapshot.rng[1])
            # Last: from here a Ctrl-C waits until the step's owner has kept and counted it.
            hold = InterruptHold()
        except BaseException:
            with deferred_interrupts():
                snapshot.restore()
                self.sync.drop_started()  # a step put back drops the sums it started
                self.sync.after_step(committed=False)
            raise
        finally:
            self._snapshot = None
        try:
            snapshot.commit()
        except BaseException:
            snapshot.restore()
            self.sync.drop_started()
            self.sync.after_step(committed=False)
            hold.release()
            raise
        pending = PendingStep(self, snapshot, hold)
        if self.workers.mesh is not None:  # ranks decide nothing alone: kept as committed
            pending.keep()
        return state, pending

    def keep(self, snapshot: StepSnapshot) -> None:
        """Makes a committed step final (:meth:`PendingStep.keep`)."""
        snapshot.release()
        self.sync.after_step(committed=True)
        # Only torch's own recomputation moves the shared generator (a draw in backward is
        # seeded on the stage's private generator): only it pins every stage.
        checkpoints = any(s.checkpoints for s in self.seedings)
        for seeding in self.seedings:
            seeding.settle(pin=checkpoints)

    def _spoiled_somewhere(self) -> bool:
        """On a mesh, a collective: whether a stage on any rank saw an unseeded draw.

        Tripwires there only mark the step spoiled, every rank finishes it, and
        all put it back and rerun it together (a raise on one rank would stop
        the pipeline); every replica reruns where the step summed gradients.
        """
        if not isinstance(self.runtime, DistributedRuntime):
            return False
        spoiled = any(s.spoiled for s in self.seedings)
        return self.runtime.any_rank(spoiled, replicas=self.sync.summing_in_step)


def _settle_generators(
    start: torch.Tensor, seed: StepSeed, cuda: list[torch.Tensor] | None
) -> None:
    """Puts the default generators where a successful step leaves them.

    That is: the CPU generator as at the start, advanced by the step's seed if
    it drew one; CUDA generators as before (seeded draws never move them).
    Why set it: a model's own ``torch.utils.checkpoint`` saves and restores
    the process-wide generator around each recomputation, unlocked, from
    every stage's thread at once: interleaved, those restores leave it in a
    state that depends on timing.
    """
    if seed.transition is not None and seed.drawn:
        start = seed.transition[1]
    torch.default_generator.set_state(start)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
