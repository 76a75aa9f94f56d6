"""The warning that BatchNorm layers normalize micro-batches, issued once per pipeline.

A training-mode BatchNorm computes statistics over one micro-batch, unlike the plain
model; that one departure is said once, at the first step where it happens.
:class:`~pipesched.DeferredBatchNorm` and eval-mode BatchNorms with running
statistics do not count; a traced model's own training-mode ``F.batch_norm`` call
(no BatchNorm layer) does, read from its export. Why a warning and not an error: it
is how GPipe trains.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import MicroBatchNormWarning, warn_user
from pipesched.partition.trace import TracedModel
from pipesched.runtime.compat.internals import OpOverload, op_schema
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm, is_plain_batch_norm

__all__ = ["MicroBatchNormWarning", "micro_batch_norms", "warn_micro_batch_norm"]

_SHOWN_NAMES = 5  # layer names in the message; the rest are counted

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def micro_batch_norms(module: nn.Module) -> list[str]:
    """The names in ``module`` of the BatchNorm layers that would normalize micro-batches.

    See the module docstring for which layers count. A layer that is
    ``module`` itself is named by its type.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.LayerNorm(3))
        >>> micro_batch_norms(model)
        ['1']
        >>> micro_batch_norms(model.eval())
        []
    """
    return [
        name or type(layer).__name__
        for name, layer in module.named_modules()
        if _normalizes_batch(layer)
    ]


def functional_batch_norms(traced: TracedModel) -> list[str]:
    """Where a traced model normalizes over the batch by a call of its own: the modules
    (their paths; the model's type for its own forward) whose code runs a training-mode
    batch norm outside any BatchNorm layer (``F.batch_norm(h, rm, rv, training=True)``).

    Read from the export's operations by their ``training`` argument, whatever the
    module's class: a BatchNorm layer's own call is :func:`micro_batch_norms`' to count.
    Computed once per trace.
    """
    return _read(traced)[0]


def _read(traced: TracedModel) -> tuple[list[str], frozenset[str]]:
    """The trace's own batch norm calls, and the paths of the modules that run in it."""
    known = _reads.get(traced)
    if known is None:
        runs = frozenset(
            path for n in traced.ops for path, _ in (n.meta.get("nn_module_stack") or {}).values()
        )
        known = _reads[traced] = (_functional_batch_norms(traced), runs)
    return known


_reads: weakref.WeakKeyDictionary[TracedModel, tuple[list[str], frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def _functional_batch_norms(traced: TracedModel) -> list[str]:
    found: dict[str, None] = {}
    for node in traced.ops:
        op = node.target
        if not isinstance(op, OpOverload) or "batch_norm" not in op_schema(op).name:
            continue
        names = [a.name for a in op_schema(op).arguments]
        if "training" not in names:  # (the no-training variants)
            continue
        k = names.index("training")
        if (node.args[k] if k < len(node.args) else node.kwargs.get("training")) is not True:
            continue
        stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        owner = stack[-1] if stack else ""
        try:
            module = traced.model.get_submodule(owner)
        except AttributeError:
            module = None
        if not isinstance(module, _BatchNorm):
            found[owner or type(traced.model).__name__] = None
    return list(found)


def warn_micro_batch_norm(
    pipeline: nn.Module, rows: Sequence[int], traced: TracedModel | None = None
) -> None:
    """Warns once per ``pipeline`` if this step's BatchNorms normalize micro-batches.

    Call at the start of every step (training or forward) with the row count
    of each of its micro-batches. The first call that has more than one
    micro-batch and finds a counted BatchNorm (:func:`micro_batch_norms`)
    issues a :class:`~pipesched.errors.MicroBatchNormWarning` attributed to
    the user's line that called the pipeline; later calls for the same
    pipeline do nothing, whether or not the warning was filtered out.

    Args:
        pipeline: the pipeline (its layers carry the plain model's names); its
            ``chunks`` attribute, if any, is quoted in the message.
        rows: the rows of each micro-batch of this step.
        traced: the trace this step runs: only the BatchNorm layers that run in it
            count (a layer the model holds but never calls does not), and the model's
            own batch norm calls (:func:`functional_batch_norms`).
    """
    if len(rows) < 2 or pipeline in _warned:
        return
    functional, runs = ([], None) if traced is None else _read(traced)
    layers = [n for n in micro_batch_norms(pipeline) if runs is None or n in runs]
    names = layers + functional
    if not names:
        return
    with _lock:
        if pipeline in _warned:
            return
        _warned.add(pipeline)
    chunks = getattr(pipeline, "chunks", len(rows))
    own = [n for n in names if n not in functional and not is_plain_batch_norm(_layer(pipeline, n))]
    warn_user(_message(names, own, functional, list(rows), chunks), MicroBatchNormWarning)


def _layer(pipeline: nn.Module, name: str) -> nn.Module:
    try:
        return pipeline.get_submodule(name)
    except AttributeError:  # the pipeline itself, named by its type
        return pipeline


def _normalizes_batch(layer: nn.Module) -> bool:
    if not isinstance(layer, _BatchNorm) or isinstance(layer, DeferredBatchNorm):
        return False
    return layer.training or (layer.running_mean is None and layer.running_var is None)


def _listed(names: list[str]) -> str:
    more = len(names) - _SHOWN_NAMES
    return ", ".join(names[:_SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def _message(
    names: list[str], own: list[str], functional: list[str], rows: list[int], chunks: int
) -> str:
    shown = _listed(names)
    layers = "layer" if len(names) == 1 else f"{len(names)} layers"
    verb = "normalizes" if len(names) == 1 else "normalize"
    low, high = min(rows), max(rows)
    size = f"{low}" if low == high else f"{low} to {high}"
    count = "" if len(rows) == chunks else f": {len(rows)} micro-batches"
    subclasses = ""
    if own:
        subclasses = (
            f" {_listed(own)} {'runs its' if len(own) == 1 else 'run their'} own forward "
            "(a BatchNorm subclass): deferred_batch_norm=True leaves such a layer as it is, "
            "so its running statistics move once per micro-batch whatever that option; for "
            "the whole batch's, "
            "run it with chunks=1 or give it torch's BatchNorm forward."
        )
    if functional:
        subclasses += (
            f" {_listed(functional)} {'calls' if len(functional) == 1 else 'call'} "
            "batch_norm in training mode itself (F.batch_norm, no BatchNorm layer): "
            "deferred_batch_norm=True does not reach such a call; for the whole batch's "
            "statistics, use an nn.BatchNorm layer with deferred_batch_norm=True or chunks=1."
        )
    return (
        f"BatchNorm {layers} ({shown}) {verb} over micro-batches of {size} "
        f"row{'s' if high != 1 else ''} (batch {sum(rows)} / chunks {chunks}{count}), "
        "not over the whole batch: outputs and gradients differ from the plain model's on "
        "the batch, and running statistics move once per micro-batch. Options: "
        "deferred_batch_norm=True (running statistics of the whole batch; normalization "
        "stays per micro-batch, and this warning is not shown); GroupNorm or LayerNorm "
        "instead of BatchNorm (per sample: no batch dependence); larger micro-batches "
        f"(fewer chunks) for statistics closer to the batch's.{subclasses} Shown once per "
        "Pipeline; silence it with warnings.filterwarnings('ignore', "
        "category=pipesched.MicroBatchNormWarning)."
    )
