"""Tagged point-to-point transfers between ranks (gloo): each message under a tag naming it.

Each transfer is one message (:mod:`pipesched.runtime.wire`), sent with
``isend`` under a tag naming it (kind, stage, micro-batch). Sends never
block. Receives are planned per channel (a kind and a receiving stage) from
the step's transfer plan, in the order the sending stage makes them, and
posted one ahead per channel; a worker that needs a later message of a
channel reads the earlier ones first and keeps them. Both ends therefore
walk each channel in the same order, whatever order the receiving stage
consumes it in, so they agree on its layout (see :class:`TaggedTransport`).

NCCL ignores tags: it gets :mod:`pipesched.runtime.ordered` instead.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from pipesched.errors import ScheduleError
from pipesched.runtime.link import Link, TransferStats
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
from pipesched.schedule import BACKWARD, Action
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item, Recv

__all__ = ["TaggedTransport"]


class TaggedTransport:
    """Sends and receives stage values between the ranks of one pipeline, by tag.

    Layouts are tracked per channel: while a channel's layout does not change
    the receiver knows the message's size in advance; when it changes (the
    first transfer, a short micro-batch, a new sequence length) the sender
    first sends a notice, sized as the receiver expects, carrying the new
    layout.

    On gloo over TCP (Linux's default) a receive may take any message up to
    its buffer's size (gloo checks ``length <= nbytes``), and every message's
    header carries its layout anyway. There each channel's receive buffer is
    the largest message seen on it so far, and a notice (a header only) is
    sent only for a message larger than that: micro-batches of varying shapes
    pay a notice while a step grows the high-water mark, then none, and every
    receive stays posted ahead. The price: a receive buffer as large as the
    channel's largest message (a message using less than half of it is copied
    out, so the activations a schedule holds do not pin oversized buffers).
    gloo's other transports need exact sizes: there a notice precedes every
    layout change, sized as the receiver expects.

    Args:
        link: the pipeline's process group and ranks.
        num_stages: stages of the pipeline (tags name the stage).
    """

    def __init__(self, link: Link, num_stages: int) -> None:
        self.link = link
        self.num_stages = num_stages
        self.stats = TransferStats()
        self._sent: dict[Hashable, tuple[list[int], int]] = {}  # channel -> (layout, size)
        self._expected: dict[Hashable, tuple[list[int], int]] = {}
        self._planned: dict[Hashable, deque[Recv]] = {}
        self._posted: dict[Hashable, tuple[Recv, Any, torch.Tensor]] = {}  # channel -> next
        self._kept: dict[Message, Any] = {}
        self._aborted = False
        # gloo's TCP transport (not uv, Windows' and macOS's) reads a message into any
        # larger posted buffer: see the class docstring.
        self._roomy = _tcp_transport()

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        """Plans the step's receives per channel and posts each channel's first."""
        self._posted.clear()
        self._kept.clear()
        planned: dict[Hashable, deque[Recv]] = {}
        for row in rows.values():
            for item in row:
                if type(item) is Recv:
                    message = item.message
                    planned.setdefault((message.kind, message.stage), deque()).append(item)
        self._planned = planned
        for channel in planned:
            self._post_next(channel)

    def before(self, action: Action) -> None:
        """Nothing: receives are posted per channel as they are read."""

    def take(self, message: Message, peer: int, stream: Stream) -> Any:
        """Reads the channel of ``message`` up to it (keeping earlier ones) and returns it."""
        kept = self._kept.pop(message, _MISSING)
        if kept is not _MISSING:
            return kept
        channel = (message.kind, message.stage)
        while True:
            posted = self._posted.pop(channel, None)
            if posted is None:  # not in the step's plan: a direct, blocking receive
                self.stats.unplanned += 1
                posted = (Recv(message, peer), *self._post(channel, peer, message))
            recv, work, buffer = posted
            value = self._read(channel, recv, work, buffer)
            if recv.message == message:
                return value
            self._kept[recv.message] = value

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        """Starts sending ``value`` to pp rank ``peer`` as ``message``."""
        what = f"stage {message.source}'s value"
        layout, tensors = layout_of(value, f"stage {message.source}")
        channel = (message.kind, message.stage)
        last_layout, expected = self._sent.get(channel, ([], HEADER_BYTES))
        size = message_bytes(layout)
        tag = self._tag(message)
        device = self.link.device
        if self._roomy and size <= expected:
            size = expected  # the receiver's buffer: large enough, layout in the header
        elif layout != last_layout or self._roomy:
            notice = pack(NOTICE, message, layout, [], device, 0 if self._roomy else expected)
            self.link.send(notice, peer, tag, what)
            self.stats.notices += 1
        self.link.send(pack(DATA, message, layout, tensors, device), peer, tag, what)
        self._sent[channel] = (layout, size)

    def finish(self) -> None:
        """Waits for every send of this step to complete."""
        self.stats.unread += len(self._posted)
        self.link.finish()

    def abort(self) -> None:
        """Forgets the step's pending transfers."""
        self._aborted = True
        self._posted.clear()
        self._planned.clear()
        self.link.drop()

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._aborted

    def _read(self, channel: Hashable, recv: Recv, work: Any, buffer: torch.Tensor) -> Any:
        what = str(recv.message)
        self.link.wait(work, recv.peer, what)
        code, message, layout = read_header(buffer)
        if message != recv.message:  # not a RemoteError: this rank reports it to the others
            raise ScheduleError(
                f"pipesched: received {message} where {recv.message} was expected from pp rank "
                f"{recv.peer}: the ranks posted transfers in different orders"
            )
        if code == NOTICE:
            size = message_bytes(layout)
            buffer = self.link.receive(size, recv.peer, self._tag(message), what)
            self._expected[channel] = (layout, size)
        elif self._roomy:  # a message no larger than the buffer: its header says its layout
            used = message_bytes(layout)
            if buffer.numel() > 2 * used:  # values a step keeps must not pin a buffer 2x+ too big
                buffer = buffer[:used].clone()
        elif code != DATA:
            raise ScheduleError(f"pipesched: a message from pp rank {recv.peer} has code {code}")
        self._post_next(channel)
        return unpack(layout, buffer)

    def _post_next(self, channel: Hashable) -> None:
        queue = self._planned.get(channel)
        if queue:
            recv = queue.popleft()
            self._posted[channel] = (recv, *self._post(channel, recv.peer, recv.message))

    def _post(self, channel: Hashable, peer: int, message: Message) -> tuple[Any, torch.Tensor]:
        _, size = self._expected.get(channel, ([], HEADER_BYTES))
        return self.link.post(size, peer, self._tag(message))

    def _tag(self, message: Message) -> int:
        return (message.microbatch * self.num_stages + message.stage) * 2 + (
            message.kind == BACKWARD
        )


_MISSING = object()


def _tcp_transport() -> bool:
    """Whether gloo uses its TCP transport (Linux's default; uv elsewhere)."""
    transport = os.environ.get("GLOO_DEVICE_TRANSPORT", "TCP").upper()
    return sys.platform.startswith("linux") and transport == "TCP"
