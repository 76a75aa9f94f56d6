"""A module whose parts stay on the devices they were given: to(device), cuda(), cpu() denied."""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

from torch import nn

from pipesched.errors import ConfigError
from pipesched.runtime.compat.internals import parse_to

__all__ = ["Pinned"]

_Self = TypeVar("_Self", bound="Pinned")


class Pinned(nn.Module):
    """The base of :class:`~pipesched.Pipeline`: stage s lives on ``devices[placement[s]]``.

    Why refuse rather than move: one ``to(device)`` would put every stage on
    one device and silently undo the pipeline; a dtype change is harmless.
    """

    def to(self: _Self, *args: Any, **kwargs: Any) -> _Self:
        """Only dtype changes: a Pipeline's stages stay on the devices they were given."""
        device, dtype, *_ = parse_to(*args, **kwargs)
        if device is not None:
            _deny_move("to(device)")
        return super().to(dtype=dtype) if dtype is not None else self

    def cuda(self, device: Any = None) -> NoReturn:
        """Denied: see :meth:`to`."""
        _deny_move("cuda()")

    def cpu(self) -> NoReturn:
        """Denied: see :meth:`to`."""
        _deny_move("cpu()")


def _deny_move(call: str) -> NoReturn:
    raise ConfigError(
        f"Pipeline.{call} would move every stage to one device; a Pipeline keeps stage s on "
        "devices[placement[s]]. Move the model before wrapping it, or pass devices="
    )
