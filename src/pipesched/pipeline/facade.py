"""Pipeline: a model cut into stages on devices, running micro-batches on a schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipesched.partition import Partition
from pipesched.partition.call import Call, call_key, stage_input, with_cache_off
from pipesched.partition.materialize import InitWeights, check_meta
from pipesched.partition.shared_traces import traces_shared
from pipesched.pipeline.arguments import check_loss, check_pipeline
from pipesched.pipeline.batches import StepBatches, step_batches
from pipesched.pipeline.calls import gather_timeline, run_forward, run_training
from pipesched.pipeline.pinned import Pinned
from pipesched.pipeline.predict_step import predict_step
from pipesched.pipeline.shadowing import Shadowing
from pipesched.pipeline.stages import Assemblies, Assembly, register_model
from pipesched.planning import Planning, plan_auto
from pipesched.planning.devices import Device
from pipesched.planning.plan import Cut, resolve_layout
from pipesched.runtime.engine import Stepper
from pipesched.runtime.gradsync import LocalSync, Sync
from pipesched.runtime.interpreter import Runtime
from pipesched.runtime.mesh import MeshInfo
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm
from pipesched.runtime.stage.recompute import check_checkpoint, stage_stops
from pipesched.schedule import Schedule, Timeline
from pipesched.schedule.spec import check_spec, schedule_for, spec_name

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
            (or ``schedule="auto"``) must fit (parameters, gradients, held activations).
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

    Attributes:
        stage_graph: the model as a ``networkx.DiGraph`` of layers or traced
            operations with their costs (:mod:`pipesched.partition.stage_graph`).
        partition: the per-stage table of layers, parameters, time and
            activation memory; ``print(pipe.partition)``.
        plan: under ``schedule="auto"``, every candidate the planner compared
            and its pick (``print(pipe.plan)``); else None.

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
    ) -> None:
        super().__init__()
        check_pipeline(module, chunks, balance, num_stages, memory_budget)
        checkpoint = check_checkpoint(checkpoint, planned=schedule == "auto")
        info = None if mesh is None else MeshInfo.of(mesh)
        self.plan: Planning | None = None  # what schedule="auto" compared and picked
        # One trace of the model for the planner's pipelines and the pick (the model is not
        # changed in between); elsewhere each Pipeline traces anew.
        with traces_shared() if schedule == "auto" else contextlib.nullcontext():
            if schedule == "auto":  # the planner's pick stands for the arguments it chose
                auto = plan_auto(
                    module,
                    chunks,
                    balance,
                    devices,
                    checkpoint if isinstance(checkpoint, str) else None,  # a tuple: refused above
                    example_inputs,
                    info,
                    memory_budget=memory_budget,
                    num_stages=num_stages,
                )
                schedule, balance, checkpoint, devices, self.plan = auto.arguments(devices)
                memory_budget = num_stages = None
            checkpoint = checkpoint or "except_last"
            schedule = check_spec(schedule, chunks)
            sequential = isinstance(module, nn.Sequential)
            if deferred_batch_norm and sequential:
                DeferredBatchNorm.convert(module)  # replaces the BatchNorm layers in place
            self._layout = resolve_layout(
                schedule, devices, balance, num_stages, split_points, info
            )
            stage_stops(checkpoint, len(self._layout.placement), 1)  # one mode per stage?
            meta = check_meta(module, example_inputs, init_weights)
            self._cut = Cut(
                chunks,
                balance,
                split_points,
                memory_budget,
                deferred_batch_norm,
                fuse_weight_grads,
                meta,
            )
            self._model = (module,)  # a tuple: its layers are registered, not the model itself
            self.chunks = chunks
            self.checkpoint = checkpoint
            self.sync: Sync = LocalSync()
            """The reductions over the mesh's replicas and ranks (the identity locally)."""
            self.last_timeline: Timeline | None = None
            self.last_step_seconds: float | None = None
            self._assemblies = Assemblies(self, module, self._layout, self._cut)
            if sequential:
                self._assemblies.add(example_inputs, None)
            else:  # the whole model's children, its own parameters and buffers, from now on
                register_model(self, module)
                if example_inputs is not None:
                    call = with_cache_off(module, Call.of(example_inputs))
                    self._assemblies.add(call, call_key(call))

    def _assembly_for(self, call: Call | None, inputs: list[Any]) -> Assembly:
        """The cut that runs ``inputs`` (micro-batches of ``call``), cut now if none fits."""
        return self._assemblies.for_call(call, inputs)

    def _built(self) -> Assembly:
        return self._assemblies.current

    @property
    def schedule(self) -> str | Schedule:
        """The schedule asked for: a built-in's name, or the one Schedule given."""
        return self._layout.schedule

    @property
    def schedule_name(self) -> str:
        """The schedule's name."""
        return spec_name(self._layout.schedule)

    @property
    def mesh(self) -> MeshInfo | None:
        """This rank's place in the mesh, or None in one process."""
        return self._layout.mesh

    @property
    def devices(self) -> list[torch.device]:
        """The device of each worker."""
        return list(self._layout.devices)

    @property
    def placement(self) -> tuple[int, ...]:
        """The worker of each stage."""
        return self._layout.placement

    @property
    def num_stages(self) -> int:
        """Model stages."""
        return len(self._layout.placement)

    @property
    def balance(self) -> list[int]:
        """Layers (or traced operations' layers) per stage, as cut."""
        return list(self._built().plan.counts)

    @property
    def stage_graph(self) -> nx.DiGraph:
        """The model as a networkx graph of layers or traced operations, with their costs."""
        return self._built().plan.graph

    @property
    def partition(self) -> Partition:
        """Per stage: layers, parameters, time, activation memory (print it)."""
        return self._built().partition

    @property
    def is_cut(self) -> bool:
        """Whether the model is cut into stages (a traced model is cut at its first call)."""
        return len(self._assemblies) > 0

    @property
    def tied_ranks(self) -> dict[int, tuple[int, ...]]:
        """On a mesh, for each of this rank's parameters (by ``id``) that stages on other
        pp ranks use too, the sorted pp ranks that use it; empty in one process."""
        return self._built().tied

    @property
    def stages(self) -> tuple[nn.Module, ...]:
        """The stage modules, sharing their layers with this Pipeline."""
        return tuple(self._built().stages)

    @property
    def _runtime(self) -> Runtime:
        return self._built().runtime

    @property
    def _stepper(self) -> Stepper:
        return self._built().stepper

    def running_here(self) -> bool:
        """Whether the calling thread is one of this pipeline's workers, inside a step."""
        return self._assemblies.running_here()

    def schedule_for(self, num_microbatches: int) -> Schedule:
        """The validated schedule this pipeline runs for ``num_microbatches`` micro-batches."""
        return schedule_for(self._layout.schedule, self.num_stages, num_microbatches)

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
        return run_forward(self, self._batch(args, kwargs))

    def _batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return stage_input(self._model[0], args, kwargs)

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
        return run_training(self, batches, loss_fn, summed=num_items is not None, scale=1.0 / count)

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
        check_loss(loss_fn, num_items)
        batches = self._batches(inputs, target, microbatches, targets)
        items = batches.items(num_items, positive=False)
        total = run_training(self, batches, loss_fn, summed=num_items is not None, scale=scale)
        return total / scale, items

    def _batches(self, inputs: Any, target: Any, microbatches: Any, targets: Any) -> StepBatches:
        """The step's micro-batches, each as stage 0 takes it (a Call for a traced model)."""
        if inputs is not None:
            inputs = self._batch((inputs,), {})
        if isinstance(microbatches, list | tuple):
            microbatches = [self._batch((x,), {}) for x in microbatches]
        return step_batches(inputs, target, microbatches, targets, chunks=self.chunks)

    def gather_timeline(self) -> Timeline | None:
        """The last step's timeline with every rank's actions, on pipeline rank 0.

        Locally this is :attr:`last_timeline`. With a mesh it is a collective
        over the pipeline's ranks (call it on all of them): pp rank 0 gets
        every rank's measured events, clocks aligned, and the others None.
        """
        return gather_timeline(self)

    def predict(self, num_microbatches: int | None = None) -> Timeline:
        """This pipeline's step simulated with its own measured costs (see its ``summary()``).

        From the last step's actions (a collective on a mesh), else the partition's times, for
        ``num_microbatches`` (default: as measured); :mod:`pipesched.pipeline.predict_step` says
        more.
        """
        return predict_step(self, num_microbatches)
