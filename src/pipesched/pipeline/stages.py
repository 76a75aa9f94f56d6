"""A Pipeline's stages for one kind of call: the model cut, built and placed; the cuts kept.

An ``nn.Sequential`` is cut once, at construction; any other model on its
first call, traced from that call's first micro-batch, and again only when a
call needs another trace (:func:`pipesched.partition.call.call_key`,
:meth:`Stages.fits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipesched.errors import ConfigError, RetraceWarning, warn_user
from pipesched.partition import ModelCut, Partition, TracedStage, check_balance, plan_partition
from pipesched.partition.call import Call, call_key, describe_change
from pipesched.partition.materialize import Swaps, Unloaded, materialize_stages, on_meta
from pipesched.partition.model_cut import draw_places
from pipesched.partition.sequential import sequential_layers
from pipesched.partition.trace import TracedModel
from pipesched.planning.plan import Plan
from pipesched.runtime.engine import Engine
from pipesched.runtime.mesh import rank0_value
from pipesched.runtime.placement import keep_own_stages
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm
from pipesched.runtime.stage.tree import map_tensors, tensors

__all__ = ["MAX_CUTS", "Cuts", "Stages", "build_stages", "example_of"]

MAX_CUTS = 8
"""Traces one pipeline keeps at most (kinds of call x training modes): more is a ConfigError."""


@dataclass(frozen=True, eq=False)
class Stages:
    """One cut of the model into stage modules, placed where they run.

    Args:
        key: the :func:`~pipesched.partition.call.call_key` of the call it was
            traced from (None: an ``nn.Sequential``).
        modes: every module's training mode when it was traced (empty: an
            ``nn.Sequential``, run eagerly).
        cut: where the model is cut (counts, stage graph, partition table).
        modules: every stage module (other ranks' ones freed, on a mesh).
        own: the indices of this process's stages.
        tied: on a mesh, for each of this rank's parameters that stages on
            other pp ranks use too, the sorted pp ranks that use it.
        layers: what the Pipeline registers under the model's names (an
            ``nn.Sequential``'s layers of this process).
        replaced: the model's top-level modules that DeferredBatchNorm replaced.
        random_ops: what names places of random draws besides the model (a traced
            model's random operations, a sequential stage's sites: ``draw_places``).
        unloaded: what ``init_weights="skip"`` left for a load and no load
            has written yet (checked before every call), or None.
        swaps: a model on the meta device: which of its tensors this
            process's stages replaced, for the Pipeline to apply to itself
            (:meth:`~pipesched.partition.materialize.Swaps.apply`); else None.
    """

    key: tuple[Any, ...] | None
    modes: tuple[bool, ...]
    cut: ModelCut
    modules: list[nn.Module]
    own: list[int]
    tied: dict[int, tuple[int, ...]]
    layers: list[tuple[str, nn.Module]] = field(default_factory=list)
    replaced: dict[str, nn.Module] = field(default_factory=dict)
    random_ops: list[nn.Module] = field(default_factory=list)
    unloaded: Unloaded | None = None
    swaps: Swaps | None = None

    @property
    def partition(self) -> Partition:
        """The per-stage table of the cut."""
        return self.cut.partition

    def fits(
        self, key: tuple[Any, ...], inputs: Sequence[Any], model: nn.Module, *, every_mode: bool
    ) -> bool:
        """Whether this cut runs ``inputs`` (calls of ``key``) in the present training modes.

        Args:
            key: the calls' key.
            inputs: every micro-batch's call: their sizes must be within what
                the trace fixed (:meth:`~pipesched.partition.trace.TracedModel.refuses`).
            model: the model, whose modules' modes are read now.
            every_mode: the trace fits only the training mode of every module
                it saw (locally: code may branch on ``self.training`` anywhere);
                else only the modes its code visibly fixed (on a mesh, which
                cannot trace again: dropout probabilities and BatchNorm).
        """
        if self.key is not None and self.key != key:
            return False
        if every_mode and self.modes and self.modes != _modes(model):
            return False
        if self.refuses(inputs) is not None:
            return False
        return all(s.modes_hold() for s in self.modules if isinstance(s, TracedStage))

    def refuses(self, inputs: Sequence[Any]) -> str | None:
        """Why a micro-batch's sizes fall outside what the trace fixed, or None."""
        traced = self.cut.traced
        if traced is None:
            return None
        seen: set[tuple[tuple[int, ...], ...]] = set()
        for i, x in enumerate(inputs):
            shapes = tuple(tuple(t.shape) for t in tensors(x))
            if shapes in seen:  # cut from one batch, micro-batches share one or two shapes
                continue
            seen.add(shapes)
            if (reason := traced.refuses(traced.input_leaves(x))) is not None:
                return f"micro-batch {i}: {reason}"
        return None


def build_stages(
    model: nn.Module,
    plan: Plan,
    example: Call | tuple[Any, ...] | None,
    *,
    key: tuple[Any, ...] | None,
    traced: TracedModel | None = None,
) -> Stages:
    """Cuts ``model`` into stages as ``plan`` says, builds them and places them.

    Args:
        model: the model.
        plan: the pipeline's plan.
        example: one micro-batch's call (a traced model), or None.
        key: the call key the cut is for.
        traced: the model's trace for ``example`` if one was made already
            (the planner's), or None.
    """
    sequential = isinstance(model, nn.Sequential)
    balance = plan.balance
    if isinstance(model, nn.Sequential) and balance is not None and not isinstance(balance, str):
        check_balance(model, list(balance))
    stage_devices = plan.stage_devices

    def cut_with(balance: Sequence[int] | str | None, split: Sequence[str] | None) -> ModelCut:
        return plan_partition(
            model,
            num_stages=plan.num_stages,
            devices=stage_devices,
            schedule=plan.schedule,
            num_microbatches=plan.chunks,
            example_inputs=example,
            balance=balance,
            split_points=split,
            memory_budget=plan.memory_budget,
            num_threads=plan.cpu_threads,
            traced=traced,
        )

    # The first call may come under torch.no_grad() or inference_mode (an evaluation): tracing
    # and profiling measure backward too, on a copy of the example made outside of them.
    with torch.inference_mode(False), torch.enable_grad():
        example = map_tensors(example, torch.clone) if example is not None else None
        cut = cut_with(plan.balance, plan.split_points)
    mesh = plan.mesh
    if mesh is not None and list(cut.counts) != (agreed := rank0_value(list(cut.counts))):
        # Measured balances (time, schedule) can differ between ranks: rank 0's cut wins.
        with torch.inference_mode(False), torch.enable_grad():
            cut = cut_with(agreed, None)
    replaced: dict[str, nn.Module] = {}
    if plan.deferred_batch_norm and not sequential:
        before = dict(model.named_children())
        DeferredBatchNorm.convert(model)  # after tracing: the stages call the new layers
        replaced = {n: c for n, c in model.named_children() if before.get(n) is not c}
    modules = cut.build(model, stage_devices)
    unloaded = swaps = None
    if on_meta(model):  # built on meta: this process allocates its own stages, nothing else
        mine = [s for s, w in enumerate(plan.placement) if mesh is None or w == mesh.pp_rank]
        seed = torch.initial_seed() if mesh is None else rank0_value(torch.initial_seed())
        done = materialize_stages(modules, mine, stage_devices, model, plan.init_weights, seed)
        unloaded, swaps = done.unloaded, done.swaps
    tied: dict[int, tuple[int, ...]] = {}
    if mesh is None:
        own = list(range(plan.num_stages))
        for s, stage in enumerate(modules):
            stage.to(stage_devices[s])
    else:
        own, tied = keep_own_stages(modules, plan.placement, mesh.pp_rank, mesh.device)
    layers = []
    if sequential:  # this process's layers, under the model's names
        layers = [(name, layer) for s in own for name, layer in sequential_layers(modules[s])]
    return Stages(
        key,
        () if sequential else _modes(model),
        cut,
        modules,
        own,
        tied,
        layers,
        replaced,
        draw_places(modules),
        unloaded,
        swaps,
    )


def example_of(inputs: Sequence[Any]) -> Any:
    """The micro-batch to trace from: fewest dimensions of size 1 (export fixes those), then
    the largest."""
    return max(inputs, key=_example_rank)


def _example_rank(x: Any) -> tuple[int, int]:
    """Which micro-batch to trace from: fewest dimensions of size 1, then most elements."""
    leaves = [t for t in tensors(x) if t.ndim > 0]
    return (-sum(d == 1 for t in leaves for d in t.shape[1:]), sum(t.numel() for t in leaves))


def _modes(model: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in model.modules())


class Cuts:
    """The cuts of one pipeline, each with its engine: one per kind of call.

    Args:
        model: the model.
        mesh_bound: on a mesh (a trace cannot be made again there).
    """

    def __init__(self, model: nn.Module, *, mesh_bound: bool) -> None:
        self._model = model
        self._local = not mesh_bound
        self._all: list[tuple[Stages, Engine]] = []
        self._current: tuple[Stages, Engine] | None = None

    def __len__(self) -> int:
        return len(self._all)

    @property
    def current(self) -> tuple[Stages, Engine]:
        """The cut the last call ran (or the only one), and its engine.

        Raises:
            ConfigError: the model is cut on its first call, which has not come.
        """
        if self._current is None:
            raise ConfigError(
                f"{type(self._model).__name__} is traced and cut on the pipeline's first "
                "call; call pipe(...) or pipe.step(...) once first, or pass example_inputs= "
                "(one micro-batch) to cut it at construction"
            )
        return self._current

    @property
    def engines(self) -> list[Engine]:
        """Every cut's engine."""
        return [engine for _, engine in self._all]

    def add(self, stages: Stages, engine: Engine) -> None:
        """Keeps a new cut; it is the current one."""
        self._all.append((stages, engine))
        self._current = (stages, engine)

    def find(self, call: Call, inputs: Sequence[Any]) -> tuple[Stages, Engine] | None:
        """The cut that runs ``inputs`` (micro-batches of ``call``), or None: cut anew.

        Raises:
            ConfigError: on a mesh, a call that the first cut does not fit; or
                already :data:`MAX_CUTS` cuts.
        """
        key = call_key(call)
        for found in self._all:
            if found[0].fits(key, inputs, self._model, every_mode=self._local):
                self._current = found
                return found
        if self._all:
            self._explain_retrace(key, inputs)
        if len(self._all) >= MAX_CUTS:
            change = describe_change(self.current[0].key or (), key)
            raise ConfigError(
                f"{type(self._model).__name__} was traced {len(self._all)} times for as many "
                f"kinds of call, and this call needs another: {change}. "
                "A value that changes every call (e.g. num_items_in_batch=<the token count>) "
                "fixes a trace each time: pass a constant instead (for a Hugging Face loss, "
                "num_items_in_batch=1 in the batch and num_items=<count> in step)"
            )
        return None

    def check_fit(self, stages: Stages, inputs: Sequence[Any]) -> None:
        """Raises unless the new cut ``stages`` runs every micro-batch of ``inputs``.

        Raises:
            ConfigError: micro-batches of one step that no one trace can run.
        """
        if (reason := stages.refuses(inputs)) is not None:
            raise ConfigError(
                f"the micro-batches of this step cannot run on one trace of "
                f"{type(self._model).__name__}: {reason}. The model's code fixes that size "
                "(a branch on it, or a size of 1): give one step micro-batches on the same "
                "side of it"
            )

    def running_here(self) -> bool:
        """Whether the calling thread is one of the workers, inside a step."""
        return any(engine.running_here() for _, engine in self._all)

    def _explain_retrace(self, key: tuple[Any, ...], inputs: Sequence[Any]) -> None:
        """Warns of a new trace for a new kind of call; raises on a mesh (it cannot trace again).

        A mode change (``train()``/``eval()``) traces again without a warning:
        it is routine, and each mode's cut is kept.
        """
        old = self.current[0].key
        change = "a module's training mode changed what the trace fixed (a dropout "
        change += "probability of 0 in eval mode)"
        if old is not None and old != key:
            change = describe_change(old, key)
        elif (reason := self.current[0].refuses(inputs)) is not None:
            change = f"the call's sizes are outside the trace's: {reason}"
        elif self._local:
            return
        if not self._local:
            raise ConfigError(
                f"the model was traced for other arguments and cannot be traced again on a "
                f"mesh (the other ranks' layers are freed): {change}. Call the pipeline with "
                "arguments of one structure, or build a Pipeline per kind of call"
            )
        warn_user(
            f"pipesched: tracing {type(self._model).__name__} again and cutting it anew "
            f"because {change}; each kind of call keeps its own cut (a trace depends on the "
            "arguments' names and structure, non-tensor values, dtypes, ranks and the sizes "
            "its code fixed)",
            RetraceWarning,
        )
