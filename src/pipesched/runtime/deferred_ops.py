"""The ops whose weight gradient W computes, each an autograd Function stashing for W.

In a split B each stashes its weight's operands in the micro-batch's store: linear
(and GPT-2's addmm), layer norm, embedding, convolution and ``nn.MultiheadAttention``'s
self-attention, each with autograd's own formulas, so B + W is bitwise the whole
backward. :data:`HANDLERS` maps the torch functions
:class:`~pipesched.runtime.deferred.DeferredWeightsMode` routes here to their handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipesched.runtime.backward_kind import Declaration, declaration
from pipesched.runtime.compat.internals import (
    function_apply,
    function_output,
    has_gradient_hooks,
    in_functorch,
)
from pipesched.runtime.fused_linear import bias_dims, bias_grad

if TYPE_CHECKING:
    from pipesched.runtime.deferred import WeightStore

__all__ = ["HANDLERS", "input_edges", "linear", "linear_weight_grads"]

_aten = torch.ops.aten
_LINEARS = (F.linear, _aten.linear.default)
_ADDMMS = (torch.addmm, _aten.addmm.default)
_LAYER_NORMS = (F.layer_norm, _aten.layer_norm.default)
_EMBEDDINGS = (F.embedding, _aten.embedding.default)


def input_edges(node: Any) -> frozenset[int] | None:
    """Where ``node`` is a deferring op's, the positions of its inputs' edges (the others
    are its weights'); None (every edge is an input's) for any other node."""
    return getattr(node, "input_edges", None)


_FIRST = frozenset({0})
"""The input's edge of an op whose tensors are ``(input, weight[, bias])``."""
_INDICES = frozenset({1})
"""An embedding's tensors are ``(weight, indices)``."""


def _plain(x: Any, *params: Any) -> bool:
    """Whether the op's operands are ones the Functions reproduce autograd's formulas for.

    Not inside a functorch transform (``vmap``, ``grad``): the Functions have no rule for
    one, and torch's op has; nor a functorch wrapper. The Functions are applied through
    torch's C ``apply`` (:func:`~pipesched.runtime.compat.internals.function_apply`), past
    ``Function.apply``'s Python, which would unwrap one; a stage thread pays that Python
    per layer and micro-batch.
    """
    if type(x) is not Tensor or x.is_complex() or in_functorch(x):
        return False
    device, dtype = x.device, x.dtype
    if torch.is_autocast_enabled(device.type):
        return False
    for p in params:
        if p is not None and not (
            (type(p) is nn.Parameter or type(p) is Tensor)  # no subclass (DTensor, ...)
            and p.dtype is dtype
            and p.layout is torch.strided
            and p.is_contiguous()
            and p.device == device
        ):
            return False
    return True


def _deferrable(p: Tensor | None, store: WeightStore) -> bool:
    """Whether B may leave ``p``'s gradient to W (read in backward, when the forward is done)."""
    return (
        p is not None
        and type(p) is nn.Parameter
        and p.requires_grad
        and id(p) not in store.flagged
        and not has_gradient_hooks(p)
    )


def _deferring(ctx: Any) -> bool:
    kind = ctx.declaration.kind
    return kind is not None and kind.deferred


# ------------------------------------------------------------------ linear and addmm


def _linear_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return linear(store, *_linear_args(*args, **kwargs))


def linear(store: WeightStore, x: Any, weight: Any, bias: Any) -> Tensor | None:
    """``F.linear(x, weight, bias)``, its weight's and bias's gradients deferrable into
    ``store``; None where the call is not one the Function reproduces."""
    if not (_plain(x, weight, bias) and _dim(weight) == 2 and x.dim() >= 1):
        return None
    if bias is not None and bias.shape != (weight.shape[0],):
        return None
    return _apply_linear(x, weight, bias, False, store, declaration())  # type: ignore[no-any-return]


def _addmm_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bias, x, weight, plain = _addmm_args(*args, **kwargs)
    if not (plain and _plain(x, weight, bias) and _dim(x) == 2 and _dim(weight) == 2):
        return None
    if bias is None or bias.shape != (weight.shape[1],):
        return None
    return _apply_linear(x, weight, bias, True, store, declaration())


def _linear_args(input: Any, weight: Any, bias: Any = None) -> tuple[Any, Any, Any]:
    return input, weight, bias


def _addmm_args(
    input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1, out: Any = None
) -> tuple[Any, Any, Any, bool]:
    return input, mat1, mat2, beta == 1 and alpha == 1 and out is None


def _dim(t: Any) -> int:
    return t.dim() if isinstance(t, Tensor) else -1


class _Linear(torch.autograd.Function):
    """``F.linear`` (``addmm`` where ``transposed``: weight ``(in, out)``), weight deferrable."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        transposed: bool,
        store: WeightStore,
        declared: Declaration,
    ) -> Tensor:
        ctx.save_for_backward(x, weight if x.requires_grad else None)
        ctx.parameters = (weight, bias)  # the tensors themselves (checkpoint gives aliases)
        ctx.transposed, ctx.store, ctx.declaration = transposed, store, declared
        ctx.bias_dims = bias_dims(x, transposed)
        ctx.input_edges = _FIRST
        if transposed and bias is not None:
            return torch.addmm(bias, x, weight)
        return function_output(F.linear(x, weight, bias))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, saved_weight = ctx.saved_tensors
        weight, bias = ctx.parameters
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = None
        if need_x:
            grad_x = _linear_input_grad(grad, x, saved_weight, ctx.transposed)
        grad_w = grad_b = None
        if need_b:  # a reduction over the gradient B holds (in cache): made here, added in W
            grad_b = bias_grad(grad, ctx.bias_dims)
        store: WeightStore = ctx.store
        if _deferring(ctx):
            defer_w = need_w and _deferrable(weight, store)
            defer_b = need_b and _deferrable(bias, store)
            if defer_w or defer_b:
                params = (weight if defer_w else None, bias if defer_b else None)
                payload = (x if defer_w else None, grad if defer_w else None, ctx.transposed)
                store.entries.append((linear_weight_grads, params, (*payload, grad_b)))
                need_w = need_w and not defer_w
                if defer_b:
                    grad_b = None
        if need_w:
            grad_w, _ = linear_weight_grads((weight, None), x, grad, ctx.transposed, None)
        return grad_x, grad_w, grad_b, None, None, None


_apply_linear = function_apply(_Linear)


def _linear_input_grad(grad: Tensor, x: Tensor, weight: Tensor, transposed: bool) -> Tensor:
    """The input's gradient as autograd's ``mm_mat1_backward`` computes it."""
    mat2 = weight if transposed else weight.t()
    if x.dim() == 2 and x.stride(0) == 1 and x.stride(1) == x.shape[0] and x.shape[1] > 1:
        return mat2.mm(grad.t()).t()  # a column-major input gets a column-major gradient
    if grad.dim() == 2:
        return grad.mm(mat2.t())
    return grad.matmul(mat2.t())


def linear_weight_grads(
    params: tuple[Tensor | None, ...],
    x: Tensor | None,
    grad: Tensor | None,
    transposed: bool,
    grad_b: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """``(weight's, bias's)`` gradients as autograd computes them, for those in ``params``;
    the bias's was made in B (:func:`~pipesched.runtime.fused_linear.bias_grad`)."""
    weight, bias = params
    grad_w = None
    if weight is not None and x is not None and grad is not None:
        grad_2d = grad.reshape(-1, grad.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        # mm_mat2_backward: addmm's (in, out) mat2 is row-major, linear's weight.t() column-major.
        grad_w = x_2d.t().mm(grad_2d) if transposed else grad_2d.t().mm(x_2d)
    return grad_w, grad_b if bias is not None else None


# ------------------------------------------------------------------ layer norm


def _layer_norm_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, shape, weight, bias, eps = _layer_norm_args(*args, **kwargs)
    if weight is None and bias is None:
        return None
    if not _plain(x, weight, bias):
        return None
    return _apply_layer_norm(x, tuple(shape), weight, bias, float(eps), store, declaration())


def _layer_norm_args(
    input: Any,
    normalized_shape: Any,
    weight: Any = None,
    bias: Any = None,
    eps: Any = 1e-5,
    cudnn_enable: Any = True,
) -> tuple[Any, Any, Any, Any, Any]:
    return input, normalized_shape, weight, bias, eps


class _LayerNorm(torch.autograd.Function):
    """``F.layer_norm`` with its affine parameters' gradients deferrable."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        shape: tuple[int, ...],
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
        store: WeightStore,
        declared: Declaration,
    ) -> Tensor:
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd)
        ctx.parameters = (weight, bias)
        ctx.shape, ctx.store, ctx.declaration = shape, store, declared
        ctx.input_edges = _FIRST
        return function_output(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, mean, rstd = ctx.saved_tensors
        weight, bias = ctx.parameters
        needs: tuple[bool, ...] = ctx.needs_input_grad
        need_x, need_w, need_b = needs[0], needs[2], needs[3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w or need_b:  # one pass, as autograd's: the affine part is a reduction
            grad_x, grad_w, grad_b = _aten.native_layer_norm_backward(
                grad, x, ctx.shape, mean, rstd, weight, bias, [need_x, need_w, need_b]
            )
        store: WeightStore = ctx.store
        if _deferring(ctx):  # made here, added into .grad in W
            defer_w = need_w and _deferrable(weight, store)
            defer_b = need_b and _deferrable(bias, store)
            if defer_w or defer_b:
                params = (weight if defer_w else None, bias if defer_b else None)
                made = (grad_w if defer_w else None, grad_b if defer_b else None)
                store.entries.append((_made, params, made))
                grad_w = None if defer_w else grad_w
                grad_b = None if defer_b else grad_b
        return grad_x, None, grad_w, grad_b, None, None, None


_apply_layer_norm = function_apply(_LayerNorm)


def _made(params: tuple[Tensor | None, ...], *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    """Gradients B already made (a layer norm's affine ones): W only accumulates them."""
    return grads


# ------------------------------------------------------------------ embedding


def _embedding_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args and isinstance(args[0], Tensor) and args[0].is_floating_point():  # aten: weight first
        # aten's padding_idx is F.embedding's normalized: any negative one means none.
        weight, indices, padding_idx, scale, unsupported = _aten_embedding_args(*args, **kwargs)
    else:
        indices, weight, padding_idx, scale, unsupported = _embedding_args(*args, **kwargs)
        if padding_idx is None:  # normalized as F.embedding does
            padding_idx = -1
        elif padding_idx < 0 and _dim(weight) == 2:
            padding_idx += weight.shape[0]
    if unsupported or _dim(weight) != 2 or type(indices) is not Tensor:
        return None
    if weight.layout != torch.strided or not weight.is_floating_point():
        return None
    if indices.is_floating_point() or torch.is_autocast_enabled(weight.device.type):
        return None
    if in_functorch(weight) or in_functorch(indices):
        return None
    return _apply_embedding(weight, indices, int(padding_idx), bool(scale), store, declaration())


def _embedding_args(
    input: Any,
    weight: Any,
    padding_idx: Any = None,
    max_norm: Any = None,
    norm_type: Any = 2.0,
    scale_grad_by_freq: Any = False,
    sparse: Any = False,
) -> tuple[Any, Any, Any, Any, bool]:
    """``(indices, weight, padding_idx, scale, unsupported)``: a sparse gradient, or
    ``max_norm`` (it renormalizes the weight in place), is left to torch."""
    return input, weight, padding_idx, scale_grad_by_freq, bool(sparse) or max_norm is not None


def _aten_embedding_args(
    weight: Any,
    indices: Any,
    padding_idx: Any = -1,
    scale_grad_by_freq: Any = False,
    sparse: Any = False,
) -> tuple[Any, Any, Any, Any, bool]:
    return weight, indices, padding_idx, scale_grad_by_freq, bool(sparse)


class _Embedding(torch.autograd.Function):
    """``F.embedding`` (dense, no ``max_norm``) with its weight's gradient deferrable."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: Tensor,
        indices: Tensor,
        padding_idx: int,
        scale: bool,
        store: WeightStore,
        declared: Declaration,
    ) -> Tensor:
        ctx.save_for_backward(indices)
        ctx.weight = weight
        ctx.options = (weight.shape[0], padding_idx, scale)
        ctx.store, ctx.declaration = store, declared
        ctx.input_edges = _INDICES
        return function_output(torch.embedding(weight, indices, padding_idx, scale, False))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        weight = ctx.weight
        grad_w = None
        if ctx.needs_input_grad[0]:
            if _deferring(ctx) and _deferrable(weight, ctx.store):
                ctx.store.entries.append(
                    (_embedding_weight_grad, (weight,), (grad, indices, ctx.options))
                )
            else:
                (grad_w,) = _embedding_weight_grad((weight,), grad, indices, ctx.options)
        return grad_w, None, None, None, None, None


_apply_embedding = function_apply(_Embedding)


def _embedding_weight_grad(
    params: tuple[Tensor | None, ...], grad: Tensor, indices: Tensor, options: tuple[int, int, bool]
) -> tuple[Tensor]:
    num, padding_idx, scale = options
    return (_aten.embedding_backward(grad, indices, num, padding_idx, scale, False),)


# ------------------------------------------------------------------ convolution


def _conv_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = _conv_args(*args, **kwargs)
    if call is None:
        return None
    x, weight, bias, stride, padding, dilation, groups = call
    if not (_plain(x, weight, bias) and _dim(weight) >= 3 and x.dim() == weight.dim()):
        return None
    n = weight.dim() - 2
    options = []
    for value in (stride, padding, dilation):
        value = [value] * n if isinstance(value, int) else list(value)
        if len(value) != n or not all(isinstance(v, int) for v in value):
            return None  # padding="same" and the like: torch's own path
        options.append(value)
    if not isinstance(groups, int) or (bias is not None and bias.shape != (weight.shape[0],)):
        return None
    conv = (*options, int(groups))
    return _apply_convolution(x, weight, bias, conv, store, declaration())


def _conv_args(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: Any = 1,
) -> tuple[Any, ...] | None:
    return input, weight, bias, stride, padding, dilation, groups


def _aten_conv_args(
    input: Any,
    weight: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: Any,
    output_padding: Any,
    groups: Any,
) -> tuple[Any, ...] | None:
    if transposed:
        return None
    return input, weight, bias, stride, padding, dilation, groups


def _aten_conv_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = _aten_conv_args(*args, **kwargs)
    return None if call is None else _conv_handler(store, call, {})


class _Convolution(torch.autograd.Function):
    """``F.conv1d/2d/3d`` (numeric padding), its weight's gradient deferrable."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        conv: tuple[Any, ...],
        store: WeightStore,
        declared: Declaration,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.parameters = (weight, bias)
        ctx.conv, ctx.store, ctx.declaration = conv, store, declared
        ctx.input_edges = _FIRST
        stride, padding, dilation, groups = conv
        zeros = [0] * len(stride)
        out = torch.convolution(x, weight, bias, stride, padding, dilation, False, zeros, groups)
        return function_output(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, saved_weight = ctx.saved_tensors
        weight, bias = ctx.parameters
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        store: WeightStore = ctx.store
        defer_w = need_w and _deferring(ctx) and _deferrable(weight, store)
        grad_x, grad_w, grad_b = _conv_backward(
            grad, x, saved_weight, bias, ctx.conv, [need_x, need_w and not defer_w, need_b]
        )
        defer_b = grad_b is not None and _deferring(ctx) and _deferrable(bias, store)
        if defer_w or defer_b:
            params = (weight if defer_w else None, bias if defer_b else None)
            payload = (x if defer_w else None, grad if defer_w else None, saved_weight)
            made_b = grad_b if defer_b else None
            store.entries.append((_conv_weight_grads, params, (*payload, ctx.conv, made_b)))
            grad_b = None if defer_b else grad_b
        return grad_x, grad_w, grad_b, None, None, None


_apply_convolution = function_apply(_Convolution)


def _conv_backward(
    grad: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv: tuple[Any, ...],
    mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """autograd's ``convolution_backward`` for the outputs ``mask`` asks for."""
    if not any(mask):
        return None, None, None
    stride, padding, dilation, groups = conv
    bias_sizes = None if bias is None else list(bias.shape)
    zeros = [0] * len(stride)
    grads = _aten.convolution_backward(
        grad, x, weight, bias_sizes, stride, padding, dilation, False, zeros, groups, mask
    )
    return tuple(g if m else None for g, m in zip(grads, mask, strict=True))  # type: ignore[return-value]


def _conv_weight_grads(
    params: tuple[Tensor | None, ...],
    x: Tensor | None,
    grad: Tensor | None,
    weight: Tensor,
    conv: tuple[Any, ...],
    grad_b: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    grad_w = None
    if params[0] is not None and x is not None and grad is not None:
        _, grad_w, _ = _conv_backward(grad, x, weight, None, conv, [False, True, False])
    return grad_w, grad_b if params[1] is not None else None


# ------------------------------------------------------------------ multi-head attention


def _mha_handler(store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.multi_head_attention_forward``'s self-attention without masks, its projections
    deferrable: torch's own ops in torch's order (the function cannot be entered with the
    mode on, so its linears would otherwise stay autograd's)."""
    call = _mha_args(*args, **kwargs)
    if call is None:
        return None
    query, heads, w_in, b_in, dropout_p, w_out, b_out, training, causal = call
    if not (_plain(query, w_in, b_in, w_out, b_out) and query.dim() == 3 and _dim(w_in) == 2):
        return None
    tgt_len, bsz, embed_dim = query.shape
    head_dim = embed_dim // heads
    if head_dim * heads != embed_dim or w_in.shape != (3 * embed_dim, embed_dim):
        return None
    proj = _apply_linear(query, w_in, b_in, False, store, declaration())
    # _in_projection_packed: (3, E), not (E, 3), as torch packs it
    proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2)
    # Why unbind, where torch indexes proj[0], proj[1], proj[2]: the same views, but each
    # select's backward fills a zero tensor of all three and the engine adds the three (half
    # the in-projection's backward at width 256); unbind's stacks them. The same values (a
    # zero's sign aside: -0.0 + 0.0 is 0.0 there).
    q, k, v = proj.contiguous().unbind(0)
    q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
    src_len = k.size(1)
    q = q.view(bsz, heads, tgt_len, head_dim)
    k = k.view(bsz, heads, src_len, head_dim)
    v = v.view(bsz, heads, src_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, None, dropout_p if training else 0.0, causal)
    del q, k, v
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = _apply_linear(out, w_out, b_out, False, store, declaration())
    return out.view(tgt_len, bsz, out.size(1)), None


def _mha_args(
    query: Any,
    key: Any,
    value: Any,
    embed_dim_to_check: Any,
    num_heads: Any,
    in_proj_weight: Any,
    in_proj_bias: Any,
    bias_k: Any,
    bias_v: Any,
    add_zero_attn: Any,
    dropout_p: Any,
    out_proj_weight: Any,
    out_proj_bias: Any,
    training: Any = True,
    key_padding_mask: Any = None,
    need_weights: Any = True,
    attn_mask: Any = None,
    use_separate_proj_weight: Any = False,
    q_proj_weight: Any = None,
    k_proj_weight: Any = None,
    v_proj_weight: Any = None,
    static_k: Any = None,
    static_v: Any = None,
    average_attn_weights: Any = True,
    is_causal: Any = False,
) -> tuple[Any, ...] | None:
    """The arguments of the one case handled (self-attention, packed, no mask but a causal
    one, no weights returned), or None. A causal mask with the hint is SDPA's is_causal."""
    plain = (
        query is key is value
        and not need_weights
        and key_padding_mask is None
        and (attn_mask is None) != bool(is_causal)
        and not use_separate_proj_weight
        and bias_k is None
        and bias_v is None
        and not add_zero_attn
        and static_k is None
        and static_v is None
        and in_proj_weight is not None
        and isinstance(query, Tensor)
        and query.dim() == 3
        and embed_dim_to_check == query.shape[-1]
    )
    if not plain:
        return None
    return (
        query, int(num_heads), in_proj_weight, in_proj_bias, float(dropout_p), out_proj_weight,
        out_proj_bias, bool(training), bool(is_causal),
    )  # fmt: skip


HANDLERS: dict[Any, Callable[[WeightStore, tuple[Any, ...], dict[str, Any]], Any]] = {
    **dict.fromkeys(_LINEARS, _linear_handler),
    **dict.fromkeys(_ADDMMS, _addmm_handler),
    **dict.fromkeys(_LAYER_NORMS, _layer_norm_handler),
    **dict.fromkeys(_EMBEDDINGS, _embedding_handler),
    F.multi_head_attention_forward: _mha_handler,
    **dict.fromkeys((F.conv1d, F.conv2d, F.conv3d), _conv_handler),
    _aten.convolution.default: _aten_conv_handler,
}
"""The ops the mode defers; each handler returns None where the call is not one it reproduces."""
