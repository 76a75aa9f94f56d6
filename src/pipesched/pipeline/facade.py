"""Pipeline: a model cut into stages on devices, running micro-batches on a schedule."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import networkx as nx
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipesched.errors import ConfigError, ConfigTypeError, PipeschedWarning, warn_user
from pipesched.partition import Partition
from pipesched.partition.call import Call, call_key, one_call, stage_input, with_cache_off
from pipesched.partition.materialize import InitWeights, check_meta
from pipesched.partition.sequential import check_statistics_in_one_stage, shared_norms
from pipesched.partition.trace import TracedModel
from pipesched.pipeline.arguments import (
    check_grad_backup,
    check_loss,
    check_pipeline,
    warn_host_backup_on_cpu,
)
from pipesched.pipeline.batches import StepBatches, step_batches
from pipesched.pipeline.checks.buffer_updates import warn_buffer_updates, watch_buffers
from pipesched.pipeline.checks.micro_batch_norm import warn_micro_batch_norm
from pipesched.pipeline.checks.model_changes import ModelPrint
from pipesched.pipeline.checks.step_checks import StepChecks
from pipesched.pipeline.outputs import join_step_outputs
from pipesched.pipeline.pinned import Pinned
from pipesched.pipeline.predict_step import predict_step
from pipesched.pipeline.shadowing import Shadowing, register_model, register_named
from pipesched.pipeline.stages import Cuts, Stages, build_stages, example_of
from pipesched.planning import Plan, plan_auto, resolve_plan
from pipesched.planning.devices import Device
from pipesched.runtime.engine import Engine, PendingStep
from pipesched.runtime.gradsync import LocalSync, Sync
from pipesched.runtime.mesh import MeshInfo
from pipesched.runtime.passes import StepInputs
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm
from pipesched.runtime.stage.microbatch import batch_size, scatter
from pipesched.runtime.stage.recompute import check_checkpoint
from pipesched.schedule import Schedule, Timeline
from pipesched.schedule.spec import spec_name

__all__ = ["Pipeline"]


class Pipeline(Shadowing, Pinned):
    """A model cut into stages across devices, fed ``chunks`` micro-batches at a time.

    ``pipe(x)`` is autograd-transparent with GPipe semantics: the output and
    ``loss.backward()`` are those of the plain model. ``pipe.step(...)`` runs
    forward and backward of every micro-batch in the order of the chosen
    schedule (1F1B, interleaved, zero-bubble, ...), each stage on its own
    worker thread.

    Args:
        module: any model. An ``nn.Sequential`` is cut between its children
            at construction. Any other model is traced with ``torch.export``
            on its first call (from that call's first micro-batch) and cut
            between the layers of its stage graph; tensors that cross a cut,
            skip connections included, travel to the stage that uses them.
            Its parameters are the model's own, under its names, from
            construction on.
        chunks: micro-batches per mini-batch; a smaller batch runs fewer.
        balance: layers per stage (torchgpipe's meaning), or how to choose
            them: ``"params"`` (the default for an ``nn.Sequential``),
            ``"time"`` (measured forward + backward; the default for traced
            models), ``"memory"`` or ``"schedule"`` (the cuts with the smallest
            simulated step time). See :mod:`pipesched.partition.model_cut`.
        devices: the device of each worker. None: every CUDA device, or CPU.
            ``["cpu", "cpu"]`` gives two workers that run in parallel.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which
            micro-batches recompute their forward in backward; or one per stage
            (``["always", "never"]``). None: ``"except_last"``, or the planner's pick.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``,
            ``"zb-h2"``, or the V schedules ``"zb-v"``, ``"dualpipev"``,
            ``"v-half"``, ``"v-min"`` (schedules with several stages per worker need
            ``len(balance)`` to be that many times ``len(devices)``); or a
            :class:`~pipesched.Schedule` of your own (from CSV, or built
            action by action), validated here, for ``chunks`` micro-batches; or
            ``"auto"``: :mod:`pipesched.planning` measures the model on ``example_inputs``,
            picks schedule, cut and checkpoint mode (those not given) within ``memory_budget``.
        deferred_batch_norm: replace BatchNorm layers by DeferredBatchNorm,
            whose running statistics equal BatchNorm's on the whole mini-batch.
        example_inputs: one call's positional arguments (best one
            micro-batch), or a :class:`~pipesched.partition.call.Call` with keywords:
            a model that is not an ``nn.Sequential`` is traced and cut on it
            at construction instead of on its first call; every balance but
            ``"params"`` measures on it.
        num_stages: stages to cut when ``devices`` is not given (workers, under ``"auto"``).
        split_points: instead of ``balance``: the names of the modules that
            begin stages 1, 2, ... (``["transformer.h.2"]``).
        memory_budget: bytes per worker that ``balance="time"`` or ``"schedule"``
            (or ``schedule="auto"``) must fit (parameters, gradients, held activations;
            one gradient buffer: under ``grad_backup="device"`` a step after a
            window's first holds a second).
        mesh: the ("dp", "pp") device mesh of a torchrun job
            (:func:`pipesched.runtime.mesh.init_mesh`): this process runs its
            pp rank's stages and syncs gradients with its dp replicas.
        fuse_weight_grads: accumulate ``linear`` weight gradients into ``.grad``
            inside the GEMM in steps, as Megatron-LM does (same sums, less time;
            see :mod:`pipesched.runtime.fused_linear` for when it applies).
        init_weights: for a model built under ``torch.device("meta")`` (each
            process allocates only its stages): None (``reset_parameters()``),
            a callable ``init_weights(name, module)`` or ``"skip"`` (a checkpoint
            load follows); the weights are the same whatever the cut
            (:mod:`pipesched.partition.materialize`).
        grad_backup: where a step keeps the gradients of the window's earlier
            steps, to put them back if it fails. ``"device"`` (the default): set
            aside where they are while the step adds into new tensors (no copy;
            two gradient buffers during a window's later steps). ``"host"``: CUDA
            gradients are copied to pinned host memory and the step adds in place
            (one buffer on the GPU, a copy per later step; CPU gradients are set
            aside). ``"disk"``: every gradient is written to a temporary file in
            ``TMPDIR`` and the step adds in place (one buffer in memory, a file
            write per later step). The copies are read back only if a step fails.
            A ``GradientAccumulator``'s window end keeps its copies of the
            parameters and optimizer state in the same place.

    Attributes:
        stage_graph: the model as a ``networkx.DiGraph`` of layers or traced
            operations with their costs (:mod:`pipesched.partition.stage_graph`).
        partition: the per-stage table of layers, parameters, time and
            activation memory; ``print(pipe.partition)``.
        plan: the frozen :class:`~pipesched.planning.Plan` it runs: schedule,
            workers, cut arguments, recomputation; under ``schedule="auto"``
            its ``report`` holds every candidate the planner compared and its
            pick (``print(pipe.plan)`` shows them).

    Raises:
        ConfigTypeError: an argument has the wrong type (also a ``TypeError``).
        ConfigError: an argument is out of range; the message names the fix.
        PartitionError: ``balance`` does not fit the module, or the model
            cannot be traced (the message names the failing line and the fix).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> pipe = Pipeline(model, 2, balance=[2, 1], devices=["cpu", "cpu"], schedule="1f1b")
        >>> x, y = torch.randn(6, 4), torch.randn(6, 2)
        >>> loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        >>> [name for name, _ in pipe.named_parameters()]
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int = 1,
        *,
        balance: Sequence[int] | str | None = None,
        devices: Sequence[Device] | None = None,
        checkpoint: str | Sequence[str] | None = None,
        schedule: str | Schedule = "gpipe",
        deferred_batch_norm: bool = False,
        example_inputs: tuple[Any, ...] | None = None,
        num_stages: int | None = None,
        mesh: DeviceMesh | None = None,
        split_points: Sequence[str] | None = None,
        memory_budget: float | None = None,
        fuse_weight_grads: bool = True,
        init_weights: InitWeights = None,
        grad_backup: str = "device",
    ) -> None:
        super().__init__()
        check_pipeline(module, chunks, balance, num_stages, memory_budget)
        check_grad_backup(grad_backup)
        checked = check_checkpoint(checkpoint, planned=schedule == "auto")
        info = None if mesh is None else MeshInfo.of(mesh)
        init_weights = check_meta(module, example_inputs, init_weights)
        traced: TracedModel | None = None  # the planner's trace of the model, to cut with
        if schedule == "auto":
            plan, traced = plan_auto(
                module,
                chunks,
                balance=balance,
                devices=devices,
                checkpoint=checked if isinstance(checked, str) else None,  # a tuple: refused
                example_inputs=example_inputs,
                mesh=info,
                memory_budget=memory_budget,
                num_stages=num_stages,
                split_points=split_points,
                deferred_batch_norm=deferred_batch_norm,
                fuse_weight_grads=fuse_weight_grads,
                init_weights=init_weights,
            )
        else:
            plan = resolve_plan(
                schedule,
                chunks,
                devices=devices,
                balance=balance,
                num_stages=num_stages,
                split_points=split_points,
                checkpoint=checked or "except_last",
                mesh=info,
                memory_budget=memory_budget,
                deferred_batch_norm=deferred_batch_norm,
                fuse_weight_grads=fuse_weight_grads,
                init_weights=init_weights,
            )
        sequential = isinstance(module, nn.Sequential)
        if deferred_batch_norm and sequential:
            DeferredBatchNorm.convert(module)  # replaces the BatchNorm layers in place
        warn_host_backup_on_cpu(grad_backup, plan.devices)
        self._plan = plan
        self._grad_backup = grad_backup
        self._model = (module,)  # a tuple: its layers are registered, not the model itself
        self._cuts = Cuts(module, mesh_bound=info is not None)
        self._print: ModelPrint | None = None  # the model as the cuts hold it
        self._live: set[int] | None = None if isinstance(module, nn.Sequential) else set()
        self.last_timeline: Timeline | None = None
        """The last call's measured actions (this process's)."""
        self.last_step_seconds: float | None = None
        """The last training step's wall time."""
        if sequential:
            self._add_cut(example_inputs, None)
        else:  # the whole model's children, its own parameters and buffers, from now on
            # Why the model's own dicts, not copies: a tensor assigned on either side
            # (pipe.load_state_dict(sd, assign=True), model.shift = t) is the one the stages
            # read and the one pipe.state_dict() saves. The Pipeline holds none of its own.
            for store in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
                self.__dict__[store] = getattr(module, store)
            register_model(self, module)
            if example_inputs is not None:
                call = with_cache_off(module, Call.of(example_inputs))
                self._add_cut(call, call_key(call), traced)

    def _add_cut(
        self,
        example: Call | tuple[Any, ...] | None,
        key: tuple[Any, ...] | None,
        traced: TracedModel | None = None,
    ) -> tuple[Stages, Engine]:
        """Cuts the model for calls of ``key`` (traced from ``example``), registers its
        layers and builds the engine that runs it."""
        model = self._model[0]
        stages = build_stages(model, self._plan, example, key=key, traced=traced)
        if stages.swaps is not None:  # built on meta: hold the tensors the model holds now
            stages.swaps.apply(self)
        for name, child in stages.replaced.items():  # a top-level BatchNorm made deferred
            if name in self._modules:
                self._modules[name] = child
        for name, layer in stages.layers:
            register_named(self, name, layer)
        engine = Engine(
            stages.modules,
            stages.own,
            stages.tied,
            self._plan.workers,
            model=self,
            extra_names=stages.random_ops,
            fuse=self._plan.fuse_weight_grads,
            grad_backup=self._grad_backup,
        )
        self._cuts.add(stages, engine)
        self._shared_norms = shared_norms(stages.modules) if stages.cut.traced is None else []
        if self._live is not None:  # a traced stage's called layers run their own code
            self._live.update(id(m) for stage in stages.modules for m in stage.modules())
        self._print = ModelPrint.of(model, self._live)
        return stages, engine

    def _cut_for(self, call: Call | None, inputs: list[Any]) -> tuple[Stages, Engine]:
        """The cut that runs ``inputs`` (micro-batches of ``call``), cut now if none fits."""
        if self._print is not None:
            now = ModelPrint.of(self._model[0], self._live)
            self._print.check(now, "the model changed since the Pipeline was built on it")
            if (change := self._print.python_change(now)) is not None:
                self._print = now  # told once per change
                warn_user(
                    f"{change} after the model was traced: the trace runs the model's code "
                    "as it was then (torch.export fixed such values, and calls no hook "
                    "added since), so if its forward reads this, build a new Pipeline over "
                    "the model (its parameters are the model's)",
                    PipeschedWarning,
                )
        if call is None:  # an nn.Sequential: cut once, at construction
            check_statistics_in_one_stage(self._shared_norms)
            return self._cuts.current
        found = self._cuts.find(call, inputs)
        if found is None:
            found = self._add_cut(example_of(inputs), call_key(call))
            self._cuts.check_fit(found[0], inputs)
        return found

    @property
    def plan(self) -> Plan:
        """What this pipeline runs: schedule, workers, cut arguments, recomputation."""
        return self._plan

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch (assignable)."""
        return self._plan.chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        check_pipeline(self._model[0], value, None, None, None)
        self._plan = dataclasses.replace(self._plan, chunks=value)

    @property
    def checkpoint(self) -> str | tuple[str, ...]:
        """The recomputation mode, or one per stage (assignable)."""
        return self._plan.checkpoint

    @checkpoint.setter
    def checkpoint(self, value: str | Sequence[str]) -> None:
        mode = check_checkpoint(value, planned=False) or "except_last"
        plan = dataclasses.replace(self._plan, checkpoint=mode)
        plan.stage_stops(1)  # one mode per stage?
        self._plan = plan

    @property
    def grad_backup(self) -> str:
        """Where steps keep what they may have to put back: ``"device"``, ``"host"``, ``"disk"``."""
        return self._grad_backup

    @property
    def schedule(self) -> str | Schedule:
        """The schedule asked for: a built-in's name, or the one Schedule given."""
        return self._plan.schedule

    @property
    def schedule_name(self) -> str:
        """The schedule's name."""
        return spec_name(self._plan.schedule)

    @property
    def mesh(self) -> MeshInfo | None:
        """This rank's place in the mesh, or None in one process."""
        return self._plan.mesh

    @property
    def devices(self) -> list[torch.device]:
        """The device of each worker."""
        return list(self._plan.devices)

    @property
    def placement(self) -> tuple[int, ...]:
        """The worker of each stage."""
        return self._plan.placement

    @property
    def num_stages(self) -> int:
        """Model stages."""
        return self._plan.num_stages

    @property
    def balance(self) -> list[int]:
        """Layers (or traced operations' layers) per stage, as cut."""
        return list(self._cuts.current[0].cut.counts)

    @property
    def stage_graph(self) -> nx.DiGraph:
        """The model as a networkx graph of layers or traced operations, with their costs."""
        return self._cuts.current[0].cut.graph

    @property
    def partition(self) -> Partition:
        """Per stage: layers, parameters, time, activation memory (print it)."""
        return self._cuts.current[0].partition

    @property
    def is_cut(self) -> bool:
        """Whether the model is cut into stages (a traced model is cut at its first call)."""
        return len(self._cuts) > 0

    @property
    def num_cuts(self) -> int:
        """How many cuts the model has: one per kind of call (and training mode) traced."""
        return len(self._cuts)

    @property
    def tied_ranks(self) -> dict[int, tuple[int, ...]]:
        """On a mesh, for each of this rank's parameters (by ``id``) that stages on other
        pp ranks use too, the sorted pp ranks that use it; empty in one process."""
        return self._cuts.current[0].tied

    @property
    def stages(self) -> tuple[nn.Module, ...]:
        """The stage modules, sharing their layers with this Pipeline."""
        return tuple(self._cuts.current[0].modules)

    @property
    def engine(self) -> Engine:
        """What runs the steps of the current cut: runtime, seeding, transaction, sync."""
        return self._cuts.current[1]

    @property
    def sync(self) -> Sync:
        """The reductions over the mesh's replicas and ranks (the identity locally)."""
        return self._cuts.current[1].sync if self.is_cut else LocalSync()

    def running_here(self) -> bool:
        """Whether the calling thread is one of this pipeline's workers, inside a step."""
        return self._cuts.running_here()

    def train(self, mode: bool = True) -> Pipeline:
        """Sets training mode (``eval()``: ``train(False)``) here and on the model itself.

        Why the model too: its layers are registered here, the model is not, so its own
        ``training`` (read by code that branches on ``self.training``) stayed as it was.
        """
        super().train(mode)
        self._model[0].train(mode)
        return self

    def __reduce_ex__(self, protocol: object) -> Any:
        """Refused: a Pipeline is not copied (``copy``, ``copy.deepcopy``) nor pickled.

        Why not as ``nn.Module`` (which pickles): it owns worker threads, streams and,
        on a mesh, process groups, and a shallow copy would share a step's state.
        """
        raise ConfigTypeError(
            "a Pipeline cannot be copied or pickled (copy.copy, copy.deepcopy, pickle, "
            "torch.save of the Pipeline): it owns worker threads and, on a mesh, process "
            "groups. Copy its weights instead: twin = copy.deepcopy(model); "
            "twin.load_state_dict(pipe.state_dict()) (wrap the twin in a Pipeline of its "
            "own if it should run pipelined); save with torch.save(pipe.state_dict(), f), "
            "or GradientAccumulator.save(path) to resume training"
        )

    def schedule_for(self, num_microbatches: int) -> Schedule:
        """The validated schedule this pipeline runs for ``num_microbatches`` micro-batches."""
        return self._plan.schedule_for(num_microbatches)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output on ``model(*args, **kwargs)``, computed micro-batch by micro-batch.

        Autograd-transparent: ``loss_fn(pipe(x), y).backward()`` gives the
        plain model's gradients. The output has the model's own type (a
        tensor, a tuple, a dict, a Hugging Face ``ModelOutput``): tensors are
        concatenated along dim 0, and a 0-dim floating-point tensor (a loss
        the model computes) is the mean of the micro-batches' values weighted
        by their rows. Under ``torch.no_grad()`` it only streams forward.
        With a mesh it runs only under ``torch.no_grad()`` (a backward cannot
        follow the output across ranks: train with :meth:`step`) and returns
        the output on the last stage's rank, None on the others.
        """
        batch = stage_input(self._model[0], args, kwargs)
        mesh = self.mesh
        if mesh is not None and torch.is_grad_enabled():
            raise ConfigError(
                "with a mesh, pipe(x) runs forward only: call it under torch.no_grad() "
                "(evaluation), and train with pipe.step or GradientAccumulator.step, whose "
                "backward crosses the ranks"
            )
        micro = scatter(batch, self.chunks)
        stages, engine = self._cut_for(batch if isinstance(batch, Call) else None, micro)
        if stages.unloaded is not None:
            stages.unloaded.check("pipe(x)")
        rows = [batch_size(m) for m in micro]
        warn_micro_batch_norm(self, rows, stages.cut.traced)
        watch = watch_buffers(self, self._model[0], len(micro))
        step = StepInputs(micro, checkpoint_stop=self._plan.stage_stops(len(micro)))
        result = engine.run(self.schedule_for(len(micro)), step, detach=False)
        self.last_timeline = result.timeline
        warn_buffer_updates(self, watch, self._model[0], len(micro))
        if mesh is not None and self.placement[-1] != mesh.pp_rank:
            return None
        return join_step_outputs(batch, result.outputs, rows, stages.modules[-1], micro)

    def step(
        self,
        inputs: Any = None,
        target: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch, in the schedule's order.

        The loss is applied per micro-batch on the last stage:
        ``loss_fn(output, target)`` (``loss_fn(output)`` without a target).
        Gradients accumulate into ``.grad`` and equal those of the plain
        model's loss on the whole batch.

        Args:
            inputs: the model's input (one argument: a tensor, tuple or dict),
                cut into ``chunks`` micro-batches.
            target: the loss target, cut into micro-batches like ``inputs``.
            loss_fn: returns a scalar: the mean over its micro-batch's
                samples when ``num_items`` is None (pipesched weights it by
                the micro-batch's share of the batch's rows), or a sum over
                items (e.g. tokens) when ``num_items`` is given.
            num_items: the batch's total item count; every micro-batch's sum
                is divided by it.
            microbatches: instead of ``inputs``, the micro-batches themselves,
                each what one micro-batch of ``inputs`` would be, with shapes
                of their own (rows, sequence lengths); the step runs
                ``len(microbatches)`` of them, whatever ``chunks`` is.
            targets: with ``microbatches``: None, or one target per micro-batch.

        Returns:
            The normalized loss of the batch, detached.

        Raises:
            ConfigTypeError: ``loss_fn`` is not callable, ``num_items`` not a
                number, or ``microbatches``/``targets`` not a list.
            ConfigError: ``inputs`` requires grad (pass ``x.detach()``),
                ``num_items`` is not positive, both or neither of ``inputs`` and
                ``microbatches`` are given (or ``target`` with ``microbatches``,
                ``targets`` with ``inputs``), or a micro-batch is empty or its
                target has another row count.
        """
        check_loss(loss_fn, num_items)
        batches = self._batches(inputs, target, microbatches, targets)
        count = batches.items(num_items, positive=True)
        summed = num_items is not None
        loss, pending = self._train(batches, loss_fn, summed=summed, scale=1.0 / count)
        pending.settle()
        return loss

    def accumulate(
        self,
        inputs: Any = None,
        target: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
        scale: float = 1.0,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Like :meth:`step`, but adds the gradients of the batch's *summed* loss, not its mean.

        The building block of accumulation windows (see
        :class:`pipesched.GradientAccumulator`): gradients of sums accumulate
        across calls and are divided once, at the window's end, by the
        window's item count. Nothing is normalized here.

        Args:
            inputs, target, loss_fn, microbatches, targets: as in :meth:`step`.
            num_items: None when ``loss_fn`` returns a mean over samples (it is
                then multiplied by the micro-batch's sample count); otherwise
                ``loss_fn`` returns a sum over items and this is their count
                (0 is allowed: a batch of padding).
            scale: multiplies every loss before backward (a GradScaler's scale).

        Returns:
            ``(summed loss, item count)``, the loss detached and unscaled.

        Raises:
            ConfigTypeError, ConfigError: as :meth:`step`.
        """
        loss, items, pending = self.accumulate_pending(
            inputs,
            target,
            loss_fn=loss_fn,
            num_items=num_items,
            scale=scale,
            microbatches=microbatches,
            targets=targets,
        )
        pending.settle()
        return loss, items

    def accumulate_pending(
        self,
        inputs: Any = None,
        target: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
        scale: float = 1.0,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
    ) -> tuple[torch.Tensor, float, PendingStep]:
        """:meth:`accumulate`, the step left for the caller to keep: for an owner that counts
        steps (:class:`pipesched.GradientAccumulator`).

        Ctrl-C is held from the step's commit until the caller calls the
        returned step's ``keep()`` (which undoes the step and raises where a
        Ctrl-C came), counts the step, and then calls ``release()`` (which
        raises a Ctrl-C held since); ``abandon(error)`` where it failed first.

        Returns:
            ``(summed loss, item count, the pending step)``.
        """
        check_loss(loss_fn, num_items)
        batches = self._batches(inputs, target, microbatches, targets)
        items = batches.items(num_items, positive=False)
        total, pending = self._train(batches, loss_fn, summed=num_items is not None, scale=scale)
        try:
            loss = total / scale
        except BaseException as error:
            pending.abandon(error)
            raise
        return loss, items, pending

    def _batches(self, inputs: Any, target: Any, microbatches: Any, targets: Any) -> StepBatches:
        """The step's micro-batches, each as stage 0 takes it (a Call for a traced model)."""
        model = self._model[0]
        if inputs is not None:
            inputs = stage_input(model, (inputs,), {})
        if isinstance(microbatches, list | tuple):
            microbatches = [stage_input(model, (x,), {}) for x in microbatches]
        return step_batches(inputs, target, microbatches, targets, chunks=self.chunks)

    def _train(
        self,
        batches: StepBatches,
        loss_fn: Callable[..., torch.Tensor],
        *,
        summed: bool,
        scale: float,
    ) -> tuple[torch.Tensor, PendingStep]:
        """Forward and backward of every micro-batch of ``batches`` in the schedule's order.

        Micro-batch i's loss weighs ``scale`` (``loss_fn`` returns a sum) or
        ``scale * rows_i`` (a mean). Returns the weighted sum, on every rank,
        and the step, for the caller to settle.
        """
        begin = time.perf_counter()
        checks = StepChecks(self, self._model[0], batches, summed=summed)
        m = len(batches.inputs)
        stages, engine = self._cut_for(one_call(batches.inputs), batches.inputs)
        if stages.unloaded is not None:
            stages.unloaded.check("the training step")
        keep = checks.before_run(stages)
        step = StepInputs(
            inputs=batches.inputs,
            targets=batches.targets,
            loss_fn=loss_fn,
            loss_weights=[scale if summed else scale * rows for rows in batches.rows],
            checkpoint_stop=self._plan.stage_stops(m),
            keep_outputs=keep,
        )
        result = engine.run(self.schedule_for(m), step, detach=True, settle=False)
        self.last_timeline = result.timeline
        self.last_step_seconds = time.perf_counter() - begin
        # A training step's loss is never None, and its pending step is there.
        pending = cast(PendingStep, result.pending)
        checks.after_run(result, step, loss_fn, stages.modules[-1], pending)
        return cast(torch.Tensor, result.loss), pending

    def gather_timeline(self, *, everywhere: bool = False) -> Timeline | None:
        """The last step's timeline with every rank's actions, on pipeline rank 0.

        Locally this is :attr:`last_timeline`. With a mesh it is a collective
        over the pipeline's ranks (call it on all of them): pp rank 0 gets
        every rank's measured events, clocks aligned, and the others None
        (``everywhere``: every rank gets them).
        """
        if self.mesh is None or self.last_timeline is None:
            return self.last_timeline
        return self.engine.gather_timeline(self.last_timeline, everywhere=everywhere)

    def predict(self, num_microbatches: int | None = None) -> Timeline:
        """This pipeline's step simulated with its own measured costs (see its ``summary()``).

        From the last step's actions (a collective on a mesh), else the partition's times, for
        ``num_microbatches`` (default: as measured); :mod:`pipesched.pipeline.predict_step` says
        more.
        """
        return predict_step(self, num_microbatches)
