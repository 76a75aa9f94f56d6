"""The exception hierarchy: one base class, each subclass also a built-in type users catch."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigTypeError",
    "PartitionError",
    "PipeschedError",
    "RemoteError",
    "ScheduleError",
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
    """Another rank of a distributed pipeline failed or died; the message names it."""


class CheckpointError(PipeschedError, ValueError):
    """A checkpoint cannot be read, or does not fit what it is loaded into.

    Raised before anything was changed. The message names the file (when
    loading from a path), what does not fit and the fix; an unreadable file's
    own error is chained as ``__cause__``.
    """
