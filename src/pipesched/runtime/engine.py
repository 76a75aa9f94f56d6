"""Running a pipeline's steps: one at a time, each a transaction, rerun once after unseeded draws.

The pipeline says what a step is (its micro-batches, loss, schedule); this
module says how every step runs, whatever it is: under the runtime's lock
(steps from several threads wait for each other), refused from inside one of
the pipeline's own steps, between a :class:`~pipesched.runtime.transaction.StepSnapshot`
and its commit (put back if anything raises), and once more, seeded
throughout, when a stage's tripwire saw an unseeded draw
(:mod:`pipesched.runtime.stage.seeding`); on a mesh, when one on any rank did, every rank
at once (they agree after each step in one tiny all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import ConfigError
from pipesched.runtime.interpreter import Runtime
from pipesched.runtime.passes import StepInputs, StepState
from pipesched.runtime.stage.rng import StepSeed, draw_seed, module_names
from pipesched.runtime.stage.seeding import StageSeeding, UnseededDraws
from pipesched.runtime.transaction import StepSnapshot, deferred_interrupts
from pipesched.schedule import Schedule

__all__ = ["Stepper"]


class Stepper:
    """Runs the steps of one pipeline.

    Args:
        runtime: the pipeline's runtime; its stages' seeding is set up here.
        model: the pipeline (its modules name the places of random draws,
            its parameters and BatchNorms are what a step may change).
        stages: every stage module; ``devices``: each stage's device.
        extra_names: modules named for draws besides ``model``'s (a traced
            model's random operations).
        finish: called at the end of a successful run, inside the transaction
            (committing deferred BatchNorm statistics).
        put_back: called when a run is put back (dropping the gradient sums
            over replicas it started).
        agree: on a mesh, a collective: whether any rank (given whether this
            one did) saw an unseeded draw in the step just run. Tripwires then
            only mark the step spoiled, every rank finishes it, and all put it
            back and rerun it together (a raise on one rank would stop the
            pipeline). Its seed is drawn before the step, for the ranks to agree on.

    Attributes:
        reruns: steps rerun seeded throughout after an unseeded draw (tests read it).
    """

    def __init__(
        self,
        runtime: Runtime,
        model: nn.Module,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device],
        extra_names: Sequence[nn.Module],
        *,
        finish: Callable[[], None],
        put_back: Callable[[], None] = lambda: None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        names = module_names(model, stages, extra_names)
        passes, deferred = runtime.passes, agree is not None
        passes.seeding = [
            StageSeeding(
                names[s], stage, devices[s], adaptive=True, deferred=deferred, label=f"stage {s}"
            )
            for s, stage in enumerate(stages)
        ]
        passes.loss_seeding = StageSeeding(
            {}, stages[-1], devices[-1], adaptive=True, loss=True, deferred=deferred,
            label="the loss_fn",
        )  # fmt: skip
        self.runtime = runtime
        self.seedings = [*passes.seeding, passes.loss_seeding]
        self.model = model
        self.finish = finish
        self.put_back = put_back
        self.agree = agree
        self.reruns = 0
        self._snapshot: StepSnapshot | None = None

    def run(
        self,
        schedule_of: Callable[[int], Schedule],
        make_step: Callable[[int | None], StepInputs],
        *,
        detach: bool,
    ) -> StepState:
        """Runs the step ``make_step(seed)`` builds, as a transaction (see the module).

        Raises:
            ConfigError: called from inside one of this pipeline's steps.
            BaseException: what the step raised; nothing it changed remains.
        """
        if self.runtime.interpreter.running_here():
            raise ConfigError(
                "this Pipeline was called from inside one of its own steps (a stage's "
                "forward or the loss_fn); a step cannot run another of the same pipeline: "
                "call it after the step returns"
            )
        with self.runtime.interpreter.lock:
            try:
                return self._attempt(schedule_of, make_step, detach)
            except UnseededDraws:
                for seeding in self.seedings:
                    seeding.probe()
                self.reruns += 1
            return self._attempt(schedule_of, make_step, detach)

    def commit_early(self, parameters: list[nn.Parameter]) -> None:
        """Gradients final for this step, read before it ends (a replica's all-reduce)."""
        if self._snapshot is not None:
            with deferred_interrupts():
                self._snapshot.commit_early(parameters)

    def seed(self) -> int | None:
        """This step's seed for random operations (:mod:`pipesched.runtime.stage.rng`), or None.

        On a mesh every rank draws it from torch's default CPU generator,
        and they run with pp rank 0's. Otherwise None: drawn at
        the step's first draw, if there is one, so the generator moves exactly
        when the model drew, whatever pipesched learned about where it draws.
        """
        if self.agree is not None or any(s.recomputes for s in self.seedings):
            return draw_seed()  # before any recomputation juggles the generator (see _attempt)
        return None

    def _attempt(
        self,
        schedule_of: Callable[[int], Schedule],
        make_step: Callable[[int | None], StepInputs],
        detach: bool,
    ) -> StepState:
        """One run of the step: committed if it returns, put back if it raises."""
        # Read each time: parameters replaced since (load_state_dict(assign=True)) count too.
        parameters = list(self.model.parameters())
        batch_norms = [m for m in self.model.modules() if isinstance(m, _BatchNorm)]
        with deferred_interrupts():
            self._snapshot = snapshot = StepSnapshot.take(parameters, batch_norms)
        try:
            step = make_step(self.seed())  # after a put-back run: the seed of its first run
            start = torch.default_generator.get_state()
            run = self.runtime.run(schedule_of(len(step.inputs)), step, detach=detach)
            if self.agree is not None and self.agree(any(s.spoiled for s in self.seedings)):
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
            self.finish()
            _settle_generators(start, run.seed, snapshot.rng[1])
        except BaseException:
            with deferred_interrupts():
                snapshot.restore()
                self.put_back()
            raise
        finally:
            self._snapshot = None
        with deferred_interrupts():
            snapshot.commit()
        # Only torch's own recomputation moves the shared generator (a draw in backward is
        # seeded on the stage's private generator): only it pins every stage.
        checkpoints = any(s.checkpoints for s in self.seedings)
        for seeding in self.seedings:
            seeding.settle(pin=checkpoints)
        return run


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
