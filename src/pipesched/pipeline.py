"""Pipeline: a model cut into stages on devices, running micro-batches on a schedule."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import networkx as nx
import torch
from torch import nn

from pipesched.arguments import check_pipeline, check_step
from pipesched.batchnorm import DeferredBatchNorm, commit_all
from pipesched.checkpoint import checkpoint_stop
from pipesched.devices import Device, resolve_workers, threads_per_worker
from pipesched.distributed.mesh import MeshInfo, rank0_value
from pipesched.distributed.placement import stage_parameters
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.microbatch import batch_size, gather, scatter
from pipesched.partition import Partition, TracedStage, check_balance, plan_partition
from pipesched.partition.sequential import sequential_layers
from pipesched.runtime.distributed import DistributedRuntime, broadcast_loss
from pipesched.runtime.fused_linear import unshared_parameters
from pipesched.runtime.gradsync import GradientSync, LocalSync, Sync
from pipesched.runtime.local import LocalRuntime, StepInputs
from pipesched.runtime.tree import tensors
from pipesched.schedule import Schedule, Timeline, get_schedule, stages_per_worker
from pipesched.stepper import Stepper

__all__ = ["Pipeline"]


class Pipeline(nn.Module):
    """A model cut into stages across devices, fed ``chunks`` micro-batches at a time.

    ``pipe(x)`` is autograd-transparent with GPipe semantics: the output and
    ``loss.backward()`` are those of the plain model. ``pipe.step(...)`` runs
    forward and backward of every micro-batch in the order of the chosen
    schedule (1F1B, interleaved, zero-bubble, ...), each stage on its own
    worker thread.

    Args:
        module: an ``nn.Sequential`` (cut between its children), or any
            model, traced with ``torch.export`` on ``example_inputs`` and cut
            between the layers of its stage graph; tensors that cross a cut,
            skip connections included, travel to the stage that uses them.
        chunks: micro-batches per mini-batch; a smaller batch runs fewer.
        balance: layers per stage (torchgpipe's meaning), or how to choose
            them: ``"params"`` (the default for an ``nn.Sequential``),
            ``"time"`` (measured forward + backward; the default for traced
            models), ``"memory"`` or ``"schedule"`` (the cuts with the smallest
            simulated step time). See :mod:`pipesched.partition.plan`.
        devices: the device of each worker. None: every CUDA device, or CPU.
            ``["cpu", "cpu"]`` gives two workers that run in parallel.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``:
            which micro-batches recompute their forward in backward.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``
            or ``"zb-v"``. Schedules with several stages per worker need
            ``len(balance)`` to be that many times ``len(devices)``.
        deferred_batch_norm: replace BatchNorm layers by DeferredBatchNorm,
            whose running statistics equal BatchNorm's on the whole mini-batch.
        example_inputs: the positional arguments of one call of ``module``
            (best one micro-batch): what a non-Sequential model is traced
            with, and what every balance but ``"params"`` measures. A traced
            pipeline takes ``example_inputs[0]``'s kind of input (a tuple of
            them when there are several).
        num_stages: stages to cut when ``devices`` is not given.
        split_points: instead of ``balance``: the names of the modules that
            begin stages 1, 2, ... (``["transformer.h.2"]``).
        memory_budget: bytes per worker that ``balance="time"`` or
            ``"schedule"`` must fit (parameters, gradients, held activations).
        fuse_weight_grads: in :meth:`step` and :meth:`accumulate`, accumulate
            the weight gradients of ``linear`` layers into ``.grad`` inside
            the GEMM, as Megatron-LM does: the same sums, 30-40% less backward
            time for small micro-batches on CPU. Weights under 2 MiB (where
            it would lose), parameters shared between stages, with hooks, or
            under autocast always take the ordinary path
            (:mod:`pipesched.runtime.fused_linear`).

    Attributes:
        stage_graph: the model as a ``networkx.DiGraph`` of layers or traced
            operations with their costs (:mod:`pipesched.partition.graph`).
        partition: the per-stage table of layers, parameters, time and
            activation memory; ``print(pipe.partition)``.

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
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        deferred_batch_norm: bool = False,
        example_inputs: tuple[Any, ...] | None = None,
        num_stages: int | None = None,
        mesh: Any = None,
        split_points: Sequence[str] | None = None,
        memory_budget: float | None = None,
        fuse_weight_grads: bool = True,
    ) -> None:
        super().__init__()
        check_pipeline(module, chunks, balance, num_stages, memory_budget)
        checkpoint_stop(checkpoint, 1)  # checks the mode's name
        v = stages_per_worker(schedule)  # checks the schedule's name
        sequential = isinstance(module, nn.Sequential)
        if not sequential and example_inputs is None:
            raise ConfigError(
                f"module is a {type(module).__name__}, not an nn.Sequential; pass "
                "example_inputs=(...) and num_stages= to have it traced and split, or wrap "
                "its layers in an nn.Sequential"
            )
        if deferred_batch_norm and sequential:
            DeferredBatchNorm.convert(module)  # replaces the BatchNorm layers in place
        counts = None if balance is None or isinstance(balance, str) else list(balance)
        requested = num_stages
        if counts is not None or split_points is not None:
            requested = len(counts) if counts is not None else len(list(split_points or ())) + 1
        info = None if mesh is None else MeshInfo.of(mesh)
        workers, chosen_devices = resolve_workers(schedule, v, devices, counts, requested, info)
        if counts is not None and isinstance(module, nn.Sequential):
            check_balance(module, counts)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule_name = schedule
        self.devices = [torch.device(d) for d in chosen_devices]
        self.placement = get_schedule(schedule, workers * v, 1).placement
        stage_devices = [self.devices[w] for w in self.placement]
        cpu_threads = threads_per_worker(sum(d.type == "cpu" for d in self.devices))
        plan_of = functools.partial(
            plan_partition,
            module,
            num_stages=workers * v,
            devices=stage_devices,
            schedule=schedule,
            num_microbatches=chunks,
            example_inputs=example_inputs,
            memory_budget=memory_budget,
            num_threads=cpu_threads,
        )
        plan = plan_of(balance=balance, split_points=split_points)
        if info is not None and list(plan.counts) != (agreed := rank0_value(list(plan.counts))):
            # Measured balances (time, schedule) can differ between ranks: rank 0's cut wins.
            plan = plan_of(balance=agreed)
        if deferred_batch_norm and not sequential:
            DeferredBatchNorm.convert(module)  # after tracing: the stages call the new layers
        stages = plan.build(module, stage_devices)
        self.balance = list(plan.counts)
        self.stage_graph: nx.DiGraph = plan.graph
        """The model as a networkx graph of layers or traced operations, with their costs."""
        self.partition: Partition = plan.partition
        """Per stage: layers, parameters, time, activation memory (print it)."""
        self.mesh = info
        self.sync: Sync = LocalSync()
        self._runtime: LocalRuntime
        if info is None:
            own = list(range(len(stages)))
            for s, stage in enumerate(stages):
                stage.to(self.devices[self.placement[s]])
            cpu_workers = sum(d.type == "cpu" for d in self.devices)
            fused = unshared_parameters(stages) if fuse_weight_grads else None
            self._runtime = LocalRuntime(
                stages, self.devices, threads_per_worker(cpu_workers), fused
            )
        else:
            self._runtime, own, tied = DistributedRuntime.on_rank(
                stages, self.placement, info, fuse=fuse_weight_grads
            )
        if sequential:
            children = [item for s in own for item in sequential_layers(stages[s])]
        else:  # the whole model's children, its own parameters and buffers
            children = list(module.named_children())
            _register_state(self, module)
        for name, layer in children:  # this process's layers, under the plain model's names
            _check_free(self, name)
            self.add_module(name, layer)
        if info is not None:
            self.sync = GradientSync(info, self.parameters(), tied, {s: stages[s] for s in own})
            self._runtime.on_stage_done = self._stage_done  # type: ignore[attr-defined]
        self._stages = stages
        self._own_stages = own
        random_ops = [t.random_ops for t in stages if isinstance(t, TracedStage)]
        self._stepper = Stepper(  # a traced model's random operations are places of draws too
            self._runtime,
            self,
            stages,
            stage_devices,
            [r for r in random_ops if r is not None],
            adaptive=info is None,  # on a mesh a rerun would need every rank
            finish=self._commit_batch_norm,
        )
        self.last_timeline: Timeline | None = None

    @property
    def num_stages(self) -> int:
        """Model stages."""
        return len(self.balance)

    @property
    def stages(self) -> tuple[nn.Module, ...]:
        """The stage modules, sharing their layers with this Pipeline."""
        return tuple(self._stages)

    def schedule(self, num_microbatches: int) -> Schedule:
        """The validated schedule this pipeline runs for ``num_microbatches`` micro-batches."""
        return _schedule(self.schedule_name, self.num_stages, num_microbatches)

    def forward(self, *inputs: Any) -> Any:
        """The model's output on ``inputs``, computed micro-batch by micro-batch, stage by stage.

        Autograd-transparent: ``loss_fn(pipe(x), y).backward()`` gives the
        plain model's gradients. Under ``torch.no_grad()`` it only streams
        forward. With a mesh it runs only under ``torch.no_grad()`` (a
        backward cannot follow the output across ranks: train with
        :meth:`step`) and returns the output on the last stage's rank, None
        on the others.
        """
        if self.mesh is not None and torch.is_grad_enabled():
            raise ConfigError(
                "with a mesh, pipe(x) runs forward only: call it under torch.no_grad() "
                "(evaluation), and train with pipe.step or GradientAccumulator.step, whose "
                "backward crosses the ranks"
            )
        if len(inputs) != 1:
            raise ConfigTypeError(
                f"a Pipeline takes one input, got {len(inputs)}; pass a tuple or dict "
                "as one argument if the first layer takes several tensors"
            )
        micro = scatter(inputs[0], self.chunks)
        stop = checkpoint_stop(self.checkpoint, len(micro))
        run = self._stepper.run(
            self.schedule,
            lambda seed: StepInputs(micro, checkpoint_stop=stop, seed=seed),
            detach=False,
        )
        self.last_timeline = run.timeline
        if self.mesh is not None and self.placement[-1] != self.mesh.pp_rank:
            return None
        return gather([run.outputs[i] for i in range(len(micro))])

    def step(
        self,
        inputs: Any,
        target: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch, in the schedule's order.

        The loss is applied per micro-batch on the last stage:
        ``loss_fn(output, target)`` (``loss_fn(output)`` without a target).
        Gradients accumulate into ``.grad`` and equal those of the plain
        model's loss on the whole batch.

        Args:
            inputs: the model's input (one argument: a tensor, tuple or dict).
            target: the loss target, cut into micro-batches like ``inputs``.
            loss_fn: returns a scalar: the mean over its micro-batch's
                samples when ``num_items`` is None (pipesched weights it by
                the micro-batch's share of the batch), or a sum over items
                (e.g. tokens) when ``num_items`` is given.
            num_items: the batch's total item count; every micro-batch's sum
                is divided by it.

        Returns:
            The normalized loss of the batch, detached.

        Raises:
            ConfigTypeError: ``loss_fn`` is not callable, or ``num_items`` not a number.
            ConfigError: ``inputs`` requires grad (pass ``x.detach()``), or
                ``num_items`` is not positive.
        """
        check_step(inputs, loss_fn, num_items)
        if num_items is None:
            return self._run_step(
                inputs, target, loss_fn, summed=False, scale=1.0 / batch_size((inputs, target))
            )
        count = _item_count(num_items)
        if not count > 0:
            raise ConfigError(
                f"num_items must be > 0, got {num_items!r}; it is the number of items "
                "(e.g. non-padding tokens) the summed loss is divided by"
            )
        return self._run_step(inputs, target, loss_fn, summed=True, scale=1.0 / count)

    def accumulate(
        self,
        inputs: Any,
        target: Any = None,
        *,
        loss_fn: Callable[..., torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, float]:
        """Like :meth:`step`, but adds the gradients of the batch's *summed* loss, not its mean.

        The building block of accumulation windows (see
        :class:`pipesched.GradientAccumulator`): gradients of sums accumulate
        across calls and are divided once, at the window's end, by the
        window's item count. Nothing is normalized here.

        Args:
            inputs, target, loss_fn: as in :meth:`step`.
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
        check_step(inputs, loss_fn, num_items)
        items = float(batch_size((inputs, target))) if num_items is None else _item_count(num_items)
        if items < 0:
            raise ConfigError(f"num_items must be >= 0, got {num_items!r}")
        total = self._run_step(inputs, target, loss_fn, summed=num_items is not None, scale=scale)
        return total / scale, items

    def _run_step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[..., torch.Tensor],
        *,
        summed: bool,
        scale: float,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; micro-batch i's loss weighs
        ``scale`` (a sum) or ``scale * rows_i`` (a mean). Returns the weighted sum."""
        micro = scatter((inputs, target), self.chunks)
        weights = [scale if summed else scale * _rows(x) for x, _ in micro]

        def make_step(seed: int | None) -> StepInputs:
            return StepInputs(
                inputs=[x for x, _ in micro],
                targets=None if target is None else [t for _, t in micro],
                loss_fn=loss_fn,
                loss_weights=weights,
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(micro)),
                seed=seed,
            )

        run = self._stepper.run(self.schedule, make_step, detach=True)
        self.last_timeline = run.timeline
        if self.mesh is None:
            return torch.stack([run.losses[i] for i in range(len(micro))]).sum()
        return broadcast_loss(run.losses, len(micro), self.placement[-1], self.mesh)

    def _stage_done(self, stage: int) -> None:
        """A stage's gradients are final for this step: its replicas may start summing them."""
        self._stepper.commit_early(stage_parameters(self._stages[stage]))
        self.sync.stage_done(stage)

    def gather_timeline(self) -> Timeline | None:
        """The last step's timeline with every rank's actions, on pipeline rank 0.

        Locally this is :attr:`last_timeline`. With a mesh it is a collective
        over the pipeline's ranks (call it on all of them): pp rank 0 gets
        every rank's measured events, clocks aligned, and the others None.
        """
        if self.mesh is None or self.last_timeline is None:
            return self.last_timeline
        runtime = self._runtime
        if not isinstance(runtime, DistributedRuntime):  # pragma: no cover - set together
            raise ConfigError("gather_timeline needs the distributed runtime")
        return runtime.gather_timeline(self.last_timeline)

    def _commit_batch_norm(self) -> None:
        if self.training:
            commit_all(self)

    def to(self, *args: Any, **kwargs: Any) -> Pipeline:
        """Only dtype changes: a Pipeline's stages stay on the devices they were given."""
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            _deny_move("to(device)")
        return super().to(dtype=dtype) if dtype is not None else self

    def cuda(self, device: Any = None) -> NoReturn:
        """Denied: see :meth:`to`."""
        _deny_move("cuda()")

    def cpu(self) -> NoReturn:
        """Denied: see :meth:`to`."""
        _deny_move("cpu()")


def _register_state(pipe: Pipeline, module: nn.Module) -> None:
    """Registers the parameters and buffers ``module`` holds itself (not its children's)."""
    for name, param in module.named_parameters(recurse=False):
        _check_free(pipe, name)
        pipe.register_parameter(name, param)
    for name, buffer in module.named_buffers(recurse=False):
        _check_free(pipe, name)
        pipe.register_buffer(
            name, buffer, persistent=name not in module._non_persistent_buffers_set
        )


def _check_free(pipe: Pipeline, name: str) -> None:
    if hasattr(pipe, name):
        raise ConfigError(
            f"the model has a submodule or parameter named {name!r}, which is also a Pipeline "
            "attribute; rename it, or wrap the model in an nn.Module that holds it under another "
            "name (e.g. self.model = model)"
        )


def _deny_move(call: str) -> NoReturn:
    raise ConfigError(
        f"Pipeline.{call} would move every stage to one device; a Pipeline keeps stage s on "
        "devices[placement[s]]. Move the model before wrapping it, or pass devices="
    )


@functools.lru_cache(maxsize=64)
def _schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    return get_schedule(name, num_stages, num_microbatches).validate()


def _item_count(num_items: int | float | torch.Tensor) -> float:
    return float(num_items.item() if isinstance(num_items, torch.Tensor) else num_items)


def _rows(value: Any) -> int:
    return next(t.shape[0] for t in tensors(value) if t.ndim > 0)
