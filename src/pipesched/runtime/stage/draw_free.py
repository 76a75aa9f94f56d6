"""Which modules and losses can draw no random number: torch's own draw-free layers, unhooked.

A stage made only of them is never seeded and needs no tripwire
(:mod:`~pipesched.runtime.stage.seeding`); a loss among them runs unseeded.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from pipesched.runtime.compat.internals import global_module_hooks, has_module_hooks

__all__ = ["draws_nothing", "loss_draws_nothing"]

_DRAW_FREE: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
        nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
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
        nn.Upsample,
    }
)  # fmt: skip
"""torch's layers whose forward and backward draw no random number (exact types:
a subclass may override forward). Dropout, RReLU, attention and every layer of
one's own are not here: they are seeded."""


def draws_nothing(module: nn.Module) -> bool:
    """Whether ``module`` can draw no random number: only :data:`_DRAW_FREE` layers, no hooks.

    Read at the start of every step (a layer may be swapped or hooked between
    steps; :meth:`StageSeeding.begin`), and at every pass outside a step; it
    walks the modules' own dicts: about a microsecond for a stage of a few
    layers. A parametrized layer (``weight_norm``, ...) has a class of its own,
    so the exact-type test refuses it.
    """
    if global_module_hooks():
        return False
    stack = [module]
    while stack:
        m = stack.pop()
        if type(m) not in _DRAW_FREE or has_module_hooks(m):
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
