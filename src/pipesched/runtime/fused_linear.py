"""Linear layers whose weight gradient is accumulated inside the GEMM (Megatron's fusion).

With small micro-batches, adding each weight gradient into ``.grad`` costs as much
as the product; one ``addmm_`` into ``.grad`` does both. The fused path has a fixed
per-call overhead, so only weights of at least :data:`MIN_FUSED_BYTES` are fused
(measurements: docs/guide.md, "Fused weight-gradient accumulation"), and only where
pipesched runs the backward and no other stage shares the weight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipesched.runtime.backward_kind import (
    ACCUMULATE,
    ACCUMULATE_GRAD,
    RETURN,
    SKIP,
    BackwardKind,
    declaration,
)
from pipesched.runtime.compat.internals import (
    FUSION_SUPPORTED,
    engine_will_execute,
    function_output,
    has_gradient_hooks,
    top_saved_tensors_hooks,
)
from pipesched.runtime.placement import stage_parameters

__all__ = [
    "MIN_FUSED_BYTES",
    "FusedLinearMode",
    "accumulate",
    "accumulate_mm",
    "bias_dims",
    "bias_grad",
    "unfuse_shared",
    "unshared_parameters",
    "weight_factors",
    "weight_pass",
    "worth_fusing",
]

MIN_FUSED_BYTES = 2 << 20
"""The smallest weight (in bytes) whose gradient is accumulated in the GEMM (see above)."""

_LINEARS = (F.linear, torch.ops.aten.linear.default)
"""``F.linear`` (eager modules) and the ATen operation a torch.export-traced stage calls."""
_ADDMMS = (torch.addmm, torch.ops.aten.addmm.default)
"""``bias + x @ weight`` with a ``(in, out)`` weight: GPT-2's ``Conv1D``, eager and traced."""

_INTERCEPTED = frozenset(_LINEARS + _ADDMMS)
"""What the mode looks at; everything else returns after one set lookup."""


def unshared_parameters(stages: Sequence[nn.Module | None]) -> list[frozenset[int]]:
    """Per stage, the ids of its parameters that no other stage holds (fusable ones)."""
    owners: dict[int, int] = {}
    for stage in stages:
        for p in _parameters(stage):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [frozenset(id(p) for p in _parameters(stage) if owners[id(p)] == 1) for stage in stages]


def worth_fusing(
    stages: Sequence[nn.Module | None], allowed: Sequence[frozenset[int]]
) -> list[frozenset[int]]:
    """Per stage, those of ``allowed`` that are worth fusing: empty where none is.

    A 2-D parameter (a weight) is worth it from :data:`MIN_FUSED_BYTES` on
    (read at each call); 1-D ones (biases) go with their weight. A stage with no
    such weight gets the empty set, so it never enters :class:`FusedLinearMode`;
    so does every stage where this torch cannot fuse
    (:data:`pipesched.runtime.compat.internals.FUSION_SUPPORTED`).

    Args:
        stages: the stage modules (None: a stage of another rank).
        allowed: per stage, the ids its fused backward may write (see
            :func:`unshared_parameters`).
    """
    if not FUSION_SUPPORTED:
        return [frozenset() for _ in stages]
    worth = []
    for stage, ids in zip(stages, allowed, strict=True):
        params = [p for p in _parameters(stage) if id(p) in ids]
        weights = {id(p) for p in params if p.dim() == 2 and _bytes(p) >= MIN_FUSED_BYTES}
        biases = {id(p) for p in params if p.dim() == 1}
        worth.append(frozenset(weights | biases) if weights else frozenset())
    return worth


def _bytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


def _parameters(stage: nn.Module | None) -> Iterable[nn.Parameter]:
    return () if stage is None else stage_parameters(stage)


class FusedLinearMode(TorchFunctionMode):
    """Routes eligible ``F.linear`` calls to the fused-accumulation linear.

    Args:
        allowed: ids of the parameters whose gradient may be accumulated by the
            fused backward (see :func:`unshared_parameters`).
    """

    def __init__(self, allowed: frozenset[int]) -> None:
        super().__init__()
        self.allowed = allowed
        self._hooks: Any = None

    def __enter__(self) -> FusedLinearMode:
        # Saved-tensor hooks pushed after this (a checkpoint inside the stage) recompute
        # without this mode, so their region must run the ordinary linear.
        self._hooks = _saved_tensor_hooks()
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _INTERCEPTED and FUSION_SUPPORTED:
            if func in _LINEARS:
                x, weight, bias = _linear_args(*args, **kwargs)
                if self._eligible(x, weight, bias, _rows(weight)):
                    return _FusedLinear.apply(x, weight, bias, False)  # type: ignore[no-untyped-call]
            elif func in _ADDMMS:
                bias, x, weight, plain = _addmm_args(*args, **kwargs)
                if plain and _dim(x) == 2 and self._eligible(x, weight, bias, _columns(weight)):
                    return _FusedLinear.apply(x, weight, bias, True)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)

    def _eligible(self, x: Any, weight: Any, bias: Any, out_dim: int) -> bool:
        return (
            torch.is_grad_enabled()
            and type(x) is Tensor
            and _fusable(weight, self.allowed)
            and weight.dim() == 2
            and (bias is None or (_fusable(bias, self.allowed) and bias.shape == (out_dim,)))
            and x.dtype == weight.dtype
            and not x.is_complex()  # its gradients need conj(): left to autograd
            and x.device == weight.device
            and x.dim() >= 1
            and not torch.is_autocast_enabled(x.device.type)
            and _saved_tensor_hooks() == self._hooks
        )


def _saved_tensor_hooks() -> Any:
    return None if top_saved_tensors_hooks is None else top_saved_tensors_hooks()


def _dim(t: Any) -> int:
    return t.dim() if isinstance(t, Tensor) else -1


def _rows(t: Any) -> int:
    return t.shape[0] if _dim(t) == 2 else -1


def _columns(t: Any) -> int:
    return t.shape[1] if _dim(t) == 2 else -1


def _linear_args(input: Any, weight: Any, bias: Any = None) -> tuple[Any, Any, Any]:
    return input, weight, bias


def _addmm_args(
    input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1, out: Any = None
) -> tuple[Any, Any, Any, bool]:
    """``(bias, x, weight, whether it is bias + x @ weight)`` of an ``addmm`` call."""
    return input, mat1, mat2, beta == 1 and alpha == 1 and out is None


def _fusable(p: Any, allowed: frozenset[int]) -> bool:
    return (
        type(p) is nn.Parameter
        and id(p) in allowed
        and p.requires_grad
        and p.layout == torch.strided
        and p.is_contiguous()
        and not has_gradient_hooks(p)
    )


class _FusedLinear(torch.autograd.Function):
    """``F.linear`` (``addmm`` where ``transposed``: weight ``(in, out)``) whose backward
    accumulates the weight gradient into ``.grad`` itself."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool
    ) -> Tensor:
        # As addmm: the input only for the weight's gradient, the weight only for the input's.
        ctx.save_for_backward(x, weight if x.requires_grad else None)
        # The Parameters themselves: under checkpointing, saved tensors come back
        # as recomputed aliases, and a .grad set on an alias is lost.
        ctx.parameters = (weight, bias)
        ctx.transposed = transposed
        ctx.bias_dims = bias_dims(x, transposed)
        ctx.hooked = _saved_tensor_hooks() is not None  # saved through hooks (a checkpoint)
        ctx.declaration = declaration()  # this thread's: it runs this micro-batch's backward
        ctx.fused_linear = _FUSED  # ctx is the node: weight_pass recognises it
        if transposed:
            return function_output(x @ weight if bias is None else torch.addmm(bias, x, weight))
        return function_output(F.linear(x, weight, bias))

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, saved_weight = ctx.saved_tensors
        weight, bias = ctx.parameters
        edges = [node for node, _ in ctx.next_functions]  # no edge for a None bias
        kind = ctx.declaration.kind
        want_w = _leaf_wanted(kind, edges[1])
        want_b = _leaf_wanted(kind, edges[2]) if bias is not None else SKIP
        shared = getattr(ctx, "shared", ())  # reached more than once: autograd sums (unfuse_shared)
        if 1 in shared and want_w == ACCUMULATE:
            want_w = RETURN
        if 2 in shared and want_b == ACCUMULATE:
            want_b = RETURN
        grad_x = None
        if _input_wanted(kind, edges[0]):
            grad_x = grad.matmul(saved_weight.t() if ctx.transposed else saved_weight)
        if want_w == SKIP and want_b == SKIP:
            return grad_x, None, None, None
        grad_2d = grad.reshape(-1, grad.shape[-1])
        a, b = weight_factors(x, grad_2d, ctx.transposed)
        grad_w = grad_b = None
        with torch.no_grad():
            if want_w == ACCUMULATE:
                accumulate_mm(weight, a, b)
            elif want_w == RETURN:  # autograd.grad() asks for it: no .grad is touched
                grad_w = torch.mm(a, b)
            if want_b == ACCUMULATE:
                accumulate(bias, bias_grad(grad, ctx.bias_dims))
            elif want_b == RETURN:
                grad_b = bias_grad(grad, ctx.bias_dims)
        return grad_x, grad_w, grad_b, None


def unfuse_shared(roots: Sequence[Tensor]) -> None:
    """Marks the fused linears of a backward from ``roots`` whose weight or bias the graph
    reaches more than once (a layer applied twice, a weight some other op uses too): they
    return that gradient to autograd, which sums the parts, then accumulates once.

    Why: a split backward's W does so for such a weight
    (:meth:`~pipesched.runtime.deferred.WeightStore.run`); a pair of a split schedule run
    as one whole backward must give the same bits.
    """
    reached: dict[int, int] = {}  # per leaf node: the edges into it
    fused: list[Any] = []
    seen: set[Any] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if getattr(node, "fused_linear", None) is _FUSED:
            fused.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            if type(child) is ACCUMULATE_GRAD:
                reached[id(child)] = reached.get(id(child), 0) + 1
            elif child not in seen:
                seen.add(child)
                stack.append(child)
    for node in fused:
        edges = node.next_functions
        node.shared = {k for k in (1, 2) if k < len(edges) and reached.get(id(edges[k][0]), 0) > 1}


def weight_pass(node: Any, grad: Tensor, weights: Sequence[Tensor]) -> bool:
    """W of one fused linear, run directly: what the engine would do, without its ~0.25 ms.

    Args:
        node: where W's gradient enters; ``grad``: that gradient (B captured it).
        weights: the tensors this W accumulates into.

    Returns:
        False, doing nothing, unless ``node`` is a fused linear whose weight and
        bias are exactly ``weights`` and whose saved tensors are its own (not a
        checkpoint's, whose recomputation belongs to the engine).
    """
    ctx: Any = node  # a custom Function's node is its ctx
    if getattr(ctx, "fused_linear", None) is not _FUSED or ctx.hooked:
        return False
    weight, bias = ctx.parameters
    if sorted(map(id, weights)) != sorted(id(p) for p in (weight, bias) if p is not None):
        return False
    x, _ = ctx.saved_tensors
    grad_2d = grad.reshape(-1, grad.shape[-1])
    with torch.no_grad():
        accumulate_mm(weight, *weight_factors(x, grad_2d, ctx.transposed))
        if bias is not None:
            accumulate(bias, bias_grad(grad, ctx.bias_dims))
    return True


def weight_factors(x: Tensor, grad_2d: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """``(a, b)`` with the weight's gradient ``a @ b``."""
    x_2d = x.reshape(-1, x.shape[-1])
    return (x_2d.t(), grad_2d) if transposed else (grad_2d.t(), x_2d)


_FLATTEN = os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1"
"""ATen's switch that flattens a non-contiguous input too (read at import: ATen reads it
once, at its first linear)."""


def bias_dims(x: Tensor, transposed: bool) -> tuple[int, ...] | None:
    """The dimensions autograd sums a linear's output gradient over for its bias.

    None where ATen's ``linear`` ran one ``addmm`` on ``x`` as rows (a 2-D or contiguous
    input, GPT-2's ``addmm``): the gradient's rows are summed. For a non-contiguous input
    it runs ``matmul`` then ``add_``, whose bias gradient is ``sum_to`` over the leading
    dimensions: the same sum in another order, so other rounding (none for a 1-D input:
    the gradient itself, a -0.0 kept).
    """
    if transposed or x.dim() == 2 or x.is_contiguous() or (_FLATTEN and x.dim() > 2):
        return None
    return tuple(range(x.dim() - 1))


def bias_grad(grad: Tensor, dims: tuple[int, ...] | None) -> Tensor:
    """A linear's bias gradient from its output's ``grad``, summed as autograd sums it
    (``dims`` from :func:`bias_dims`)."""
    if dims is None:
        return grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad.sum(dims) if dims else grad


_FUSED = object()
"""The mark on a fused linear's node (its ctx)."""


def _leaf_wanted(kind: BackwardKind | None, node: Any) -> int:
    """What the running backward wants of a parameter's leaf node (an ``AccumulateGrad``).

    Where pipesched declared no backward, the gradient goes back to autograd,
    which accumulates, captures or drops it: exact whatever that backward is.
    """
    if node is None:
        return SKIP
    return RETURN if kind is None else kind.leaf(node)


def _input_wanted(kind: BackwardKind | None, node: Any) -> bool:
    """Whether to compute the input's gradient: the engine will use it, or may."""
    if node is None:
        return False
    if kind is not None and kind.full:
        return True
    if not any(child is not None for child, _ in node.next_functions):  # a leaf
        return kind is None or kind.leaf(node) != SKIP
    return engine_will_execute(node)  # never asked of a leaf: torch raises for a captured one


def accumulate_mm(p: Tensor, a: Tensor, b: Tensor) -> None:
    """``p.grad += a @ b`` in one GEMM (or ``p.grad = a @ b``)."""
    if p.grad is None:
        p.grad = torch.mm(a, b)
    elif p.grad.layout == torch.strided:
        p.grad.addmm_(a, b)
    else:  # a sparse .grad (a tied sparse embedding): dense + sparse, as AccumulateGrad
        p.grad = torch.mm(a, b) + p.grad


def accumulate(p: Tensor, g: Tensor) -> None:
    """``AccumulateGrad``'s rule outside grad mode: ``.grad = g`` (in a contiguous ``p``'s
    layout), ``g + .grad`` onto a sparse ``.grad`` from a dense ``g``, else ``.grad += g``."""
    grad = p.grad
    if grad is None:
        if g.layout == torch.strided and g.stride() != p.stride() and p.is_contiguous():
            g = g.contiguous()
        p.grad = g
    elif grad.is_sparse and not g.is_sparse:
        p.grad = g + grad
    else:
        grad += g
