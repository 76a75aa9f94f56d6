"""What F, B and W compute on one stage and micro-batch, whichever runtime runs them.

The interpreter (:mod:`pipesched.runtime.interpreter`) hands each pass its
input, already taken from the transport, and sends on what the pass returns.
Between stages the autograd graph is cut (each stage's input is a fresh leaf)
so that each backward runs on its own stage's worker, when the schedule says;
the forward-only path keeps the graph whole instead, for autograd-transparent
``pipe(x)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipesched.errors import ConfigError
from pipesched.runtime.backward import backward_full, backward_input
from pipesched.runtime.compat.internals import unsafe_view
from pipesched.runtime.deferred import WeightStore
from pipesched.runtime.deferred_layers import Deferral, deferral
from pipesched.runtime.fused_linear import FusedLinearMode, unfuse_shared, worth_fusing
from pipesched.runtime.stage.draw_free import loss_draws_nothing
from pipesched.runtime.stage.draw_keys import StepSeed
from pipesched.runtime.stage.recompute import checkpoint
from pipesched.runtime.stage.seeding import StageSeeding
from pipesched.runtime.stage.tree import map_tensors, tensors
from pipesched.runtime.streams import Stream, copy_to, new_stream
from pipesched.runtime.tied import TiedGradients
from pipesched.schedule import Event, Timeline

__all__ = ["LossFn", "StagePasses", "StepInputs", "StepState"]

LossFn = Callable[..., torch.Tensor]


@dataclass
class StepInputs:
    """One call's micro-batches and what to do with them.

    Args:
        inputs: stage 0's input of each micro-batch.
        targets: the loss target of each micro-batch, or None.
        loss_fn: applied to the last stage's output (and target); None runs forward only.
        loss_weights: each micro-batch's loss is multiplied by its weight.
        checkpoint_stop: micro-batches ``i < checkpoint_stop`` are checkpointed
            (a tuple: stage ``s``'s ``i < checkpoint_stop[s]``).
        seed: this call's seed for random operations (see :mod:`pipesched.runtime.stage.draw_keys`);
            None: drawn from torch's default CPU generator when first needed.
        keep_outputs: a training step also keeps the last stage's outputs of
            micro-batches ``i < keep_outputs``, as ``loss_fn`` took them, in
            :attr:`StepState.outputs`.
    """

    inputs: list[Any]
    targets: list[Any] | None = None
    loss_fn: LossFn | None = None
    loss_weights: list[float] = field(default_factory=list)
    checkpoint_stop: int | tuple[int, ...] = 0
    seed: int | None = None
    keep_outputs: int = 0


@dataclass
class StepState:
    """One step's results and the values its passes keep between actions.

    Attributes:
        outputs: per micro-batch, the last stage's output (forward only; a training
            step: those it keeps, ``StepInputs.keep_outputs``).
        losses: per micro-batch, the weighted loss (training).
        events: every action's measured start and end (seconds from the step's start).
        timeline: the events as a Timeline, once the step has run.
        seed: the step's seed for random operations.
        origin_wall: the step's start on the wall clock (to align processes).
        whole: of a split schedule, the ``(stage, microbatch)`` pairs whose B runs
            the whole backward, leaving its W nothing (``Schedule.whole_backwards``).
    """

    step: StepInputs
    detach: bool
    split_backward: bool = False
    seed: StepSeed = field(default_factory=StepSeed)
    whole: frozenset[tuple[int, int]] = frozenset()
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    timeline: Timeline | None = None
    origin_wall: float = 0.0
    saved: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    pending_weights: dict[tuple[int, int], Any] = field(default_factory=dict)
    weight_stores: dict[tuple[int, int], WeightStore] = field(default_factory=dict)
    stage_stores: dict[int, list[WeightStore]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    plain_loss: bool | None = None  # whether the loss_fn draws nothing, once known


class StagePasses:
    """The stages of one process, and the three passes over them.

    Args:
        stages: the stage modules (None: a stage of another rank); ``stages[s]``
            is already on the device of its worker.
        devices: the device of each schedule worker.
        placement: the worker of each stage.
        seeding: how each stage seeds its random draws, then how the loss
            function does (:mod:`pipesched.runtime.stage.seeding`).
        fused: per stage, the ids of the parameters whose ``linear`` weight
            gradients a step may accumulate in the GEMM; of them, only weights
            large enough to gain are fused
            (:func:`~pipesched.runtime.fused_linear.worth_fusing`); None: never.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module | None],
        devices: Sequence[torch.device],
        placement: Sequence[int],
        seeding: Sequence[StageSeeding],
        fused: Sequence[frozenset[int]] | None = None,
    ) -> None:
        self.stages = list(stages)
        self.devices = [devices[w] for w in placement]
        """The device of each stage."""
        self.fused = None if fused is None else worth_fusing(self.stages, fused)
        self.streams: list[Stream] = [new_stream(d) for d in devices]
        """The compute stream of each worker (None on CPU)."""
        self.placement = tuple(placement)
        self.seeding = list(seeding[: len(self.stages)])
        """How each stage seeds its random draws (:mod:`pipesched.runtime.stage.seeding`)."""
        self.loss_seeding = seeding[len(self.stages)]
        """How the loss function's random draws are seeded."""
        self.tied = TiedGradients(self.stages)
        """Shared parameters' gradients, summed in stage order (steps in several threads)."""
        self._deferrals: list[Deferral | None] = [None] * len(self.stages)
        """How each stage's split-backward forwards defer, once one has run."""
        self.whole_backward = True
        """Whether the pairs a split schedule runs back to back with no transfer between
        (``Schedule.whole_backwards``) run as one whole backward: the split would cost
        2-6% of the backward for nothing. False: every pair split (the planner measures
        B and W so)."""
        self.forward_context: Callable[[int], AbstractContextManager[Any]] | None = None
        """Optional: a context manager entered around each forward of stage ``s``
        (e.g. ``torch.autograd.graph.saved_tensors_hooks`` to count saved bytes)."""

    def begin(self) -> None:
        """A step starts (see :meth:`~pipesched.runtime.stage.seeding.StageSeeding.begin`)."""
        for seeding in (*self.seeding, self.loss_seeding):
            seeding.begin()

    def end(self) -> None:
        """The step has ended, however."""
        for seeding in (*self.seeding, self.loss_seeding):
            seeding.end()

    def forward(self, s: int, i: int, x: Any, state: StepState) -> Any:
        """F: stage ``s`` on micro-batch ``i``'s input ``x``; returns what the next stage takes.

        The last stage keeps the output (forward only) or the weighted loss
        (training) in ``state`` and returns None.
        """
        device, stream = self.devices[s], self.streams[self.placement[s]]
        step = state.step
        fresh = state.detach and s > 0
        if isinstance(x, torch.Tensor):  # the common case, without a tree walk
            x = copy_to(x, device, stream)
            if fresh:
                x = _fresh_leaf(x)
        else:

            def arrive(t: torch.Tensor) -> torch.Tensor:
                t = copy_to(t, device, stream)
                return _fresh_leaf(t) if fresh else t

            x = map_tensors(x, arrive)
        # Fused weight-gradient accumulation only where pipesched runs the backward.
        fused = self.fused[s] if self.fused is not None and state.detach else None
        deferred = None
        # A split backward: B leaves the weights' products to W, with no second pass.
        split = state.split_backward and (s, i) not in state.whole
        if split and state.detach and step.loss_fn and torch.is_grad_enabled():
            siblings = state.stage_stores.setdefault(s, [])
            store = state.weight_stores[s, i] = WeightStore(fused or frozenset(), siblings)
            siblings.append(store)
            defer = self._deferrals[s]
            if defer is None:
                defer = self._deferrals[s] = deferral(self.stages[s])  # type: ignore[arg-type]
            deferred = (defer, store)
        if self.forward_context is None:
            y = self._run(s, i, x, state, fused, deferred)
        else:
            with self.forward_context(s):
                y = self._run(s, i, x, state, fused, deferred)
        if not state.detach and self.seeding[s].checkpoints and torch.is_grad_enabled():
            raise ConfigError(
                f"stage {s} checkpoints itself (torch.utils.checkpoint) around random "
                "operations: the backward you run after pipe(x) would recompute them with "
                "other random numbers than the forward drew, giving wrong gradients; train "
                "with pipe.step or GradientAccumulator.step, or turn the model's own "
                "checkpointing off (Pipeline's checkpoint= recomputes stages itself)"
            )
        if s < len(self.stages) - 1:
            if step.loss_fn is not None:
                state.saved[s, i] = (x, y)
            return y
        if step.loss_fn is None:
            state.outputs[i] = y
            return None
        if i < step.keep_outputs:  # as loss_fn takes it (a ModelOutput stays one)
            state.outputs[i] = y
        if step.targets is None:
            target: tuple[Any, ...] = ()
        elif isinstance(t := step.targets[i], torch.Tensor):
            target = (copy_to(t, device, stream),)
        else:
            target = (map_tensors(t, lambda t: copy_to(t, device, stream)),)
        plain = state.plain_loss
        if plain is None:  # read once a step (a module's hooks do not change within one)
            plain = state.plain_loss = loss_draws_nothing(step.loss_fn)
        if plain:  # torch's own loss: nothing to seed
            loss = step.loss_fn(y, *target)
        else:
            with self.loss_seeding.forward(state.seed, i, "loss"):
                loss = step.loss_fn(y, *target)
        _check_loss(loss)
        weighted = (loss.reshape(()) if loss.ndim else loss) * step.loss_weights[i]
        state.losses[i] = weighted.detach()
        state.saved[s, i] = (x, weighted)
        return None

    def _run(
        self,
        s: int,
        i: int,
        x: Any,
        state: StepState,
        fused: frozenset[int] | None,
        deferred: tuple[Deferral, WeightStore] | None,
    ) -> Any:
        """Stage ``s`` on ``x``: checkpointed or not, seeded as its seeding says, maybe fused
        (where ``deferred`` is given: with its weight gradients deferred into its store)."""
        stage, seeding = self.stages[s], self.seeding[s]
        stop = state.step.checkpoint_stop
        if i < (stop if isinstance(stop, int) else stop[s]) and torch.is_grad_enabled():
            # No RNG replay: _Seeded reseeds random operations itself, and torch's
            # replay sets the process-wide generator unlocked (racing other stages).
            seeded = _Seeded(stage, seeding, state.seed, i, fused, deferred, own=state.detach)  # type: ignore[arg-type]
            return checkpoint(seeded, x, preserve_rng_state=False)
        handed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if state.detach:  # the stage may modify its input in place, as in the plain model
            x = _hand_over(x, handed)
        # What _Seeded.forward does, without building a module per micro-batch.
        if deferred is not None:
            defer, store = deferred
            with seeding.forward(state.seed, i), defer(store):
                y = stage(x)  # type: ignore[misc]
        elif fused:
            with seeding.forward(state.seed, i), FusedLinearMode(fused):
                y = stage(x)  # type: ignore[misc]
        else:
            with seeding.forward(state.seed, i):
                y = stage(x)  # type: ignore[misc]
        for received, given in handed:
            # Modified in place: what an earlier stage saved from that data must see it (not
            # stage 0's micro-batch: a view sharing its version with the others, saved by
            # their checkpoints; the user's input was saved by no stage).
            if given._version and s > 0:
                torch.autograd.graph.increment_version(received)
        return y

    def backward(self, s: int, i: int, grads: Any, state: StepState) -> list[torch.Tensor | None]:
        """B: stage ``s``'s backward for micro-batch ``i`` from its output gradients ``grads``.

        ``grads`` is None for the last stage (its output is the loss). Where the
        schedule splits backward only the input gradients are computed; W runs the rest
        (but for the pairs in ``state.whole``, whose B runs the whole backward).
        Returns the gradients of the stage's inputs.
        """
        device, stream = self.devices[s], self.streams[self.placement[s]]
        x, y = state.saved.pop((s, i))
        if grads is None:
            outputs, given = [y], None
        elif isinstance(y, torch.Tensor) and len(grads) == 1:  # one tensor: no tree walk
            g = grads[0]
            keep = g is not None and y.requires_grad
            outputs, given = ([y], [copy_to(g, device, stream)]) if keep else ([], [])
        else:
            pairs = [
                (t, copy_to(g, device, stream))
                for t, g in zip(tensors(y), grads, strict=True)
                if g is not None and t.requires_grad
            ]
            outputs, given = [t for t, _ in pairs], [g for _, g in pairs]
        inputs = [x] if isinstance(x, torch.Tensor) else list(tensors(x))
        tied = self.tied.stage(s) if self.tied.active else nullcontext()
        with tied, self.seeding[s].backward(state.seed, i):  # the model's checkpoints recompute
            if state.split_backward and (s, i) not in state.whole:
                store = state.weight_stores.pop((s, i), None)
                input_grads, pending = backward_input(outputs, given, inputs, store)
                state.pending_weights[s, i] = pending
            else:
                if self.fused is not None and self.fused[s]:
                    unfuse_shared(outputs)  # as a split's W: a weight's parts summed, then added
                input_grads = backward_full(outputs, given, inputs)
        return list(input_grads)

    def weight(self, s: int, i: int, state: StepState) -> None:
        """W: the weight gradients B of stage ``s``, micro-batch ``i`` left pending (none
        where B ran the whole backward)."""
        if (s, i) in state.whole:
            return
        tied = self.tied.stage(s) if self.tied.active else nullcontext()
        with tied, self.seeding[s].backward(state.seed, i):
            state.pending_weights.pop((s, i)).run()


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise ConfigError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}; "
            "reduce it with .mean() or .sum() (use num_items= with a sum)"
        )
    if loss.is_complex():  # loss.backward() refuses it: no gradient of a complex number
        raise ConfigError(
            f"loss_fn returned a complex loss (dtype {loss.dtype}); a gradient is defined for "
            "a real scalar only (loss.backward() refuses it too): return its .real, .abs() "
            "or another real function of it"
        )
    if not loss.requires_grad:
        why = "an integer tensor" if not loss.is_floating_point() else "detached from the model"
        raise ConfigError(
            f"loss_fn returned a loss that cannot be differentiated ({why}, "
            f"dtype {loss.dtype}); return a floating-point loss computed from the output "
            "without .detach(), .item() or torch.no_grad(), as loss.backward() would need"
        )


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
        deferred: tuple[Deferral, WeightStore] | None,
        *,
        own: bool = False,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.seeding, self.seed, self.microbatch = seeding, seed, microbatch
        self.fused = fused
        self.deferred = deferred
        self.own = own

    def forward(self, x: Any) -> Any:
        if self.own:  # a copy of its own: the recomputation must see the input unmodified
            x = map_tensors(x, _own_copy)
        with self.seeding.forward(self.seed, self.microbatch), _fusing(self.fused, self.deferred):
            return self.stage(x)


def _fusing(
    fused: frozenset[int] | None, deferred: tuple[Deferral, WeightStore] | None
) -> AbstractContextManager[Any]:
    """The forward's context: deferred weights (a split backward), fused linears, or none."""
    if deferred is not None:  # the same store for the recomputation: it defers the same ops
        defer, store = deferred
        return defer(store)
    return FusedLinearMode(fused) if fused else nullcontext()


def _hand_over(x: Any, handed: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``x`` as a stage may receive it: tensors it may modify in place, as in the plain model.

    Why: a stage's input is a leaf that requires grad (in-place ops on it are
    refused), or stage 0's micro-batch, a view sharing one version counter
    with every other micro-batch of the input (modifying one spoils the
    others' saved tensors). Each plain tensor is given as an ``unsafe_view``
    of itself: no copy, the same data, a node the gradient flows through, and
    a version counter of its own. The pairs ``(received, given)`` are
    appended to ``handed``: where ``given`` was modified, the caller bumps
    ``received``'s version, so a tensor an earlier stage saved from that data
    is refused in backward as the plain model would refuse it.
    """

    def hand(t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return t
        given = unsafe_view(t)
        handed.append((t, given))
        return given

    if isinstance(x, torch.Tensor):
        return hand(x)
    return map_tensors(x, hand)


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy a checkpointed stage may modify (plain tensors; the gradient flows through)."""
    return t.clone() if type(t) is torch.Tensor and t.layout == torch.strided else t


def _fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    """A new autograd leaf sharing ``t``'s data; it requires grad if it can carry one."""
    leaf = t.detach()
    if torch.is_grad_enabled() and (leaf.is_floating_point() or leaf.is_complex()):
        leaf.requires_grad_(True)
    return leaf
