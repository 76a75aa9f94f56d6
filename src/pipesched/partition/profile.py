"""Measuring each layer or traced operation: forward and backward time, output and activation bytes.

Why per node and on any device: torchgpipe times whole layers and reads CUDA
memory counters, so it cannot balance a CPU pipeline by memory. Each node runs
alone on fresh leaves; the fastest of ``repeats`` is kept, since noise only ever
adds. A meta model is estimated instead (:mod:`pipesched.partition.estimate`).
Nothing of the model changes: buffers are cloned and the RNG state restored.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx, nn

from pipesched.partition.call import Call
from pipesched.partition.estimate import count_flops, estimated_seconds, tensor_bytes
from pipesched.partition.trace import TracedModel
from pipesched.runtime.backward import backward_input
from pipesched.runtime.compat.internals import OpOverload, op_schema, pytree
from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore
from pipesched.runtime.stage.tree import map_tensors, tensors

__all__ = ["NodeCost", "device_kind", "measure_sequential", "measure_traced"]


@dataclass(frozen=True)
class NodeCost:
    """What one node of the stage graph costs on one input (the example batch).

    Args:
        forward: seconds of its forward, or None when not timed.
        backward: seconds of its backward (0 where nothing needs a gradient).
        output_bytes: bytes of its output tensors.
        activation_bytes: bytes held for the backward per input. A layer of a
            Sequential: the storages autograd saved in its forward (its
            parameters' and its input's apart), with its output where the next
            layer saves that (see :func:`measure_sequential`). A traced
            operation, or a meta layer: bytes of newly allocated output storage
            (views: 0).
        split_bytes: bytes held per input between a split backward's B and its
            W (the operands of the deferred weight products), counted as
            ``activation_bytes`` is; None: not measured (a traced operation, a
            meta layer).
    """

    forward: float | None
    backward: float | None
    output_bytes: int
    activation_bytes: int
    split_bytes: int | None = None


def measure_sequential(
    module: nn.Sequential,
    example: Any,
    device: torch.device,
    *,
    timing: bool = True,
    repeats: int = 3,
    estimate: str | None = None,
) -> list[NodeCost]:
    """The cost of each layer of ``module`` on ``example`` (the Sequential's one input).

    Each layer runs as a copy on ``device``; ``module`` is left untouched.
    ``estimate``: a device type to estimate times for, from FLOPs counted on
    ``device`` (meta), instead of timing.

    Why a layer's activation bytes are what autograd saves, not its output: a
    Transformer layer keeps about twelve times its output for the backward
    (attention scores, the feed-forward's inner width), a ``Linear`` none
    beyond its input. A storage saved by a layer and by the next (a ReLU's
    output, the next ``Linear``'s input) is the first's; a layer's input that
    it saves is the previous layer's output, counted there: the bytes of
    layers ``[i, j)`` and the stage's input are then what that stage holds.
    """
    x = _to(example, device)
    costs: list[NodeCost] = []
    kept: dict[tuple[int, int], int] = {}  # the previous layer's own saved storages
    kept_split: dict[tuple[int, int], int] = {}  # and those it keeps from its B for its W
    with _rng_fork(device):
        for k, layer in enumerate(module):
            # A copy: the layer's buffers (BatchNorm statistics) must not move.
            copied = copy.deepcopy(layer).to(device)
            leaves: list[torch.Tensor] = [p for p in copied.parameters() if p.requires_grad]
            if k > 0:  # the model's input needs no gradient; later layers' inputs do
                x = map_tensors(x, functools.partial(_leaf, leaves=leaves))
            if device.type == "meta" or estimate is not None:
                x, cost = _measure(
                    copied, (x,), {}, leaves, device, timing, repeats, view=False, estimate=estimate
                )
            else:
                given = x
                saved, x = _saved(copied, given)  # its output is the next layer's input
                cost = _cost(x, None, None, view=False)
                if timing:
                    _, cost = _measure(
                        copied, (given,), {}, leaves, device, True, repeats, view=False
                    )
                waiting = _waiting(copied, given)
                inputs = {_storage(t) for t in tensors(given)}
                own = {key: n for key, n in saved.items() if key not in inputs}
                own_split = {key: n for key, n in (waiting or {}).items() if key not in inputs}
                cost = dataclasses.replace(
                    cost,
                    activation_bytes=sum(own.values()),
                    split_bytes=None if waiting is None else sum(own_split.values()),
                )
                if k > 0:  # the previous layer's output this one keeps, unless it did: its
                    last = costs[-1]
                    split = last.split_bytes
                    if split is not None and waiting is not None:
                        split += _more(waiting, inputs, kept_split)
                    costs[-1] = dataclasses.replace(
                        last,
                        activation_bytes=last.activation_bytes + _more(saved, inputs, kept),
                        split_bytes=split,
                    )
                kept, kept_split = own, own_split
            costs.append(cost)
    return costs


def _more(
    found: dict[tuple[int, int], int], inputs: set[tuple[int, int]], kept: dict[Any, int]
) -> int:
    """Bytes of the storages in ``found`` that are among ``inputs`` and not in ``kept``."""
    return sum(n for key, n in found.items() if key in inputs and key not in kept)


def _waiting(layer: nn.Module, x: Any) -> dict[tuple[int, int], int] | None:
    """The storages a split backward of ``layer`` on ``x`` keeps from its B for its W, with
    their bytes (as :func:`_saved`): the deferred weight products' operands.

    None where the layer cannot run a split backward by itself (the planner then counts
    its activations there): only zero-bubble schedules need one, and a profile must not
    refuse a model whose schedule does not.
    """
    try:
        return _waiting_for(layer, x)
    except Exception:
        return None


def _waiting_for(layer: nn.Module, x: Any) -> dict[tuple[int, int], int]:
    store = WeightStore()
    probe, alias = _cloned(x)
    with torch.enable_grad(), DeferredWeightsMode(store):
        out = layer(probe)
    roots = [t for t in tensors(out) if t.requires_grad]
    if not roots:
        return {}
    backward_input(roots, [torch.ones_like(t) for t in roots], list(tensors(x)), store)
    state = _state(layer)
    found: dict[tuple[int, int], int] = {}
    for _, _, payload in store.entries:
        for t in tensors(payload):
            key = _storage(t)
            if key not in state:
                found[alias.get(key, key)] = t.untyped_storage().nbytes()
    return found


def _saved(layer: nn.Module, x: Any) -> tuple[dict[tuple[int, int], int], Any]:
    """The storages autograd saves in one forward of ``layer`` on ``x``, with their bytes
    (:func:`_storage` keys; its parameters and buffers left out), and its detached output."""
    state = _state(layer)
    probe, alias = _cloned(x)
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in state:
            saved[alias.get(key, key)] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(probe)
    return saved, map_tensors(out, lambda t: t.detach())


def _cloned(x: Any) -> tuple[Any, dict[tuple[int, int], tuple[int, int]]]:
    """``x`` with each leaf that requires grad cloned (a layer may change its input in
    place, as ``ReLU(inplace=True)`` does, which a leaf refuses), and each clone's storage
    key mapped to its original's: a storage the layer keeps of its input is its input's."""
    alias: dict[tuple[int, int], tuple[int, int]] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.is_leaf):
            return t
        copied = t.clone()
        alias[_storage(copied)] = _storage(t)
        return copied

    return map_tensors(x, clone), alias


def _state(layer: nn.Module) -> set[tuple[int, int]]:
    """The storages of ``layer``'s parameters and buffers: never counted as held per input."""
    return {_storage(t) for t in (*layer.parameters(), *layer.buffers())}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """Which storage ``t`` views: (device index, address); a storage's views share it."""
    return (t.device.index or 0, t.untyped_storage().data_ptr())


def measure_traced(
    traced: TracedModel,
    example_inputs: tuple[Any, ...],
    device: torch.device,
    *,
    timing: bool = True,
    repeats: int = 3,
    estimate: str | None = None,
) -> dict[str, NodeCost]:
    """The cost of each operation of ``traced`` on ``example_inputs``, by node name.

    The graph runs operation by operation on ``device`` with the model's
    parameters (copied there when needed) and clones of its buffers.
    ``estimate``: as in :func:`measure_sequential`.
    """
    model = traced.model
    model_state = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    values: dict[fx.Node, Any] = {}
    wants_grad: set[fx.Node] = set()
    leaves = traced.input_leaves(Call.of(example_inputs))
    for node, value in zip(traced.inputs, leaves, strict=True):
        values[node] = _to(value, device)
    for node, ref in traced.state.items():
        tensor = traced.constant(ref.name) if ref.kind == "constant" else model_state[ref.name]
        values[node] = tensor.detach().to(device)
        if ref.kind == "buffer":
            values[node] = values[node].clone()  # in-place updates stay here
        if ref.kind == "parameter" and tensor.requires_grad:
            wants_grad.add(node)
    costs = {}
    with _rng_fork(device):
        for node in traced.ops:
            op = node.target
            overload = isinstance(op, OpOverload)
            # In-place operations run once: repeating them would change the values.
            once = not overload or op_schema(op).is_mutable  # type: ignore[arg-type]
            args, kwargs, grad_leaves = _arguments(
                node, values, set() if once else wants_grad, device
            )
            op = cast(Callable[..., Any], op)  # a call_function node's target
            out, cost = _measure(
                op,
                args,
                kwargs,
                grad_leaves,
                device,
                timing,
                0 if once else repeats,
                view=_is_view(op),
                estimate=estimate,
            )
            values[node] = out
            if any(n in wants_grad for n in node.all_input_nodes) and any(
                _floating(t) for t in tensors(out)
            ):
                wants_grad.add(node)
            costs[node.name] = cost
    return costs


def _measure(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grad_leaves: list[torch.Tensor],
    device: torch.device,
    timing: bool,
    repeats: int,
    *,
    view: bool,
    estimate: str | None = None,
) -> tuple[Any, NodeCost]:
    """Runs ``fn`` (timed when asked) and returns its detached output and cost.

    The backward is timed from every output that requires grad to
    ``grad_leaves`` (the arguments' fresh leaves and any parameters).
    ``estimate``: count FLOPs instead and estimate times for that device type.
    """
    if estimate is not None and timing:
        return _estimate(fn, args, kwargs, grad_leaves, estimate, view=view)
    if not timing:
        with torch.no_grad():
            out = fn(*args, **kwargs)
        return out, _cost(out, None, None, view)
    forward_times, out = [], None
    runs = repeats + 1 if repeats else 1  # a warm-up, then ``repeats``; 0: run once
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(device)
        forward_times.append(time.perf_counter() - start)
    roots = [t for t in tensors(out) if t.requires_grad]
    backward_times = [0.0]
    if roots and grad_leaves:
        seeds = [torch.ones_like(t) for t in roots]
        backward_times = []
        for _ in range(runs):
            _sync(device)
            start = time.perf_counter()
            torch.autograd.grad(roots, grad_leaves, seeds, retain_graph=True, allow_unused=True)
            _sync(device)
            backward_times.append(time.perf_counter() - start)
    out = map_tensors(out, lambda t: t.detach())
    forward = min(forward_times[1:] or forward_times)
    backward = min(backward_times[1:] or backward_times)
    return out, _cost(out, forward, backward, view)


def _estimate(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grad_leaves: list[torch.Tensor],
    device_type: str,
    *,
    view: bool,
) -> tuple[Any, NodeCost]:
    """Like :func:`_measure`, with times estimated from counted FLOPs and bytes (nothing timed)."""
    out, forward_flops = count_flops(fn, *args, **kwargs)
    roots = [t for t in tensors(out) if t.requires_grad]
    backward_flops = 0
    if roots and grad_leaves:
        seeds = [torch.ones_like(t) for t in roots]
        _, backward_flops = count_flops(
            torch.autograd.grad, roots, grad_leaves, seeds, allow_unused=True
        )
    out = map_tensors(out, lambda t: t.detach())
    moved = 0
    if not view:
        state = fn.parameters() if isinstance(fn, nn.Module) else ()
        moved = tensor_bytes([*pytree.tree_leaves((args, kwargs)), *state, *tensors(out)])
    forward = estimated_seconds(forward_flops, moved, device_type)
    backward = estimated_seconds(backward_flops, 2 * moved, device_type) if roots else 0.0
    return out, _cost(out, forward, backward, view)


def _arguments(
    node: fx.Node, values: dict[fx.Node, Any], wants_grad: set[fx.Node], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
    """The node's arguments: values for nodes (fresh leaves where a gradient is wanted), and
    ``device`` for every device (the trace's device is not the one profiled)."""
    leaves: list[torch.Tensor] = []

    def value(n: fx.Node) -> Any:
        return (
            map_tensors(values[n], functools.partial(_leaf, leaves=leaves))
            if n in wants_grad
            else values[n]
        )

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    args, kwargs = pytree.tree_map_only(torch.device, lambda _: device, (args, kwargs))
    return tuple(args), dict(kwargs), leaves


def _leaf(t: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
    """A fresh leaf requiring grad for a floating tensor (recorded in ``leaves``), else ``t``."""
    if not _floating(t):
        return t
    fresh = t.detach().requires_grad_()
    leaves.append(fresh)
    return fresh


def _cost(out: Any, forward: float | None, backward: float | None, view: bool) -> NodeCost:
    nbytes = sum(t.numel() * t.element_size() for t in tensors(out))
    return NodeCost(forward, backward, nbytes, 0 if view else nbytes)


def _is_view(op: Any) -> bool:
    """Whether ``op`` returns an alias of an input (a view), not new storage."""
    if not isinstance(op, OpOverload):
        return bool(op.__module__ == "_operator")  # getitem of a multi-output op
    return any(r.alias_info is not None for r in op_schema(op).returns)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _to(value: Any, device: torch.device) -> Any:
    return map_tensors(value, lambda t: t.detach().to(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rng_fork(device: torch.device) -> AbstractContextManager[Any]:
    """``torch.random.fork_rng`` over the CPU and ``device``."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def device_kind(device: torch.device) -> str:
    """Devices of one kind cost the same: the CPU, or one CUDA model. Profiling runs on one each."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type
