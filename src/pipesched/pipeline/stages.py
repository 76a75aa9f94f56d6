"""Putting a Pipeline together: where the model is cut, and what runs the stages.

A :class:`~pipesched.Pipeline` is built in named steps:
:func:`~pipesched.planning.plan.resolve_layout` (the schedule, the workers' devices
and each stage's worker; no model needed), then :func:`assemble` (the cut,
the stage modules, the runtime and the stepper for one kind of call). An
``nn.Sequential`` is assembled at construction; any other model on its first
call, traced from that call's first micro-batch, and again only when a call
needs another trace (:func:`pipesched.partition.call.call_key`, :meth:`Assembly.fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipesched.errors import ConfigError, RetraceWarning, warn_user
from pipesched.partition import ModelCut, Partition, TracedStage, check_balance, plan_partition
from pipesched.partition.call import Call, call_key, describe_change
from pipesched.partition.materialize import Unloaded, materialize_stages, on_meta
from pipesched.partition.sequential import sequential_layers
from pipesched.pipeline.shadowing import register_named
from pipesched.planning.plan import Cut, Layout
from pipesched.runtime.distributed import DistributedRuntime
from pipesched.runtime.engine import Stepper
from pipesched.runtime.fused_linear import unshared_parameters
from pipesched.runtime.gradsync import GradientSync, LocalSync, Sync
from pipesched.runtime.interpreter import Runtime
from pipesched.runtime.local import LocalRuntime
from pipesched.runtime.mesh import rank0_value
from pipesched.runtime.placement import stage_parameters
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm, commit_all
from pipesched.runtime.stage.tree import map_tensors, tensors

if TYPE_CHECKING:
    from pipesched.pipeline.facade import Pipeline

__all__ = ["MAX_CUTS", "Assemblies", "Assembly", "assemble", "register_model"]

MAX_CUTS = 8
"""Traces one pipeline keeps at most (kinds of call x training modes): more is a ConfigError."""


@dataclass(frozen=True, eq=False)
class Assembly:
    """One cut of the model and what runs it.

    Args:
        key: the :func:`~pipesched.partition.call.call_key` of the call it was traced
            from (None: an ``nn.Sequential``).
        modes: every module's training mode when it was traced (empty: an
            ``nn.Sequential``, run eagerly).
        plan: the cut (counts, stage graph, partition table).
        stages: every stage module (other ranks' ones freed, on a mesh).
        own: the indices of this process's stages.
        runtime: runs the stages' actions.
        tied: on a mesh, for each of this rank's parameters that stages on
            other pp ranks use too, the sorted pp ranks that use it.
        stepper: runs steps as transactions, seeded.
        unloaded: what ``init_weights="skip"`` left for a load and no load
            has written yet (checked before every call), or None.
    """

    key: tuple[Any, ...] | None
    modes: tuple[bool, ...]
    plan: ModelCut
    stages: list[nn.Module]
    own: list[int]
    runtime: Runtime
    tied: dict[int, tuple[int, ...]]
    stepper: Stepper
    unloaded: Unloaded | None = None

    @property
    def partition(self) -> Partition:
        """The per-stage table of the cut."""
        return self.plan.partition

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
        return all(s.modes_hold() for s in self.stages if isinstance(s, TracedStage))

    def refuses(self, inputs: Sequence[Any]) -> str | None:
        """Why a micro-batch's sizes fall outside what the trace fixed, or None."""
        traced = self.plan.traced
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


def assemble(
    pipe: nn.Module,
    module: nn.Module,
    layout: Layout,
    cut: Cut,
    example: Call | tuple[Any, ...] | None,
    *,
    key: tuple[Any, ...] | None,
    register: Callable[[Sequence[nn.Module], list[int]], None],
    on_stage_done: Callable[[int], None],
    finish: Callable[[], None],
    sync: Callable[[], Sync] = LocalSync,
) -> Assembly:
    """Cuts ``module`` into stages and builds what runs them.

    Args:
        pipe: the Pipeline (its modules name the places of random draws).
        module: the model.
        layout, cut: where stages run and how to cut.
        example: one micro-batch's call (a traced model), or None.
        key: the call key the cut is for.
        register: called with the stages and this process's own ones before
            the stepper names the places of random draws by the pipeline's modules.
        on_stage_done: on a mesh, called with a stage once its gradients are final.
        finish: called at the end of each successful step (committing BatchNorm).
        sync: the pipeline's reductions over replicas now (a step put back
            drops what it started; a rerun involves every replica it summed over).
    """
    sequential = isinstance(module, nn.Sequential)
    balance = cut.balance
    if isinstance(module, nn.Sequential) and balance is not None and not isinstance(balance, str):
        check_balance(module, list(balance))
    num_stages = len(layout.placement)
    stage_devices = layout.stage_devices

    def plan_with(balance: Sequence[int] | str | None, split: Sequence[str] | None) -> ModelCut:
        return plan_partition(
            module,
            num_stages=num_stages,
            devices=stage_devices,
            schedule=layout.schedule,
            num_microbatches=cut.chunks,
            example_inputs=example,
            balance=balance,
            split_points=split,
            memory_budget=cut.memory_budget,
            num_threads=layout.cpu_threads,
        )

    # The first call may come under torch.no_grad() or inference_mode (an evaluation): tracing
    # and profiling measure backward too, on a copy of the example made outside of them.
    with torch.inference_mode(False), torch.enable_grad():
        example = map_tensors(example, torch.clone) if example is not None else None
        plan = plan_with(cut.balance, cut.split_points)
    info = layout.mesh
    if info is not None and list(plan.counts) != (agreed := rank0_value(list(plan.counts))):
        # Measured balances (time, schedule) can differ between ranks: rank 0's cut wins.
        with torch.inference_mode(False), torch.enable_grad():
            plan = plan_with(agreed, None)
    if cut.deferred_batch_norm and not sequential:
        DeferredBatchNorm.convert(module)  # after tracing: the stages call the new layers
        for name, child in module.named_children():  # a replaced top-level BatchNorm
            if pipe._modules.get(name) is not child:
                pipe._modules[name] = child
    stages = plan.build(module, stage_devices)
    unloaded = None
    if on_meta(module):  # built on meta: this process allocates its own stages, nothing else
        mine = [s for s, w in enumerate(layout.placement) if info is None or w == info.pp_rank]
        seed = torch.initial_seed() if info is None else rank0_value(torch.initial_seed())
        unloaded = materialize_stages(
            stages, mine, stage_devices, module, [pipe], cut.init_weights, seed
        )
    runtime: Runtime
    tied: dict[int, tuple[int, ...]] = {}
    if info is None:
        own = list(range(num_stages))
        for s, stage in enumerate(stages):
            stage.to(stage_devices[s])
        fused = unshared_parameters(stages) if cut.fuse_weight_grads else None
        runtime = LocalRuntime(
            stages, list(layout.devices), layout.placement, layout.cpu_threads, fused
        )
    else:
        runtime, own, tied = DistributedRuntime.on_rank(
            stages, layout.placement, info, fuse=cut.fuse_weight_grads, on_stage_done=on_stage_done
        )
    register(stages, own)
    random_ops = [t.random_ops for t in stages if isinstance(t, TracedStage)]
    stepper = Stepper(  # a traced model's random operations are places of draws too
        runtime,
        pipe,
        stages,
        stage_devices,
        [r for r in random_ops if r is not None],
        finish=finish,
        put_back=lambda: sync().drop_started(),
        agree=_agreement(runtime, sync) if isinstance(runtime, DistributedRuntime) else None,
    )
    modes = () if sequential else _modes(module)
    return Assembly(key, modes, plan, stages, own, runtime, tied, stepper, unloaded)


def _agreement(runtime: DistributedRuntime, sync: Callable[[], Sync]) -> Callable[[bool], bool]:
    """Whether any rank saw an unseeded draw (every replica's where the step summed gradients)."""
    return lambda spoiled: runtime.any_rank(spoiled, replicas=sync().summing_in_step)


def _example_rank(x: Any) -> tuple[int, int]:
    """Which micro-batch to trace from: fewest dimensions of size 1, then most elements."""
    leaves = [t for t in tensors(x) if t.ndim > 0]
    return (-sum(d == 1 for t in leaves for d in t.shape[1:]), sum(t.numel() for t in leaves))


def _modes(model: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in model.modules())


class Assemblies:
    """The cuts of one pipeline: one per kind of call, made when a call first needs one.

    Args:
        pipe: the Pipeline (its modules name the places of random draws; it
            holds an nn.Sequential's layers and the mesh's reductions).
        model: the model.
        layout, cut: where stages run and how to cut.
    """

    def __init__(self, pipe: Pipeline, model: nn.Module, layout: Layout, cut: Cut) -> None:
        self._pipe, self._model, self._layout, self._cut = pipe, model, layout, cut
        self._all: list[Assembly] = []
        self._current: Assembly | None = None

    def __len__(self) -> int:
        return len(self._all)

    @property
    def current(self) -> Assembly:
        """The cut the last call ran (or the only one).

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

    def add(self, example: Call | tuple[Any, ...] | None, key: tuple[Any, ...] | None) -> Assembly:
        """Cuts the model now (traced from ``example`` unless an nn.Sequential), for ``key``."""
        pipe, layout = self._pipe, self._layout
        assembly = assemble(
            pipe,
            self._model,
            layout,
            self._cut,
            example,
            key=key,
            register=self._register_layers,
            on_stage_done=self._stage_done,
            finish=self._commit_batch_norm,
            sync=lambda: pipe.sync,
        )
        if layout.mesh is not None:
            own = {s: assembly.stages[s] for s in assembly.own}
            pipe.sync = GradientSync(layout.mesh, pipe.parameters(), assembly.tied, own)
        self._all.append(assembly)
        self._current = assembly
        return assembly

    def _stage_done(self, stage: int) -> None:
        """A stage's gradients are final for this step: its replicas may start summing them."""
        assembly = self.current
        assembly.stepper.commit_early(stage_parameters(assembly.stages[stage]))
        self._pipe.sync.stage_done(stage)

    def _commit_batch_norm(self) -> None:
        if self._pipe.training:
            commit_all(self._pipe)

    def for_call(self, call: Call | None, inputs: Sequence[Any]) -> Assembly:
        """The cut that runs ``inputs`` (micro-batches of ``call``), cut now if none fits.

        A new cut is traced from the micro-batch with the fewest dimensions of
        size 1 (export fixes those), the largest among them.

        Raises:
            ConfigError: on a mesh, a call that the first cut does not fit; or
                micro-batches of one step that no one trace can run.
        """
        if call is None:  # an nn.Sequential: cut once, at construction
            return self.current
        key = call_key(call)
        local = self._layout.mesh is None
        for assembly in self._all:
            if assembly.fits(key, inputs, self._model, every_mode=local):
                self._current = assembly
                return assembly
        if self._all:
            self._explain_retrace(key, inputs)
        if len(self._all) >= MAX_CUTS:
            change = describe_change(self.current.key or (), key)
            raise ConfigError(
                f"{type(self._model).__name__} was traced {len(self._all)} times for as many "
                f"kinds of call, and this call needs another: {change}. "
                "A value that changes every call (e.g. num_items_in_batch=<the token count>) "
                "fixes a trace each time: pass a constant instead (for a Hugging Face loss, "
                "num_items_in_batch=1 in the batch and num_items=<count> in step)"
            )
        assembly = self.add(max(inputs, key=_example_rank), key)
        if (reason := assembly.refuses(inputs)) is not None:
            raise ConfigError(
                f"the micro-batches of this step cannot run on one trace of "
                f"{type(self._model).__name__}: {reason}. The model's code fixes that size "
                "(a branch on it, or a size of 1): give one step micro-batches on the same "
                "side of it"
            )
        return assembly

    def _register_layers(self, stages: Sequence[nn.Module], own: list[int]) -> None:
        """An nn.Sequential's layers of this process, under the model's names."""
        if isinstance(self._model, nn.Sequential):
            for s in own:
                for name, layer in sequential_layers(stages[s]):
                    register_named(self._pipe, name, layer)

    def running_here(self) -> bool:
        """Whether the calling thread is one of the workers, inside a step."""
        return any(a.runtime.interpreter.running_here() for a in self._all)

    def _explain_retrace(self, key: tuple[Any, ...], inputs: Sequence[Any]) -> None:
        """Warns of a new trace for a new kind of call; raises on a mesh (it cannot trace again).

        A mode change (``train()``/``eval()``) traces again without a warning:
        it is routine, and each mode's cut is kept.
        """
        old = self.current.key
        change = "a module's training mode changed what the trace fixed (a dropout "
        change += "probability of 0 in eval mode)"
        if old is not None and old != key:
            change = describe_change(old, key)
        elif (reason := self.current.refuses(inputs)) is not None:
            change = f"the call's sizes are outside the trace's: {reason}"
        elif self._layout.mesh is None:
            return
        if self._layout.mesh is not None:
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


def register_model(pipe: nn.Module, module: nn.Module) -> None:
    """Registers ``module``'s children, parameters and buffers on ``pipe``, under their names."""
    for name, layer in module.named_children():
        register_named(pipe, name, layer)
    for name, param in module.named_parameters(recurse=False):
        register_named(pipe, name, param)
    for name, buffer in module.named_buffers(recurse=False):
        persistent = name not in module._non_persistent_buffers_set
        register_named(pipe, name, buffer, persistent=persistent)
