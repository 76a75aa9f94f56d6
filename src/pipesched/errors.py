"""The exception hierarchy (one base class, each a built-in type too), warnings, argument checks."""

from __future__ import annotations

import sys
import warnings

__all__ = [
    "BatchCoupledWarning",
    "CheckpointError",
    "ConfigError",
    "ConfigTypeError",
    "GradientBackupError",
    "MicroBatchNormWarning",
    "MissingDependencyError",
    "PartitionError",
    "PipeschedError",
    "PipeschedWarning",
    "RemoteError",
    "RetraceWarning",
    "ScheduleError",
    "TorchInternalsWarning",
    "check_number",
    "check_positive_int",
    "warn_user",
]


class PipeschedError(Exception):
    """Base class of every error pipesched raises on purpose."""


class ConfigError(PipeschedError, ValueError):
    """An argument has a value pipesched cannot work with.

    The message names the argument, the value seen and the fix.
    """


class ConfigTypeError(ConfigError, TypeError):
    """An argument has the wrong type, or a call the wrong number of arguments.

    A :class:`ConfigError` (so ``except ConfigError`` still catches it) and a
    ``TypeError``, which is what Python itself raises for ``f(x, x)`` when
    ``f`` takes one argument, or for ``range("4")``.
    """


class ScheduleError(PipeschedError, ValueError):
    """A schedule cannot run: an action is missing, duplicated, misplaced, or the order deadlocks.

    The message names the offending actions and shows the schedule table.
    """


class PartitionError(PipeschedError, ValueError):
    """A model cannot be cut into the stages asked for (balance, split points, tracing)."""


class RemoteError(PipeschedError, RuntimeError):
    """Another rank of a distributed pipeline failed, died, or did not answer in time.

    The message says all of it; the attributes hold the same facts for a
    handler (None where unknown).

    Attributes:
        kind: ``"error"`` (the rank raised), ``"died"`` (its connection closed
            without a report: killed, out of memory) or ``"timeout"`` (it did
            not answer within the mesh's timeout: hung, or slower than that).
        rank: the global rank that failed, died or did not answer.
        pp_rank, dp_rank: its place in the mesh.
        action: the schedule action it was running (``"1F2"``), if known.
        error_type, error_message: the original exception's type name and
            message (kind ``"error"``).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "error",
        rank: int | None = None,
        pp_rank: int | None = None,
        dp_rank: int | None = None,
        action: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.rank, self.pp_rank, self.dp_rank = rank, pp_rank, dp_rank
        self.action = action
        self.error_type, self.error_message = error_type, error_message


class GradientBackupError(PipeschedError, RuntimeError):
    """The copy of the window's gradients (``grad_backup="host"`` or ``"disk"``) failed.

    Raised before a step, when the copy cannot be made (the step did not run
    and nothing changed), or after a failed step, when the copy cannot be read
    back (the window's gradients are lost: zero them and run the window again).
    The file system's or CUDA's own error is chained as ``__cause__``.
    """


class CheckpointError(PipeschedError, ValueError):
    """A checkpoint cannot be read, or does not fit what it is loaded into.

    Raised before anything was changed. The message names the file (when
    loading from a path), what does not fit and the fix; an unreadable file's
    own error is chained as ``__cause__``.
    """


class MissingDependencyError(PipeschedError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra.

    Raised where the feature is asked for (``synthesize(..., solver="exact")``
    without OR-Tools), not at import; the import's own error is ``__cause__``.
    """


class PipeschedWarning(UserWarning):
    """Base class of every warning pipesched gives on purpose."""


class RetraceWarning(PipeschedWarning):
    """A traced model is traced and cut again: a call's arguments changed what the trace fixed.

    The message names what changed (the structure of the arguments, a
    non-tensor value, a tensor's dtype or number of dimensions). The new cut
    is kept beside the old one, so alternating kinds of call trace once each.
    """


class MicroBatchNormWarning(PipeschedWarning):
    """BatchNorm layers in training mode normalize each micro-batch, not the whole batch.

    Issued once per :class:`~pipesched.Pipeline`, at its first step with more
    than one micro-batch; the message names the layers, the micro-batch rows
    and the remedies (:mod:`pipesched.pipeline.checks.micro_batch_norm`). A ``UserWarning``:
    silence it with ``warnings.filterwarnings("ignore",
    category=pipesched.MicroBatchNormWarning)``.
    """


class BatchCoupledWarning(PipeschedWarning):
    """A traced model's output mixes rows of different samples: no micro-batch can compute it.

    An in-batch contrastive loss, or a similarity matrix over the batch
    (CLIP's ``logits_per_image``), computed per micro-batch is not the plain
    model's on the batch. ``pipe(x)`` then returns such an output as the list
    of the micro-batches' values, and a training step says so once per
    Pipeline, before its ``loss_fn`` reads them; each message names the
    outputs and the fix (:mod:`pipesched.pipeline.checks.coupled_outputs`).
    """


class TorchInternalsWarning(PipeschedWarning):
    """A private torch API pipesched uses is missing or changed: a feature falls back.

    Issued once per process, at import, naming the API and the exact, slower
    path that replaces what needed it (:mod:`pipesched.runtime.compat.internals`).
    """


class NativeKernelWarning(PipeschedWarning):
    """pipesched's C++ kernel for random operations could not be built or loaded.

    Random operations then take its Python kernel: the same numbers, about 20 us
    more per draw. The message says what failed (no C++ compiler or ninja, a
    failed compile); ``PIPESCHED_NATIVE_RNG=0`` skips the kernel without a warning.
    """


def warn_user(message: str, category: type[Warning]) -> None:
    """Warns at the first caller outside pipesched and torch: the user's own line.

    Why: pipesched is reached through ``nn.Module.__call__``,
    ``GradientAccumulator.step`` or ``Pipeline.step``, at different depths;
    a warning belongs to the user's line, not to one of ours.
    """
    level, frame = 2, sys._getframe(1)  # 2: warn_user's caller
    while frame.f_back is not None and _internal(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _internal(module: str) -> bool:
    return module.split(".", 1)[0] in ("pipesched", "torch")


def check_positive_int(name: str, value: object, hint: str = "") -> int:
    """``value`` as an int >= 1.

    Raises:
        ConfigTypeError: ``value`` is not an int (a bool is not one either).
        ConfigError: ``value`` is an int below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        fix = f"; pass {name}={_as_int(value)}" if _as_int(value) is not None else ""
        raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}{fix}{hint}")
    if value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}{hint}")
    return value


def check_number(name: str, value: object, what: str) -> None:
    """Refuses a ``value`` that is not a real number (a bool is not one either).

    Raises:
        ConfigTypeError: naming ``name``, ``what`` it must be, and the value seen.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigTypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def _as_int(value: object) -> int | None:
    """The int a user plainly meant (``"4"``, ``4.0``), if any."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None
