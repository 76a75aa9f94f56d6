"""Tracing any nn.Module with torch.export into a graph of operations pipesched can cut.

Why our own reading of the export: ``ExportedProgram.module()`` and torch's
pipelining split copy the parameters, untying tied weights and losing names. We
keep the graph as a list of operations fed the model's own parameters. Every input
dim is exported as dynamic, export's runtime asserts are dropped, and a failed
trace is a :class:`~pipesched.errors.PartitionError` naming the model's line.
"""

from __future__ import annotations

import functools
import inspect
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from pipesched.errors import ConfigTypeError, PartitionError
from pipesched.partition.call import Call
from pipesched.partition.dropped_hooks import (
    backward_hooked,
    recording_tensor_hooks,
    warn_dropped_hooks,
)
from pipesched.partition.grad_regions import inline_grad_regions
from pipesched.partition.materialize import on_meta
from pipesched.partition.sizes import Dims, input_dims, refusal
from pipesched.runtime.compat.internals import pytree

__all__ = ["StateRef", "TracedModel", "trace_model"]

_DROPPED = frozenset(
    {
        torch.ops.aten._assert_tensor_metadata.default,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
        torch.ops.aten.sym_constrain_range.default,
    }
)
"""export's runtime checks: they hold for the trace's device, dtype and batch, not a stage's."""

_FIXES = (
    "make that code traceable (no Python branch on a tensor's value, tensors in and out), "
    "or wrap the model in an nn.Module whose forward returns only tensors (for GPT-2: "
    "`return self.gpt2(input_ids=ids, use_cache=False).logits`), or pass an "
    "nn.Sequential of its layers (run eagerly, never traced)"
)


@dataclass(frozen=True)
class StateRef:
    """Where a graph input that is not a user input comes from.

    Args:
        kind: ``"parameter"``, ``"buffer"`` or ``"constant"`` (a tensor export
            lifted out of the code, held by the stage).
        name: the fully qualified name in the model (``"h.0.attn.c_attn.weight"``),
            or the constant's name in the exported program.
    """

    kind: str
    name: str


@dataclass(frozen=True, eq=False)
class TracedModel:
    """A model's torch.export trace, read for cutting.

    Args:
        model: the traced model; its parameters and buffers are the ones the
            stages use.
        program: the exported program (training IR: in-place buffer updates
            stay in place).
        ops: the graph's operations in execution order, without export's
            runtime checks.
        inputs: the placeholder of each user input, in the order of
            ``pytree.tree_flatten((args, {}))``.
        state: the placeholder of each parameter, buffer and lifted constant.
        outputs: the user outputs, flattened: graph nodes or constants.
        out_spec: how to rebuild the model's output from ``outputs``.
        traced_batch: None when the batch dimension is dynamic; otherwise the
            one batch size the graph accepts.
        training: the model's mode when it was traced.
        num_args: how many positional arguments the traced call had.
        keywords: the keyword arguments' names, in the traced call's order.
        positions: which of the call's flattened arguments ``inputs`` are (the
            others, non-tensor values such as ``use_cache=False``, are constants
            of the graph).
        fixed: keyword arguments bound to the forward for the trace (non-tensor
            values a ``**kwargs`` collects); a call's values for them are not inputs.
        dims: per input, each dimension's size as the trace holds it: an int
            where export fixed it (a size of 1, or one the code pins), else the
            ``(lowest, highest)`` sizes its guards allow (None: no bound).
    """

    model: nn.Module
    program: ExportedProgram
    ops: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    state: Mapping[fx.Node, StateRef]
    outputs: tuple[Any, ...]
    out_spec: pytree.TreeSpec
    traced_batch: int | None
    training: bool
    num_args: int
    keywords: tuple[str, ...] = ()
    positions: tuple[int, ...] | None = None
    fixed: tuple[str, ...] = ()
    dims: tuple[Dims | None, ...] = ()

    def constant(self, name: str) -> torch.Tensor:
        """A tensor constant the export lifted out of the model's code."""
        value = self.program.constants[name]
        if not isinstance(value, torch.Tensor):
            raise PartitionError(
                f"the traced model holds a non-tensor constant {name!r} "
                f"({type(value).__name__}); pipesched can only carry tensors between stages"
            )
        return value

    def input_leaves(self, inputs: Any) -> list[Any]:
        """The user-input values of one call, from the pipeline's stage-0 input.

        ``inputs`` is a :class:`~pipesched.partition.call.Call`, or (the older form) the
        one example input, or the tuple of them when there were several.
        """
        if not isinstance(inputs, Call):
            if self.num_args > 1 and not isinstance(inputs, tuple | list):
                raise ConfigTypeError(
                    f"the model was traced with {self.num_args} positional arguments, so a "
                    f"stage-0 input is a tuple of {self.num_args}; got {type(inputs).__name__}"
                )
            inputs = Call(tuple(inputs) if self.num_args > 1 else (inputs,), {})
        if self.fixed:
            kwargs = {k: v for k, v in inputs.kwargs.items() if k not in self.fixed}
            inputs = Call(inputs.args, kwargs)
        leaves, spec = inputs.leaves(list(self.keywords))
        if spec != self.program.call_spec.in_spec:
            raise ConfigTypeError(
                f"the call does not have the structure the model was traced with: got "
                f"{spec}, traced with {self.program.call_spec.in_spec}; call the pipeline "
                "with the same positional and keyword arguments as the traced call"
            )
        return leaves if self.positions is None else [leaves[i] for i in self.positions]

    def refuses(self, leaves: list[Any]) -> str | None:
        """Why these input values fall outside the sizes the trace holds for, or None.

        See :mod:`pipesched.partition.sizes`.
        """
        for node, leaf, dims in zip(self.inputs, leaves, self.dims, strict=False):
            if (reason := refusal(f"input {node.name}", leaf, dims)) is not None:
                return reason
        return None


def trace_model(model: nn.Module, example_inputs: tuple[Any, ...] | Call) -> TracedModel:
    """Traces one call of ``model`` with ``torch.export`` (non-strict, every dim dynamic).

    Args:
        model: any nn.Module whose forward takes and returns tensors (nested in
            tuples, lists, dicts or Hugging Face ``ModelOutput``s).
        example_inputs: the positional arguments of one call, or a
            :class:`~pipesched.partition.call.Call` with keyword arguments too; every
            tensor's dim 0 is the batch.

    Returns:
        The trace.

    Raises:
        ConfigError: ``example_inputs`` is not a tuple.
        PartitionError: the model cannot be traced; the message names the line
            that failed and the fixes.
    """
    if not isinstance(example_inputs, tuple):
        raise ConfigTypeError(
            f"example_inputs must be a tuple of the model's positional arguments, got "
            f"{type(example_inputs).__name__}; write example_inputs=(x,)"
        )
    call = Call.of(example_inputs)
    if on_meta(model):  # the parameters hold no data: the example need not either
        call = pytree.tree_map(
            lambda v: v.detach().to("meta") if isinstance(v, torch.Tensor) else v, call
        )
    # A batch of one would be specialized (torch.export fixes sizes 0 and 1): trace two rows.
    call = pytree.tree_map(
        lambda v: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.shape[:1] == (1,) else v,
        call,
    )
    call, fixed = _fix_extra_keywords(model, call)
    dynamic = pytree.tree_map(
        lambda v: (
            dict.fromkeys(range(v.ndim), Dim.AUTO)
            if isinstance(v, torch.Tensor) and v.ndim >= 1
            else None
        ),
        _bound(model, call),
    )
    forward = functools.partial(type(model).forward.__get__(model), **fixed) if fixed else None
    try:
        if forward is not None:
            model.forward = forward
        with recording_tensor_hooks() as sites:
            program = torch.export.export(
                model, call.args, call.kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as error:
        raise PartitionError(_describe_failure(model, error)) from error
    finally:
        if forward is not None:
            del model.forward
    warn_dropped_hooks(model, backward_hooked(model), sites)
    return _read(model, program, len(call.args), tuple(call.kwargs), tuple(fixed))


def _fix_extra_keywords(model: nn.Module, call: Call) -> tuple[Call, dict[str, Any]]:
    """Splits off the non-tensor keywords a ``**kwargs`` of the forward collects.

    Why: torch.export cannot take ``dynamic_shapes`` for a call whose
    ``**kwargs`` receives values (Hugging Face's ``num_items_in_batch=``); such
    values are bound to the forward for the trace instead, as the constants
    the trace would have made of them (a call with other values is traced
    again: they are part of :func:`pipesched.partition.call.call_key`).

    Raises:
        PartitionError: a tensor goes to ``**kwargs``.
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return call, {}
    named = {n for n, p in parameters.items() if p.kind != inspect.Parameter.VAR_KEYWORD}
    extra = {k: v for k, v in call.kwargs.items() if k not in named}
    if not extra or len(named) == len(parameters):
        return call, {}
    tensors = [
        k
        for k, v in extra.items()
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))
    ]
    if tensors:
        raise PartitionError(
            f"{type(model).__name__}.forward receives the tensor keyword arguments {tensors} "
            "through **kwargs, which torch.export cannot trace with a dynamic batch; pass "
            "them as Python numbers, or wrap the model in an nn.Module whose forward names them"
        )
    return Call(call.args, {k: v for k, v in call.kwargs.items() if k in named}), extra


def _bound(model: nn.Module, call: Call) -> dict[str, Any] | tuple[Any, ...]:
    """The call's arguments by parameter name, as export's ``dynamic_shapes`` wants them.

    Raises:
        ConfigTypeError: the forward does not take these arguments.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to read: positional arguments only
        return tuple(call.args)
    try:
        return dict(signature.bind(*call.args, **call.kwargs).arguments)
    except TypeError as error:
        raise ConfigTypeError(
            f"{type(model).__name__}.forward{signature} does not take the pipeline's call "
            f"({len(call.args)} positional, keywords {sorted(call.kwargs)}): {error}; call "
            "the pipeline with the model's own arguments"
        ) from error


def _read(
    model: nn.Module,
    program: ExportedProgram,
    num_args: int,
    keywords: tuple[str, ...],
    fixed: tuple[str, ...],
) -> TracedModel:
    inline_grad_regions(program)
    signature = program.graph_signature
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs, state, positions = [], {}, []
    user = 0
    for spec in signature.input_specs:
        node = placeholders[spec.arg.name] if hasattr(spec.arg, "name") else None
        if spec.kind == InputKind.USER_INPUT:
            user += 1
            if node is None:
                continue  # a constant argument, specialized into the graph
            inputs.append(node)
            positions.append(user - 1)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if node is None or spec.target is None:
                raise PartitionError(f"torch.export gave an input spec without a name: {spec}")
            kind = {
                InputKind.PARAMETER: "parameter",
                InputKind.BUFFER: "buffer",
                InputKind.CONSTANT_TENSOR: "constant",
            }[spec.kind]
            state[node] = StateRef(kind, spec.target)
        else:
            raise PartitionError(
                f"the traced {type(model).__name__} has a {spec.kind.name} input "
                f"({spec.target}); pipesched cuts graphs of tensors, parameters and buffers only"
            )
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    values = output_node.args[0]
    outputs = []
    for spec, value in zip(signature.output_specs, values, strict=True):
        if spec.kind != OutputKind.USER_OUTPUT:
            raise PartitionError(
                f"the traced {type(model).__name__} returns a {spec.kind.name} "
                f"({spec.target}); pipesched supports models whose only side effects are "
                "in-place updates of their buffers"
            )
        outputs.append(value)
    out_spec = program.call_spec.out_spec
    if out_spec is None:
        raise PartitionError("torch.export recorded no output structure for the model")
    ops = tuple(
        n for n in program.graph.nodes if n.op == "call_function" and n.target not in _DROPPED
    )
    return TracedModel(
        model=model,
        program=program,
        ops=ops,
        inputs=tuple(inputs),
        state=state,
        outputs=tuple(outputs),
        out_spec=out_spec,
        traced_batch=_static_batch(inputs),
        training=model.training,
        num_args=num_args,
        keywords=keywords,
        positions=tuple(positions),
        fixed=fixed,
        dims=tuple(input_dims(node, program) for node in inputs),
    )


def _static_batch(inputs: list[fx.Node]) -> int | None:
    """The batch size the graph is pinned to, or None when dim 0 stayed symbolic."""
    for node in inputs:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            size = value.shape[0]
            if not isinstance(size, torch.SymInt):
                return int(size)
    return None


def _describe_failure(model: nn.Module, error: Exception) -> str:
    """What failed, where in the model's code, and what to do about it."""
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith((torch_dir, own_dir)) and "<" not in f.filename
    ]
    message = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    if len(message) > 300:
        message = message[:297] + "..."
    where = "tracing failed"
    if frames:
        f = frames[-1]
        code = (f.line or "").strip()
        place = f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
        where = f"the operation at {place}: `{code}` failed"
    if "Cache" in message and "not a known type" in message:  # a Hugging Face KV cache
        return (
            f"torch.export could not trace {type(model).__name__}: it returns a key-value "
            f"cache ({type(error).__name__}: {message}). A pipeline returns tensors per "
            "micro-batch, not a cache across calls: call it with use_cache=False (the "
            "default pipesched passes where the call does not name use_cache)"
        )
    return (
        f"torch.export could not trace {type(model).__name__}: {where} "
        f"({type(error).__name__}: {message}). To pipeline it, {_FIXES}; once it traces, "
        "split_points=['layer.name', ...] choose the cuts yourself"
    )
