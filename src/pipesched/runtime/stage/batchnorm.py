"""Deferred BatchNorm: running statistics of the whole mini-batch, from its micro-batches.

Each micro-batch is still normalized with its own statistics (GPipe's semantics),
but the running statistics move once per mini-batch, at :meth:`DeferredBatchNorm.commit`.
Why not torchgpipe's: its ``E[x^2] - E[x]^2`` in the input's dtype cancels
catastrophically, it stores the biased variance, and a short last batch never
commits. Here: shifted two-pass sums merged by Chan's formula in float64.
"""

from __future__ import annotations

import threading
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from pipesched.errors import ConfigError
from pipesched.runtime.stage.recompute import is_recomputing

__all__ = ["DeferredBatchNorm", "commit_all", "is_plain_batch_norm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics move once per mini-batch, not per micro-batch.

    In training mode each micro-batch is normalized with its own batch
    statistics (the same output as ``nn.BatchNorm`` on that micro-batch),
    while its count, mean and sum of squared deviations per channel are
    merged into float64 accumulators; forwards run while
    :func:`~pipesched.runtime.stage.recompute.is_recomputing` are not counted. :meth:`commit`
    then updates ``running_mean``, ``running_var`` (unbiased) and
    ``num_batches_tracked`` as ``nn.BatchNorm`` on the whole mini-batch would.
    In eval mode it is a plain BatchNorm. Inputs are ``(N, C)``,
    ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``.

    The accumulators are plain attributes, not buffers: they are not in the
    ``state_dict`` (commit before saving), and ``module.float()`` or
    ``module.half()`` cannot lower their precision. A module is used by one
    thread at a time; the pipeline runs each stage in one thread.

    Args:
        num_features: channels, the size of dimension 1 of the input.
        eps: added to the variance when normalizing.
        momentum: weight of the new mini-batch in the running statistics;
            None for a cumulative average over ``num_batches_tracked``.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics; without them the module
            always normalizes with batch statistics and nothing is accumulated.
        device: where the parameters and buffers are created.
        dtype: their dtype.

    Example:
        >>> bn = DeferredBatchNorm(2, momentum=None)
        >>> batch = torch.arange(12.0).reshape(6, 2)
        >>> for micro in batch.tensor_split(3):
        ...     _ = bn(micro)
        >>> int(bn.num_batches_tracked)
        0
        >>> bn.commit()
        >>> bn.running_mean, int(bn.num_batches_tracked)
        (tensor([5., 6.]), 1)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.reset_accumulators()

    def reset_accumulators(self) -> None:
        # Per channel: values seen, a shift (the first micro-batch's mean), and
        # the mean and M2 of the values minus the shift, all float64.
        self._count = 0
        self._shift: Tensor | None = None
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in (2, 3, 4, 5):
            raise ConfigError(
                f"DeferredBatchNorm input must have 2 to 5 dimensions (N, C, ...), "
                f"got shape {tuple(input.shape)}; channels go in dimension 1"
            )

    def forward(self, input: Tensor) -> Tensor:
        """Normalizes ``input``; in training mode also accumulates its statistics."""
        self._check_input_dim(input)
        if self.training:
            output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
            # After the call: a micro-batch F.batch_norm rejects is not counted.
            if self.track_running_stats and not is_recomputing():
                self._accumulate(input)
            return output
        batch_stats = self.running_mean is None and self.running_var is None
        return F.batch_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            batch_stats,
            0.0,
            self.eps,
        )

    @torch.no_grad()
    def _accumulate(self, input: Tensor) -> None:
        """Merges one micro-batch's per-channel count, mean and M2 (Chan et al.).

        Two passes over the micro-batch (mean, then squared deviations from
        it) on values shifted by the first micro-batch's mean: every quantity
        merged is then of the size of the spread, not of the mean, and the
        result stays exact (to float64 rounding) for data like 3000 +- 0.1.
        """
        channels = input.shape[1]
        count = input.numel() // channels if channels else 0
        if count == 0:
            return
        dims = [0, *range(2, input.dim())]
        view = [1, channels] + [1] * (input.dim() - 2)
        x = input.detach().to(torch.float64)
        if self._shift is None:
            self._shift = x.mean(dims)
        y = x - self._shift.view(view)  # a new tensor: in-place ops below are safe
        mean = y.mean(dims)
        m2 = y.sub_(mean.view(view)).square_().sum(dims)
        if self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = count, mean, m2
            return
        total = self._count + count
        delta = mean - self._mean
        self._mean = self._mean + delta * (count / total)
        self._m2 = self._m2 + m2 + delta.square() * (self._count * count / total)
        self._count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Moves the running statistics once by the mini-batch accumulated so far.

        Does what ``nn.BatchNorm`` does in one training forward of the whole
        mini-batch: ``num_batches_tracked += 1``, then with factor ``momentum``
        (or ``1 / num_batches_tracked`` when momentum is None)
        ``running = (1 - factor) * running + factor * statistic``, the
        variance being unbiased (``M2 / (n - 1)``). Then the accumulators are
        cleared. Nothing accumulated (eval mode, no running statistics, or
        commit called twice) makes it a no-op.
        """
        count, shift, mean, m2 = self._count, self._shift, self._mean, self._m2
        self.reset_accumulators()
        running_mean, running_var = self.running_mean, self.running_var
        if shift is None or mean is None or m2 is None:
            return
        if running_mean is None or running_var is None:
            return
        mean = shift + mean
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        # count >= 2: F.batch_norm refuses a training micro-batch of one value per channel.
        var = m2 / (count - 1)
        new_mean = mean * factor + running_mean.to(torch.float64) * (1.0 - factor)
        new_var = var * factor + running_var.to(torch.float64) * (1.0 - factor)
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replaces every BatchNorm in ``module`` (itself included) with a DeferredBatchNorm.

        Each replacement keeps ``num_features``, ``eps``, ``momentum``,
        ``affine``, ``track_running_stats`` and the training mode, and takes
        over the very parameter and buffer tensors of the BatchNorm it
        replaces, so an optimizer built before the conversion still updates
        them. It is an instance of the BatchNorm's class too (a
        ``DeferredBatchNorm2d`` is an ``nn.BatchNorm2d``), so code that finds
        BatchNorms by class finds it. Only a plain BatchNorm is replaced
        (:func:`is_plain_batch_norm`: its ``forward`` is torch's): a subclass
        with a ``forward`` of its own (timm's ``BatchNormAct2d`` normalizes,
        then applies an activation) is left as it is, its code running as
        written, as are ``SyncBatchNorm`` and existing DeferredBatchNorms.
        Children are replaced in place, like
        ``nn.SyncBatchNorm.convert_sync_batchnorm``.

        Args:
            module: a model, a stage, or a single BatchNorm.

        Returns:
            ``module`` with its BatchNorms replaced, or the replacement when
            ``module`` is itself a BatchNorm.

        Raises:
            ConfigError: a lazy BatchNorm has not seen an input yet, or one BatchNorm
                is used at two places of ``module``.

        Example:
            >>> model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
            >>> norm = DeferredBatchNorm.convert(model)[1]
            >>> type(norm).__name__, isinstance(norm, nn.BatchNorm2d)
            ('DeferredBatchNorm2d', True)
        """
        places: dict[int, list[str]] = {}
        for name, child in module.named_modules(remove_duplicate=False):
            if is_plain_batch_norm(child):
                places.setdefault(id(child), []).append(name or "(the model)")
        shared = next((names for names in places.values() if len(names) > 1), None)
        if shared is not None:
            raise ConfigError(
                f"a BatchNorm is used at {len(shared)} places ({', '.join(map(repr, shared))}): "
                "nn.BatchNorm moves its running statistics once per use, a DeferredBatchNorm "
                "once per mini-batch for all its uses together; give each place a BatchNorm "
                "of its own, or keep per-micro-batch statistics (deferred_batch_norm=False)"
            )
        output = module
        if is_plain_batch_norm(module):
            output = cls._replace(module)
        for name, child in module.named_children():
            output.add_module(name, cls.convert(child))
        return output

    @classmethod
    def _replace(cls, bn: _BatchNorm) -> DeferredBatchNorm:
        if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
            raise ConfigError(
                f"cannot convert {type(bn).__name__} before its first forward "
                "(num_features is not known yet); run one batch through the model first"
            )
        like = bn.running_mean if bn.running_mean is not None else bn.weight
        replacement = _deferred_class(cls, type(bn))(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            device=None if like is None else like.device,
            dtype=None if like is None else like.dtype,
        )
        for name in ("weight", "bias"):
            replacement.register_parameter(name, getattr(bn, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            replacement.register_buffer(name, getattr(bn, name))
        replacement.train(bn.training)
        return replacement


_CLASSES: dict[tuple[type, type], type] = {}
_CLASSES_LOCK = threading.Lock()


def _deferred_class(
    deferred: type[DeferredBatchNorm], kind: type[_BatchNorm]
) -> type[DeferredBatchNorm]:
    """The class a BatchNorm of class ``kind`` becomes: ``deferred`` and ``kind`` both, so
    code that finds BatchNorm layers by their class (``isinstance(m, nn.BatchNorm2d)``
    to freeze them, or to leave them out of weight decay) still finds it; with
    ``kind``'s input check. ``deferred`` itself for a class that builds otherwise
    (an ``__init__`` of its own)."""
    own_init = any("__init__" in vars(c) for c in kind.__mro__[: kind.__mro__.index(_BatchNorm)])
    if own_init or issubclass(kind, deferred):
        return deferred
    with _CLASSES_LOCK:
        made = _CLASSES.get((deferred, kind))
        if made is None:
            name = f"Deferred{kind.__name__}"
            body = {"_check_input_dim": kind._check_input_dim, "__module__": __name__}
            made = _CLASSES[(deferred, kind)] = type(name, (deferred, kind), body)
            if deferred is DeferredBatchNorm and kind.__module__.startswith("torch.nn"):
                globals()[name] = made  # torch's own classes: found again by pickle
    return made


def is_plain_batch_norm(module: nn.Module) -> TypeGuard[_BatchNorm]:
    """Whether ``module`` is a BatchNorm whose ``forward`` is torch's own, and nothing more.

    A layer is what its code does, not what its class is called: a
    ``_BatchNorm`` subclass that overrides ``forward`` (normalize, then an
    activation or a dropout) is not a plain BatchNorm, and neither are
    ``SyncBatchNorm`` (its own forward) and :class:`DeferredBatchNorm`.
    Subclasses that keep torch's ``forward`` (``LazyBatchNorm2d``, or one
    that only changes ``_check_input_dim``) are.

    Example:
        >>> class BatchNormReLU(nn.BatchNorm1d):
        ...     def forward(self, x):
        ...         return super().forward(x).relu()
        >>> is_plain_batch_norm(nn.BatchNorm1d(2)), is_plain_batch_norm(BatchNormReLU(2))
        (True, False)
    """
    return isinstance(module, _BatchNorm) and type(module).forward is _BatchNorm.forward


def commit_all(module: nn.Module) -> None:
    """Commits every DeferredBatchNorm in ``module``; call once per mini-batch.

    Example:
        >>> model = DeferredBatchNorm.convert(nn.Sequential(nn.BatchNorm1d(2)))
        >>> _ = model(torch.randn(4, 2))
        >>> commit_all(model)
        >>> int(model[0].num_batches_tracked)
        1
    """
    for child in module.modules():
        if isinstance(child, DeferredBatchNorm):
            child.commit()
