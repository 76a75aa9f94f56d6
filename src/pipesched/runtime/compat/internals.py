"""Private torch APIs pipesched uses, each checked once at import, each with a fallback.

Why a module of its own: torch promises nothing about private names, and a release
that changes one must not break or silently change a step. Each is looked up here
once and tried on a tiny probe; one that fails switches off its feature with one
:class:`~pipesched.errors.TorchInternalsWarning` and the exact path runs. The table of
APIs, uses and fallbacks is in docs/guide.md, "Private torch APIs".
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import Tensor, nn
from torch._ops import OpOverload
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode

from pipesched.errors import ConfigTypeError, TorchInternalsWarning, warn_user

__all__ = [
    "FUSION_SUPPORTED",
    "MISSING",
    "OpOverload",
    "TorchDispatchMode",
    "engine_will_execute",
    "foreach_mul_",
    "function_apply",
    "function_output",
    "global_backward_hooks",
    "global_module_hooks",
    "gradient_hooks",
    "has_gradient_hooks",
    "has_module_hooks",
    "in_functorch",
    "is_compiled",
    "module_backward_hooks",
    "one_recomputation",
    "op_schema",
    "parse_to",
    "pytree",
    "run_backward",
    "scaler_device",
    "set_group_timeout",
    "size_expressions",
    "size_hints",
    "size_symbols",
    "top_saved_tensors_hooks",
    "unsafe_view",
]

MISSING: list[str] = []
"""The private APIs that were missing or failed their probe at import (warned once each)."""


def _missing(name: str, without: str) -> None:
    MISSING.append(name)
    warn_user(
        f"{name} is missing or behaves differently in torch {torch.__version__}; "
        f"pipesched falls back to an exact, slower path: {without}",
        TorchInternalsWarning,
    )


def _probe(check: Callable[[], bool]) -> bool:
    """Runs a capability probe: True if it ran and saw what it expected.

    Any exception counts as a failed probe (whatever it says): the API is
    then not used at all, so no error of torch's steers anything later. It
    runs on the CPU whatever device the import came under: the package is
    imported lazily, and a first ``pipesched.Pipeline`` named inside ``with
    torch.device("meta"):`` would otherwise probe tensors that hold no values.
    A probe that draws (the random routing's) leaves torch's CPU generator as
    it found it: else a user's seeded run would differ on the first Pipeline
    of a process, where the probes run, from any later one.
    """
    state = torch.get_rng_state()
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.device("cpu"):
            return check()
    except Exception:
        return False
    finally:
        torch.set_rng_state(state)


# ------------------------------------------------------------- the autograd engine

_will_engine_execute_node: Callable[[Node], bool] | None = getattr(
    torch._C, "_will_engine_execute_node", None
)


def _check_will_engine_execute_node() -> bool:
    ask = _will_engine_execute_node
    a, b = torch.ones((), requires_grad=True), torch.ones((), requires_grad=True)
    ya, yb = a * 2, b * 3
    out = ya + yb
    seen: list[tuple[bool, ...]] = []
    handle = out.grad_fn.register_prehook(  # type: ignore[union-attr]
        lambda _: seen.append(tuple(map(ask, (ya.grad_fn, yb.grad_fn))))  # type: ignore[arg-type]
    )
    try:
        torch.autograd.backward(out, inputs=[a], retain_graph=True)
        torch.autograd.backward(out)
    finally:
        handle.remove()
    return seen == [(True, False), (True, True)]


if _will_engine_execute_node is None or not _probe(_check_will_engine_execute_node):
    _will_engine_execute_node = None
    _missing(
        "torch._C._will_engine_execute_node",
        "a fused linear computes its input gradient whenever it has one, needed or not",
    )


def engine_will_execute(node: Node) -> bool:
    """Whether the running backward executes ``node``; True where that is unknown.

    Args:
        node: a node with at least one next edge. Never a leaf: for a leaf that
            ``torch.autograd.grad`` captures, torch raises instead of answering.
    """
    return True if _will_engine_execute_node is None else _will_engine_execute_node(node)


_engine_run_backward: Callable[..., Any] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None
)
_ACCUMULATE = {"allow_unreachable": True, "accumulate_grad": True}  # as autograd.backward


def _check_engine_run_backward() -> bool:
    a = torch.ones(2, requires_grad=True)
    run = _engine_run_backward
    run((a * 3,), (torch.ones(2),), False, False, (), **_ACCUMULATE)  # type: ignore[misc]
    return a.grad is not None and a.grad.tolist() == [3.0, 3.0]


if _engine_run_backward is None or not _probe(_check_engine_run_backward):
    _engine_run_backward = None
    _missing("torch.autograd.graph._engine_run_backward", "torch.autograd.backward itself")


def run_backward(roots: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """``torch.autograd.backward(roots, grads)`` where each gradient is its root's shape.

    Why: ``torch.autograd.backward`` checks each gradient against its root in
    Python first, about 10 us a call, a fifth of a tiny stage's backward; a
    stage's roots get the next stage's input gradients, of their own shapes.
    """
    if _engine_run_backward is None:
        torch.autograd.backward(roots, grads)
    else:
        _engine_run_backward(tuple(roots), tuple(grads), False, False, (), **_ACCUMULATE)


# ------------------------------------------------------------- autograd.Function's C apply

_c_apply: Any = vars(getattr(torch._C, "_FunctionBase", object)).get("apply")
_transforms_active: Callable[[], bool] | None = getattr(
    torch._C, "_are_functorch_transforms_active", None
)
_functorch_wrapped: Callable[[Tensor], bool] | None = getattr(
    getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None
)
_FUNCTION_APPLY = (
    "torch._C._FunctionBase.apply, torch._C._are_functorch_transforms_active, "
    "torch._C._functorch.is_functorch_wrapped_tensor"
)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * 2


def _check_function_apply() -> bool:
    active, wrapped = _transforms_active, _functorch_wrapped
    if _c_apply is None or active is None or wrapped is None:
        return False
    x = torch.ones(2, requires_grad=True)
    _c_apply.__get__(None, _Twice)(x).sum().backward()
    inside: list[tuple[bool, bool]] = []

    def probe(t: Tensor) -> Tensor:
        inside.append((active(), wrapped(t)))
        return t

    torch.func.vmap(probe)(torch.zeros(2))
    outside = (active(), wrapped(x))
    return (
        x.grad is not None
        and x.grad.tolist() == [2.0, 2.0]
        and inside == [(True, True)]
        and (outside == (False, False))
    )


if not _probe(_check_function_apply):
    _c_apply = _transforms_active = _functorch_wrapped = None
    _missing(
        _FUNCTION_APPLY,
        "autograd.Function.apply, its Python included; a layer called inside a functorch "
        "transform in a split backward's forward then fails as torch's Function.apply does",
    )


def function_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` past ``autograd.Function.apply``'s Python: torch's C ``apply``.

    For a Function without ``setup_context``, called on no functorch wrapper
    (:func:`in_functorch`), that Python binds no defaults and unwraps nothing. Where
    the C ``apply`` failed its probe: ``function.apply`` itself.
    """
    return function.apply if _c_apply is None else _c_apply.__get__(None, function)


_unsafe_view: Callable[[Tensor, Sequence[int]], Tensor] | None = getattr(
    torch.ops.aten, "_unsafe_view", None
)


def _check_unsafe_view() -> bool:
    if _unsafe_view is None:
        return False
    base = torch.arange(6.0).reshape(2, 3)
    with torch.no_grad():
        out = _unsafe_view(base.t(), (3, 2))
    leaf = base.clone().requires_grad_()
    t = leaf * 2
    given = _unsafe_view(t, (2, 3))
    (grad,) = torch.autograd.grad(given.sum(), leaf)
    with torch.no_grad():
        given.add_(1)  # its own version counter
    return bool(
        not out._is_view()
        and out.data_ptr() == base.data_ptr()
        and out.stride() == (1, 3)
        and torch.equal(out, base.t())
        and not given._is_view()
        and given._version == 1
        and t._version == 0
        and grad.eq(2).all().item()
    )


if not _probe(_check_unsafe_view):
    _unsafe_view = None
    _missing(
        "torch.ops.aten._unsafe_view",
        "a stage's input, and a deferring Function's output that is a view, are copied",
    )


def unsafe_view(t: Tensor) -> Tensor:
    """``t``'s data as a tensor that is no view: its own version counter, no copy, a node
    the gradient flows through (where ``t`` requires grad); a copy without the API."""
    return t.clone() if _unsafe_view is None else _unsafe_view(t, t.shape)


def function_output(out: Tensor) -> Tensor:
    """``out`` as an autograd Function's forward returns it: not a view.

    Why: autograd forbids writing in place into a view made inside a Function's
    forward, where torch's own op's output may be written (ATen's ``linear`` of a
    3-D input with a bias returns a view of its 2-D GEMM; ``nn.ReLU(inplace=True)``
    comes next). ATen's ``matmul`` hands its output back the same way.
    """
    return unsafe_view(out) if out._is_view() else out


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (Dynamo's ``OptimizedModule``).

    Read from Dynamo's module only where a program imported it (no compiled
    module exists otherwise); False where the class is gone.
    """
    frame = sys.modules.get("torch._dynamo.eval_frame")
    kind = getattr(frame, "OptimizedModule", None)
    return isinstance(kind, type) and isinstance(module, kind)


def in_functorch(t: Tensor) -> bool:
    """Whether a functorch transform (``vmap``, ``grad``) runs, or ``t`` is one of its
    wrappers; False where that cannot be told (:func:`function_apply` is then torch's)."""
    if _transforms_active is None or _functorch_wrapped is None:
        return False
    return _transforms_active() or _functorch_wrapped(t)


# ------------------------------------------------------------- saved-tensor hooks

_top_hooks: Callable[[bool], Any] | None = getattr(
    getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None
)


def _check_top_hooks() -> bool:
    if _top_hooks is None:
        return False
    pack, unpack = (lambda t: t), (lambda t: t)
    outside = _top_hooks(False)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        inside = _top_hooks(False)
    return bool(inside == (pack, unpack) and _top_hooks(False) == outside)


def _top_saved_tensors_hooks() -> Any:
    return None if _top_hooks is None else _top_hooks(False)


top_saved_tensors_hooks: Callable[[], Any] | None = _top_saved_tensors_hooks
"""The innermost saved-tensor hooks in force (None outside any); None if unavailable."""
if _top_hooks is None or not _probe(_check_top_hooks):
    top_saved_tensors_hooks = None
    _missing(
        "torch._C._autograd._top_saved_tensors_default_hooks",
        "fused weight-gradient accumulation is off",
    )


# ------------------------------------------------------------- a tensor's gradient hooks


def _check_hook_table(table: str, register: Callable[[Tensor], Any]) -> bool:
    t = torch.zeros(1, requires_grad=True)
    before = getattr(t, table)
    handle = register(t)
    during = bool(getattr(t, table))
    handle.remove()
    return not before and during and not getattr(t, table)


_HOOK_TABLES: list[str] = []
"""The tensor attributes that list gradient hooks and passed their probe."""
for _table, _register in (
    ("_backward_hooks", lambda t: t.register_hook(lambda g: g)),
    ("_post_accumulate_grad_hooks", lambda t: t.register_post_accumulate_grad_hook(lambda p: None)),
):
    if _probe(functools.partial(_check_hook_table, _table, _register)):
        _HOOK_TABLES.append(_table)
    else:
        _missing(f"torch.Tensor.{_table}", "fused weight-gradient accumulation is off")


def has_gradient_hooks(t: Tensor) -> bool:
    """Whether ``t`` has gradient hooks; True where that cannot be told."""
    return len(_HOOK_TABLES) < 2 or bool(gradient_hooks(t))


def gradient_hooks(t: Tensor) -> list[str]:
    """The hook tables of ``t`` that hold hooks, of those that can be read."""
    return [table for table in _HOOK_TABLES if getattr(t, table)]


FUSION_SUPPORTED = top_saved_tensors_hooks is not None and len(_HOOK_TABLES) == 2
"""Whether fused weight-gradient accumulation can run (its checks all passed)."""


# ------------------------------------------------------------- checkpoint recomputation

_GraphExecGroup: Any = getattr(torch.utils.checkpoint, "GraphExecGroup", None)


def _check_graph_exec_group() -> bool:
    with _GraphExecGroup():
        return True


one_recomputation: Callable[[], contextlib.AbstractContextManager[Any]] = (
    _GraphExecGroup if _GraphExecGroup is not None else contextlib.nullcontext
)
"""Backward calls inside it recompute each non-reentrant checkpointed region once in all."""
if _GraphExecGroup is None or not _probe(_check_graph_exec_group):
    one_recomputation = contextlib.nullcontext
    _missing(
        "torch.utils.checkpoint.GraphExecGroup",
        "each pass of a split weight backward (W) recomputes checkpointed regions itself",
    )


# ------------------------------------------------------------- gradient scaling

_foreach_mul: Callable[[Sequence[Tensor], float], None] | None = getattr(
    torch, "_foreach_mul_", None
)


def _check_foreach_mul() -> bool:
    if _foreach_mul is None:
        return False
    a, b = torch.ones(2), torch.full((3,), 2.0)
    _foreach_mul([a, b], 0.5)
    return bool(a.eq(0.5).all()) and bool(b.eq(1.0).all())


if _foreach_mul is None or not _probe(_check_foreach_mul):
    _foreach_mul = None
    _missing("torch._foreach_mul_", "gradients are scaled one tensor at a time")


def foreach_mul_(tensors: Sequence[Tensor], factor: float) -> None:
    """Multiplies each tensor by ``factor`` in place."""
    if _foreach_mul is not None:
        _foreach_mul(tensors, factor)
    else:
        for t in tensors:
            t.mul_(factor)


# ------------------------------------------------------------- .to() arguments

_ToArgs = tuple[torch.device | None, torch.dtype | None, bool, torch.memory_format | None]

_parse_to: Callable[..., _ToArgs] | None = getattr(
    getattr(torch._C, "_nn", None), "_parse_to", None
)


def _check_parse_to() -> bool:
    if _parse_to is None:
        return False
    double, single = (
        (torch.device("cpu"), torch.float64, False, None),
        (None, torch.float32, False, None),
    )
    return _parse_to("cpu", torch.float64) == double and _parse_to(torch.float32) == single


if _parse_to is None or not _probe(_check_parse_to):
    _parse_to = None
    _missing("torch._C._nn._parse_to", "Pipeline.to() reads its arguments in Python")


def parse_to(*args: Any, **kwargs: Any) -> _ToArgs:
    """``(device, dtype, non_blocking, memory_format)`` of ``.to()``'s arguments, None if not given.

    Raises:
        ConfigTypeError: arguments ``.to()`` does not take (Python reading only).
    """
    if _parse_to is not None:
        return _parse_to(*args, **kwargs)
    return _read_to_arguments(*args, **kwargs)


def _read_to_arguments(*args: Any, **kwargs: Any) -> _ToArgs:
    """``.to(device, dtype, non_blocking, copy)``, ``.to(dtype, ...)`` or ``.to(tensor, ...)``."""
    device = kwargs.pop("device", None)
    dtype = kwargs.pop("dtype", None)
    non_blocking = kwargs.pop("non_blocking", False)
    memory_format = kwargs.pop("memory_format", None)
    kwargs.pop("copy", None)
    rest = list(args)
    if rest and isinstance(rest[0], Tensor):
        other = rest.pop(0)
        device, dtype = other.device, other.dtype
    elif rest and not isinstance(rest[0], (torch.dtype, bool)):
        device = rest.pop(0)
    if rest and isinstance(rest[0], torch.dtype):
        dtype = rest.pop(0)
    if rest and isinstance(rest[0], bool):
        non_blocking = rest.pop(0)
    if rest and isinstance(rest[0], bool):
        rest.pop(0)  # copy
    if rest or kwargs:
        raise ConfigTypeError(
            f"to() got arguments it does not take: {rest + list(kwargs)}; "
            "expected to(device, dtype, non_blocking), to(dtype) or to(tensor)"
        )
    where = None if device is None else torch.device(device)
    return where, dtype, bool(non_blocking), memory_format


# -- Hooks registered for every module ------------------------------------------------

_GLOBAL_HOOKS = tuple(
    f"_global_{kind}_hooks" for kind in ("forward", "forward_pre", "backward", "backward_pre")
)
_found = [getattr(torch.nn.modules.module, name, None) for name in _GLOBAL_HOOKS]
_global_tables: list[Any] | None = _found
if not all(isinstance(table, dict) for table in _found):
    _global_tables = None
    _missing("torch.nn.modules.module._global_*_hooks", "stages of plain layers are seeded too")


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The signature of an ATen operation: its arguments, returns, mutability."""
    return op._schema


def scaler_device(scaler: Any) -> str:
    """The device type a ``torch.amp.GradScaler`` was made for (it has no public name for it)."""
    return str(getattr(scaler, "_device", "cuda"))


def global_module_hooks() -> bool:
    """Whether hooks for every module are registered (True where that cannot be told)."""
    tables = _global_tables
    return tables is None or any(tables)


def global_backward_hooks() -> bool:
    """Whether backward hooks for every module are registered (False where that cannot
    be told: only a warning reads it)."""
    tables = _global_tables
    return tables is not None and bool(tables[2] or tables[3])


def module_backward_hooks(module: nn.Module) -> list[Any]:
    """``module``'s own backward and backward-pre hooks (nn.Module's storage)."""
    return [*module._backward_hooks.values(), *module._backward_pre_hooks.values()]


def set_group_timeout(group: Any, seconds: float) -> bool:
    """Gives a process group made without one (a DeviceMesh's: torch's default, 30 minutes
    for gloo) the job's timeout; whether it could (torch's private setter, probed)."""
    setter = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    try:
        setter(timedelta(seconds=seconds), group)
    except (RuntimeError, ValueError, AssertionError, AttributeError):
        return False
    return True


def has_module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (nn.Module's storage)."""
    m = module
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    )


# -- Symbolic sizes as traced -----------------------------------------------------------


def size_symbols(size: torch.SymInt) -> set[Any]:
    """The symbols of a traced size, as traced: a size the trace later pinned keeps them."""
    return set(_traced_expr(size.node).free_symbols)


def _traced_expr(node: Any) -> Any:
    expr = getattr(node, "_expr", None) if _size_symbols_supported() else None
    if expr is None or not hasattr(expr, "free_symbols"):
        expr = node.expr
    return expr


def size_expressions(size: torch.SymInt) -> tuple[Any, Any]:
    """A traced size's expression as traced and as now (a size the trace later pinned
    holds other symbols now)."""
    return _traced_expr(size.node), size.node.expr


def size_hints(size: torch.SymInt) -> Mapping[Any, int]:
    """The values the trace saw for the symbols of ``size`` (its shape environment's)."""
    env = getattr(size.node, "shape_env", None)
    return getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {})


@functools.cache
def _size_symbols_supported() -> bool:
    """Probed at the first traced size, not at import: the probe imports torch's symbolic
    shapes (and with them torch._dynamo, 0.7 s), which a process that never traces, such
    as every rank of a Sequential pipeline, should not pay."""
    if _probe(_check_size_symbols):
        return True
    _missing("SymNode._expr", "a model that pins its batch has no output told as batch-coupled")
    return False


def _check_size_symbols() -> bool:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    symbol = env.create_unbacked_symint()
    node = symbol.node
    expr = getattr(node, "_expr", None)
    return expr is not None and bool(expr.free_symbols)
