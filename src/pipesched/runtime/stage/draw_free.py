"""Which modules and losses can draw no random number: torch's own draw-free layers, unhooked.

A stage made only of them is never seeded and needs no tripwire
(:mod:`~pipesched.runtime.stage.seeding`); a loss among them runs unseeded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from pipesched.runtime.compat.internals import global_module_hooks, has_module_hooks

__all__ = ["draws_nothing", "loss_draws_nothing"]

_DRAW_FREE: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
        nn.Linear, NonDynamicallyQuantizableLinear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
        nn.ConvTranspose3d, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
        nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Softplus,
        nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.PReLU, nn.GLU, nn.Hardtanh,
        nn.Hardswish, nn.Hardsigmoid, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
        nn.Softmax, nn.LogSoftmax, nn.Softmin,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
        nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.PixelShuffle,
        nn.Upsample, nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer,
    }
)  # fmt: skip
"""torch's layers whose forward and backward draw no random number (exact types:
a subclass may override forward). RReLU and every layer of one's own are not
here: they are seeded; dropout and attention are here when they cannot draw."""


def _no_dropout(module: Any) -> bool:
    return bool(module.p == 0)  # torch's dropouts return their input at p = 0: no draw


def _builtin_activation(module: Any) -> bool:
    # A string activation is F.relu or F.gelu; a module is a child (walked); any other
    # callable may draw. The layer's dropouts and attention are its children.
    activation = module.activation
    return isinstance(activation, nn.Module) or activation in (F.relu, F.gelu)


_DRAW_FREE_WHEN: dict[type[nn.Module], Callable[[Any], bool]] = {
    nn.Dropout: _no_dropout,
    nn.Dropout1d: _no_dropout,
    nn.Dropout2d: _no_dropout,
    nn.Dropout3d: _no_dropout,
    nn.AlphaDropout: _no_dropout,
    nn.FeatureAlphaDropout: _no_dropout,
    nn.MultiheadAttention: lambda m: m.dropout == 0,  # its attention drops at p = dropout
    nn.TransformerEncoderLayer: _builtin_activation,
    nn.TransformerDecoderLayer: _builtin_activation,
}
"""torch's layers that draw nothing as configured (read at each step): dropouts at
p = 0 (a Transformer built with ``dropout=0``, as most fine-tuning is), attention
without dropout, torch's Transformer layers with a built-in activation."""


def draws_nothing(module: nn.Module) -> bool:
    """Whether ``module`` can draw no random number: only :data:`_DRAW_FREE` layers (or
    :data:`_DRAW_FREE_WHEN` ones as configured now), no hooks.

    Read at the start of every step (a layer may be swapped or hooked, or its
    dropout changed, between steps; :meth:`StageSeeding.begin`), and at every
    pass outside a step; it walks the modules' own dicts: about a microsecond
    for a stage of a few layers. A parametrized layer (``weight_norm``, ...)
    has a class of its own, so the exact-type test refuses it.
    """
    if global_module_hooks():
        return False
    stack = [module]
    while stack:
        m = stack.pop()
        kind = type(m)
        if kind not in _DRAW_FREE and not (kind in _DRAW_FREE_WHEN and _DRAW_FREE_WHEN[kind](m)):
            return False
        if has_module_hooks(m):
            return False
        stack.extend(child for child in m._modules.values() if child is not None)
    return True


_DRAW_FREE_LOSSES: frozenset[Any] = frozenset(
    {
        F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.cross_entropy, F.nll_loss,
        F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div,
        F.cosine_embedding_loss, F.margin_ranking_loss, F.soft_margin_loss,
    }
)  # fmt: skip
_DRAW_FREE_LOSS_MODULES: frozenset[type[nn.Module]] = frozenset(
    {
        nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.CrossEntropyLoss,
        nn.NLLLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.KLDivLoss,
    }
)  # fmt: skip


def loss_draws_nothing(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is one of torch's losses, which draw no random number.

    One of ``torch.nn.functional``'s losses itself, or an instance of exactly
    one of ``torch.nn``'s loss modules without hooks. A function of one's own
    (a lambda around one of them included) may draw: it is seeded.
    """
    if global_module_hooks():
        return False
    if isinstance(loss_fn, nn.Module):
        return type(loss_fn) in _DRAW_FREE_LOSS_MODULES and not has_module_hooks(loss_fn)
    try:
        return loss_fn in _DRAW_FREE_LOSSES
    except TypeError:  # unhashable
        return False
