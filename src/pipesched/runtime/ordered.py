"""Point-to-point transfers under NCCL's rules: tags ignored, messages matched in posting order.

Every send and receive is posted in the order of the schedule's transfer plan,
which both ends agree on; each message's header names it, so a mismatch is an
error, never a swapped tensor. A receive needs the exact size: known layouts are
posted ahead, a new shape is preceded by a header-only notice. On gloo,
``PIPESCHED_P2P=ordered`` selects it so that CPU tests follow NCCL's rules.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from pipesched.errors import ConfigError, ScheduleError
from pipesched.runtime.link import Link, PlanCursor, TransferStats, check_identity
from pipesched.runtime.streams import Stream
from pipesched.runtime.wire import (
    DATA,
    HEADER_BYTES,
    NOTICE,
    layout_of,
    message_bytes,
    pack,
    read_header,
    unpack,
)
from pipesched.schedule import Action
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item, Recv

__all__ = ["OrderedTransport", "signature"]

_TAG = 0
_KNOWN_LIMIT = 1024
"""Layouts kept per pair and direction; both ends forget them all at once past it."""


class OrderedTransport:
    """Sends and receives in the transfer plan's order, one tag for all (NCCL's rules).

    Args:
        link: the pipeline's process group and ranks.
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self.stats = TransferStats()
        self._known: dict[tuple[int, bool], dict[Hashable, list[int]]] = {}
        self._plan = PlanCursor()
        self._posted: dict[Message, tuple[Recv, Any, torch.Tensor, list[int]]] = {}
        self._signatures: list[Hashable] = []
        self._aborted = False

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        """Takes this rank's plan (one worker) and the micro-batches' input shapes."""
        self._plan.start(rows)
        self._posted.clear()
        self._signatures = [signature(x) for x in inputs]

    def before(self, action: Action) -> None:
        """Posts every receive the plan puts before ``action``."""
        for recv in self._plan.receives_before(action):
            self._post(recv)

    def take(self, message: Message, peer: int, stream: Stream) -> Any:
        """Waits for ``message``, posted by :meth:`before`, and returns its value."""
        posted = self._posted.pop(message, None)
        if posted is None:
            raise ScheduleError(
                f"pipesched: {message} was taken before its receive was posted: the runtime "
                "left the transfer plan's order (a bug: please report it)"
            )
        recv, work, buffer, layout = posted
        self.link.wait(work, recv.peer, str(message))
        code, got, _ = read_header(buffer)
        check_identity(recv, got)
        if code == NOTICE:
            raise ConfigError(
                f"{message} changed layout although the micro-batch's input shapes did not: "
                "under NCCL (or PIPESCHED_P2P=ordered) a stage's output shapes must follow "
                "from its micro-batch's input shapes, since receives are posted ahead at "
                "their size; avoid data-dependent shapes at the cut, or use gloo"
            )
        return unpack(layout, buffer)

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        """Sends ``value`` to pp rank ``peer``: in the plan's order, right after its action."""
        what = f"stage {message.source}'s value"
        layout, tensors = layout_of(value, f"stage {message.source}")
        known = self._known_for(peer, sending=True)
        key = self._key(message)
        expected = known.get(key)
        if expected != layout:  # the receiver waits for a notice of the new layout
            size = 0 if expected is None else message_bytes(expected)
            notice = pack(NOTICE, message, layout, [], self.link.device, size)
            self.link.send(notice, peer, _TAG, what)
            self.stats.notices += 1
            _remember(known, key, layout)
        self.link.send(pack(DATA, message, layout, tensors, self.link.device), peer, _TAG, what)

    def finish(self) -> None:
        """Waits for every send of this step to complete."""
        self.stats.unread += len(self._posted)
        self.link.finish()

    def abort(self) -> None:
        """Forgets the step's pending transfers."""
        self._aborted = True
        self._posted.clear()
        self._plan.clear()
        self.link.drop()

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._aborted

    def _post(self, recv: Recv) -> None:
        message, peer = recv.message, recv.peer
        known = self._known_for(peer, sending=False)
        key = self._key(message)
        layout = known.get(key)
        if layout is None:  # a new shape: its notice comes first, and must be read now
            self.stats.stalls += 1
            buffer = self.link.receive(HEADER_BYTES, peer, _TAG, f"the layout of {message}")
            code, got, layout = read_header(buffer)
            check_identity(recv, got)
            if code != NOTICE:
                raise ScheduleError(
                    f"pipesched: pp rank {peer} sent {message} without the notice of its "
                    "layout: the ranks disagree on the shapes they have seen"
                )
            _remember(known, key, layout)
        work, buffer = self.link.post(message_bytes(layout), peer, _TAG)
        self._posted[message] = (recv, work, buffer, layout)

    def _known_for(self, peer: int, *, sending: bool) -> dict[Hashable, list[int]]:
        return self._known.setdefault((peer, sending), {})

    def _key(self, message: Message) -> Hashable:
        return (message.kind, message.stage, self._signatures[message.microbatch])


def _remember(known: dict[Hashable, list[int]], key: Hashable, layout: list[int]) -> None:
    if key not in known and len(known) >= _KNOWN_LIMIT:
        known.clear()  # both ends clear at the same message: they see the same sequence
    known[key] = layout


def signature(value: Any) -> Hashable:
    """The shapes, dtypes and plain values of a micro-batch's input, as a hashable key."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape))
    if isinstance(value, tuple | list):
        return (type(value).__name__, tuple(signature(v) for v in value))
    if isinstance(value, Mapping):
        return ("dict", tuple((str(k), signature(v)) for k, v in value.items()))
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return type(value).__name__
