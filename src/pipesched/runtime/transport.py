"""The contract between the interpreter and whatever carries values between workers.

A :class:`Transport` is the in-process mailbox, tagged gloo p2p or NCCL-ordered p2p.
NCCL, and gloo where it needs exact sizes (uv: macOS, Windows), get the ordered one;
gloo over TCP gets the tagged one unless ``PIPESCHED_P2P=ordered`` (a testing aid).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pipesched.errors import ConfigError
from pipesched.runtime.link import TransferStats
from pipesched.runtime.streams import Stream
from pipesched.schedule import Action
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item

__all__ = ["P2P_MODES", "Transport", "p2p_mode"]

P2P_MODES = ("tagged", "ordered")
"""Values of ``PIPESCHED_P2P``: tagged (gloo's default) and ordered (NCCL's rules)."""


class Transport(Protocol):
    """Carries stage inputs and output gradients between workers within one step."""

    stats: TransferStats

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        """A step begins: ``rows`` are the transfer plans of the workers run here
        (:func:`~pipesched.schedule.transfers.transfer_plan`), ``inputs`` the
        micro-batches' stage-0 inputs."""

    def before(self, action: Action) -> None:
        """Called before a worker runs ``action``: post what the agreed order puts first."""

    def take(self, message: Message, peer: int, stream: Stream) -> Any:
        """Waits for ``message`` from worker ``peer`` and returns it (ready on ``stream``)."""

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        """Hands ``value`` (made on ``stream``) to worker ``peer`` as ``message``."""

    def finish(self) -> None:
        """The step's actions have all run: complete what is still in flight."""

    def abort(self) -> None:
        """Releases every worker waiting in :meth:`take` (a failure, an interrupt)."""

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""


def p2p_mode(backend: str, *, roomy: bool = True) -> str:
    """The p2p transport a mesh on ``backend`` uses: ``"ordered"`` or ``"tagged"``.

    ``roomy``: whether a receive there takes any message up to its buffer's
    size (gloo over TCP).

    Raises:
        ConfigError: ``PIPESCHED_P2P`` is set to something else than
            :data:`P2P_MODES`, or to ``tagged`` on a backend that ignores tags.
    """
    asked = os.environ.get("PIPESCHED_P2P", "").strip().lower()
    if asked and asked not in P2P_MODES:
        raise ConfigError(
            f"PIPESCHED_P2P={asked!r} is not one of {', '.join(P2P_MODES)}: unset it, or set "
            "ordered to make gloo follow NCCL's matching rules (a testing aid)"
        )
    if backend != "gloo" or not roomy:
        if asked == "tagged":
            why = (
                "matches messages by order, not tag"
                if backend != "gloo"
                else ("here (gloo's uv transport) needs receives of the message's exact size")
            )
            raise ConfigError(
                f"PIPESCHED_P2P=tagged, but the {backend} backend {why}: unset PIPESCHED_P2P"
            )
        return "ordered"
    return asked or "tagged"
