"""GradientAccumulator: the accumulation window users get wrong, done exactly, once per window.

Why its own class: ``(loss / k).backward()`` is right only if every micro-batch
holds as many items. Here losses are sums, and at the window's end gradients are
divided once by the window's item count (DESIGN.md, "Gradient normalization"), then
unscaled, checked, clipped, stepped, scheduled and zeroed, each once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipesched.errors import (
    CheckpointError,
    ConfigError,
    PipeschedWarning,
    RemoteError,
    warn_user,
)
from pipesched.runtime import batch_size, deferred_interrupts, replaced_parameters, replacement
from pipesched.train import checkpointing
from pipesched.train.accumulator_arguments import checked_arguments
from pipesched.train.gradients import all_finite, clip_to_, scaled
from pipesched.train.loss_scale import LossScale
from pipesched.train.result import StepResult, log_line
from pipesched.train.window import GradientsAside, WindowSnapshot

if TYPE_CHECKING:
    from pipesched.pipeline import Pipeline

__all__ = ["GradientAccumulator", "StepResult"]


class GradientAccumulator:
    """Runs pipeline steps in accumulation windows and finishes each window exactly once.

    Args:
        pipe: the Pipeline.
        optimizer: one optimizer over ``pipe.parameters()``, or one per stage.
        accumulation_steps: pipeline steps (calls to :meth:`step`) per window.
        max_grad_norm: clip the global gradient norm (all stages) to this.
        scaler: a ``torch.amp.GradScaler`` for the pipeline's device type.
        lr_scheduler: one scheduler or a list, stepped once per stepped window.

    Example:
        >>> from torch import nn
        >>> from pipesched import Pipeline
        >>> pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), 2,
        ...                 balance=[1, 1], devices=["cpu", "cpu"])
        >>> acc = GradientAccumulator(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1),
        ...                           accumulation_steps=2)
        >>> for _ in range(4):
        ...     result = acc.step(torch.randn(6, 4), torch.randn(6, 1),
        ...                       loss_fn=nn.functional.mse_loss)
        >>> result.stepped, result.window, result.effective_batch
        (True, 2, 12)
    """

    def __init__(
        self,
        pipe: Pipeline,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        accumulation_steps: int,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        self.optimizers, self.schedulers = checked_arguments(
            pipe, optimizer, accumulation_steps, max_grad_norm, lr_scheduler
        )
        self.pipe = pipe
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.loss_scale = LossScale(scaler, list(pipe.devices))
        self._replaced_seen = -1  # the generation of freed parameters the optimizers follow
        self.steps = 0
        self.windows = 0
        self._given: int | None = None  # micro-batches the last step was given as a list
        self._lock = threading.Lock()  # steps and flushes from several threads: one at a time
        self._reset_window()

    def _reset_window(self) -> None:
        self.position = 0  # steps done in the current window
        self._items = 0.0
        self._samples = 0
        self._loss_sum = 0.0
        self._scale = 1.0
        self._rows: list[int] = []  # samples of each step of the window, on this replica
        self._last_loss = math.nan  # the window's last step's loss (for a retried end)

    def step(
        self,
        inputs: Any = None,
        target: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> StepResult:
        """Runs one pipeline step into the window; on the window's last step, finishes it.

        Args:
            inputs, target, loss_fn: as in :meth:`Pipeline.step`.
            num_items: None when ``loss_fn`` returns a mean over samples (the
                step counts its rows); otherwise ``loss_fn`` returns a sum over
                items (e.g. tokens) and this counts them, over all of the
                step's micro-batches on this replica. The window is normalized
                by the sum of its steps' counts over every replica.
            microbatches, targets: instead of ``inputs`` and ``target``, the
                step's micro-batches with their own shapes (see
                :meth:`Pipeline.step`); their rows count in ``effective_batch``.

        Calls from several threads run one at a time. If the pipeline step
        raises, the window is as before the call (gradients included): the
        same batch can be stepped again. If the window's end raises (the
        optimizer, a scheduler, the loss scale, Ctrl-C, another rank's
        window end), the step's gradients are in and the window end is put
        back: parameters, optimizer state and param groups, schedulers,
        scaler, ``.grad``, counters and generators are as just before it,
        and :attr:`window_end_pending` is True. Then :meth:`flush` retries
        it (bit-identical to a window end that never failed); :meth:`step`,
        :meth:`save` and :meth:`state_dict` refuse until then, so that the
        step is never counted twice nor a window silently left unfinished.
        The exception carries a note saying so.

        Memory: during a window end, a copy of the parameters and optimizer
        state the optimizers hold, and of the gradients (normalized out of
        place, except those a replicas' sum already made new).
        """
        self._check_outside_step("step")
        with self._lock:
            return self._step(inputs, target, loss_fn, num_items, microbatches, targets)

    def _check_outside_step(self, call: str) -> None:
        """Refuses a call from inside the pipeline's own step (it would wait for itself)."""
        if self.pipe.running_here():
            raise ConfigError(
                f"GradientAccumulator.{call}() was called from inside one of the pipeline's "
                "own steps (a stage's forward or the loss_fn); it would wait for that step "
                "to end: call it after the step returns"
            )

    def _step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> StepResult:
        if self.window_end_pending:
            raise ConfigError(
                "GradientAccumulator.step(): the last window's end failed and was put back "
                f"(its {self.accumulation_steps} steps' gradients are in, nothing was stepped); "
                "call acc.flush() to retry it first (do not step that window's last batch "
                "again: it is already in)"
            )
        before = None  # a window's start, put back if its first step fails
        if self.position == 0:
            scale = self.loss_scale.value()  # constant through the window
            before = self._scale, [(p, p.grad) for p in self.pipe.parameters()]
            self.pipe.zero_grad(set_to_none=True)
            self._scale = scale
        last = self.position + 1 == self.accumulation_steps
        try:
            if last:
                self.pipe.sync.window_ends()  # replicas may start summing as stages finish
            loss_sum, items, pending = self.pipe.accumulate_pending(
                inputs,
                target,
                loss_fn=loss_fn,
                num_items=num_items,
                scale=self._scale,
                microbatches=microbatches,
                targets=targets,
            )
        except BaseException:
            if last:
                self.pipe.sync.window_ends(False)
            _restore_start(self, before)
            raise
        # Ctrl-C is held from the step's commit until its counts are in (PendingStep).
        try:
            self._follow_freed_parameters()
            loss = float(loss_sum)
            given = [inputs] if microbatches is None else microbatches
            rows = sum(map(batch_size, given))
            pending.keep()
        except BaseException as error:
            if last and not pending.kept:
                self.pipe.sync.window_ends(False)
            pending.abandon(error)
            if not pending.kept:
                _restore_start(self, before)
            raise
        self._loss_sum += loss
        self._items += items
        self._samples += rows
        self._rows.append(rows)
        self._given = None if microbatches is None else len(microbatches)
        self.position += 1
        self.steps += 1
        pending.release()  # a Ctrl-C held since: raised, noting that the step counts
        step_loss = loss / items if items > 0 else math.nan
        if self.position == self.accumulation_steps:
            self._last_loss = step_loss
            return self._finish(step_loss)
        return self._result(step_loss, None, stepped=False, skipped=False, norm=None)

    def _follow_freed_parameters(self) -> None:
        """Swaps, in the optimizers, parameters a mesh pipeline freed for their meta replacements.

        Why: an optimizer built before a traced model's first call on a mesh
        holds the model's Parameter objects; the first cut gives other ranks'
        layers new (meta) ones. Without this, the optimizer kept their
        memory and checkpoints met parameters the pipeline no longer names.
        Their optimizer state (loaded before the cut) is dropped: those
        ranks hold it.
        """
        generation = replaced_parameters()
        if generation == self._replaced_seen:
            return
        self._replaced_seen = generation
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                new = [replacement(p) for p in group["params"]]
                if any(n is not None for n in new):
                    group["params"] = [
                        p if n is None else n for p, n in zip(group["params"], new, strict=True)
                    ]
            for old in [p for p in optimizer.state if replacement(p) is not None]:
                del optimizer.state[old]  # another rank's parameter now: its state is theirs

    @property
    def window_sums(self) -> WindowSums:
        """The window so far on this replica: its item and row counts, loss sum and scale."""
        return WindowSums(
            self._items, self._samples, self._loss_sum, self._scale, tuple(self._rows)
        )

    @property
    def window_end_pending(self) -> bool:
        """Whether the window is full and its end failed (put back): :meth:`flush` retries it.

        In that state :meth:`step`, :meth:`save` and :meth:`state_dict` refuse.
        """
        return self.position == self.accumulation_steps

    def flush(self) -> StepResult | None:
        """Finishes an incomplete window, normalized by its own content; None if empty.

        After a window end that failed (:attr:`window_end_pending`), retries it:
        the result is the one that window end would have returned.
        """
        self._check_outside_step("flush")
        with self._lock:
            if self.position == 0:
                return None
            return self._finish(self._last_loss if self.window_end_pending else math.nan)

    def _finish(self, step_loss: float) -> StepResult:
        """Ends the window, all or nothing: on any failure (Ctrl-C included) it is put back.

        Reductions over the mesh first (sums, gradients, the inf check, the
        norm); then this rank's own changes (clip, optimizers, schedulers, loss
        scale), which every rank then agrees succeeded everywhere; only then
        are the gradients dropped and the counters advanced.
        """
        sync = self.pipe.sync  # the identity locally; reductions over the mesh otherwise
        parameters = list(self.pipe.parameters())
        backup = self.pipe.grad_backup
        aside = GradientsAside(parameters, backup)  # set aside (never written into) or copied
        items, samples, loss_sum = sync.sum([self._items, float(self._samples), self._loss_sum])
        if items <= 0:
            sync.gradients()  # every replica takes this path: end the window's reductions
            with deferred_interrupts():
                aside.close()
                self.pipe.zero_grad(set_to_none=True)
                self._reset_window()
            raise ConfigError(
                f"the window's num_items add up to {items:g}: there is nothing to normalize "
                "by; pass each step's count of non-padding items (the window was dropped, "
                "parameters untouched)"
            )
        try:
            sync.gradients()  # once per window: sum over replicas
            # The one normalization (and unscale); the gradients as the window left them
            # are kept (scaled out of place), those the replicas' sum made are scaled in place.
            grads = scaled(parameters, 1.0 / (self._scale * items), keep=aside.tensors())
            window_loss = loss_sum / items
            finite = sync.all_true(math.isfinite(window_loss) and all_finite(grads))
            norm = sync.norm(parameters) if finite else None
            snapshot = WindowSnapshot(
                self, finite, backup
            )  # what the optimizers and the rest change
        except BaseException as err:
            with deferred_interrupts():
                aside.restore()
            _note(err, "the window end failed in its reductions")
            raise
        failure: BaseException | None = None
        try:
            if finite:
                clip_to_(parameters, self.max_grad_norm, norm)  # type: ignore[arg-type]
                for optimizer in self.optimizers:
                    optimizer.step()
                for scheduler in self.schedulers:
                    scheduler.step()
            self.loss_scale.update(found_inf=not finite)
        except BaseException as err:
            failure = err
        failed: int | None = None  # the rank whose window end raised
        try:
            failed = sync.failed_rank(failure is None)  # one integer more on a mesh
            everywhere = failed is None
        except BaseException as err:  # another rank failed or is gone: put back, raise why
            everywhere = False
            if isinstance(err, RemoteError) and failure is not None:  # ours followed from it
                err.__context__, failure = failure, err
            failure = failure or err
        if not everywhere:
            snapshot.restore()
            with deferred_interrupts():
                aside.restore()
            if failure is None:  # this rank's part succeeded
                failure = RemoteError(
                    f"the window end failed on rank {failed} of the mesh (its optimizer, a "
                    "scheduler or its loss scale raised there: that rank's error says what); "
                    "this rank's window end was put back as well: call acc.flush() on every "
                    "rank to retry it",
                    rank=failed,
                )
            _note(failure, "the window end failed")
            raise failure
        with deferred_interrupts():  # commit
            if finite:
                self.windows += 1
            snapshot.close()
            aside.close()
            self.pipe.zero_grad(set_to_none=True)
            result = self._result(
                step_loss,
                window_loss,
                stepped=finite,
                skipped=not finite,
                norm=norm,
                samples=int(samples),
            )
            self._reset_window()
        if not finite and self.loss_scale.scaler is None:
            warn_user(
                f"window {self.windows + 1} was skipped: its loss ({window_loss:g}) or a "
                "gradient is not finite, so no optimizer stepped and the parameters are as "
                "they were (result.skipped). Without a GradScaler this is no overflow to back "
                "off from: look for a loss of nothing (a mean over zero items: all labels "
                "ignored in a micro-batch; pass sums with num_items= instead), a log of 0, or "
                "a learning rate that diverged",
                PipeschedWarning,
            )
        return result

    def _result(
        self,
        loss: float,
        window_loss: float | None,
        *,
        stepped: bool,
        skipped: bool,
        norm: float | None,
        samples: int | None = None,
    ) -> StepResult:
        return StepResult(
            loss=loss,
            window_loss=window_loss,
            stepped=stepped,
            skipped=skipped,
            grad_norm=norm,
            effective_batch=self._samples if samples is None else samples,
            step=self.steps,
            window=self.windows,
            lr=float(self.optimizers[0].param_groups[0]["lr"]),
            step_rows=tuple(self._rows),
        )

    def log_line(self, result: StepResult) -> str:
        """``step 12 | loss 1.23 | lr 1e-3 | eff. batch 256 (16 x 4 chunks x 4 steps)``.

        The breakdown is the window's own counts (a flushed window's steps,
        uneven steps' rows; see :func:`pipesched.train.result.log_line`). With
        data parallelism it ends with ``x R replicas``; after a step given
        ``microbatches=``, it reads ``(variable micro-batches (3 in the last
        step) x 4 steps)``.
        """
        replicas = self.pipe.mesh.dp_size if self.pipe.mesh is not None else 1
        return log_line(result, self.pipe.chunks, replicas, self._given)

    def state_dict(self) -> dict[str, Any]:
        """Everything a bit-identical resume needs, mid-window included.

        Like torch's own ``state_dict``s, the model and optimizer entries
        alias live tensors: save it (:meth:`save`) or deep-copy it to keep it.

        The model under its original parameter names, the optimizers (and
        their classes, checked on load), schedulers, scaler, RNG states,
        counters, and the window so far: its position, item and sample
        counts, loss, scale and accumulated gradients.

        Raises:
            CheckpointError: a failed window end is pending (:meth:`flush` it first).
        """
        self._check_committed("state_dict")
        return checkpointing.accumulator_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` into this accumulator, its pipeline and optimizers.

        All or nothing: the whole checkpoint is checked against this
        accumulator first (model keys, shapes and dtypes; optimizers, their
        param groups and per-parameter state; schedulers; scaler; counters;
        the window and its gradients), and should applying it still fail,
        everything it changed is put back before the error is raised.

        Raises:
            CheckpointError: ``state`` does not fit; the message lists every
                misfit and the fix. Nothing was changed.
        """
        checkpointing.load_state(self, state, None)

    def save(self, path: str, *, sharded: bool | None = None) -> None:
        """Writes the checkpoint atomically: a crash mid-save leaves the previous one loadable.

        Args:
            path: a file (one process), or a directory (``sharded``).
            sharded: write one checkpoint for any layout, in
                ``torch.distributed.checkpoint`` format under the plain
                model's names (:mod:`pipesched.train.sharded`): every rank
                writes its stages' shards, and :meth:`load` reads it at any
                pp, dp, balance, or in one process. None: on a mesh (where
                every rank calls it with the same ``path``), else False:
                :meth:`state_dict` in one ``torch.save`` file; a save killed
                outright leaves a ``.{name}.pipesched-*.tmp`` file beside
                ``path``, which the next save to ``path`` removes.

        Raises:
            CheckpointError: the window's end failed and is pending
                (:attr:`window_end_pending`): call :meth:`flush` first. Nothing
                was written.
        """
        self._check_committed("save")
        self._follow_freed_parameters()
        sharded = self.pipe.mesh is not None if sharded is None else sharded
        checkpointing.save_file(self, path, sharded=sharded)

    def _check_committed(self, call: str) -> None:
        """Refuses to save the state a failed window end left (a full window, not stepped)."""
        if self.window_end_pending:
            raise CheckpointError(
                f"GradientAccumulator.{call}(): the last window's end failed and was put back "
                f"(its {self.accumulation_steps} steps' gradients are in, nothing was stepped), "
                "a state no checkpoint holds; call acc.flush() to finish the window, then "
                f"{call}() (nothing was written)"
            )

    def load(self, path: str) -> None:
        """Resumes from :meth:`save`'s checkpoint; all or nothing, as :meth:`load_state_dict`.

        A directory is a sharded checkpoint, read at this pipeline's layout
        (on a mesh, every rank calls it; each reads only its stages' part).
        What is read is checked against the content checksums the save
        wrote (a file saved before pipesched wrote them loads unchecked).

        Raises:
            FileNotFoundError: there is nothing at ``path``.
            CheckpointError: the checkpoint cannot be read (truncated, empty,
                not a checkpoint: the reader's error is chained), is not what
                was saved (its content checksum differs), or does not
                fit (on a mesh: on any rank). The message names ``path``.
                Nothing was changed.
        """
        checkpointing.load_file(self, path)

    def apply_state(self, state: dict[str, Any]) -> None:
        """Writes a checkpoint's state, already checked to fit (:func:`check_fits`).

        No check and no undo: :meth:`load_state_dict` and :meth:`load` (and the
        sharded loader) check first and put everything back should this fail.
        """
        checkpointing.apply_state(self, state)

    def restore_window(
        self,
        steps: int,
        windows: int,
        position: int,
        items: float,
        samples: int,
        loss_sum: float,
        scale: float,
        step_rows: tuple[int, ...] = (),
    ) -> None:
        """Sets the counters and the window so far, as a checkpoint holds them (its load)."""
        self.steps, self.windows = steps, windows
        self.position, self._items, self._samples = position, items, samples
        self._loss_sum, self._scale = loss_sum, scale
        self._rows = list(step_rows)


@dataclass(frozen=True)
class WindowSums:
    """What a window has summed so far on one replica.

    Attributes:
        items: the steps' item counts (rows, or ``num_items``).
        samples: the steps' rows.
        loss_sum: the steps' summed losses, unscaled.
        scale: the loss scale, constant through the window.
        step_rows: each step's rows.
    """

    items: float
    samples: int
    loss_sum: float
    scale: float
    step_rows: tuple[int, ...] = ()


def _note(err: BaseException, what: str) -> None:
    """Tells, on the exception itself (KeyboardInterrupt included), what state it left."""
    err.add_note(
        f"pipesched: {what} and was put back: parameters, optimizers, schedulers, loss "
        "scale, .grad, counters and generators are as before it; call acc.flush() to "
        "retry it (acc.window_end_pending tells whether the full window's end is pending)"
    )


def _restore_start(acc: GradientAccumulator, before: tuple[float, list[Any]] | None) -> None:
    """A failed first step of a window leaves what it found: the loss scale, and the
    gradients the caller had in ``.grad`` (the window's start set them to None)."""
    if before is None:
        return
    acc._scale, held = before
    for parameter, grad in held:
        parameter.grad = grad
