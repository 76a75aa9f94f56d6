"""Tagged point-to-point transfers (gloo over TCP): each message under a tag naming it.

Sends never block; receives are posted at their place in the step's transfer plan
so the data moves while the rank computes (posting each right after reading the
one before was several times slower: docs/distributed.md, "Speed"). Where receives
need exact sizes (NCCL, gloo's uv transport), :mod:`pipesched.runtime.ordered` is used.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from pipesched.errors import ScheduleError
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
from pipesched.schedule import BACKWARD, Action
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item, Recv

__all__ = ["TaggedTransport", "tcp_transport"]


class TaggedTransport:
    """Sends and receives stage values between the ranks of one pipeline, by tag.

    gloo over TCP reads a message into any posted buffer at least as large
    (it checks ``length <= nbytes``), and every message's header carries its
    layout. So each channel's receive buffers are as large as its largest
    message so far (its high-water mark), and a message needs a notice (a
    header only, announcing its size; the receiver then posts a receive of
    that size under the same tag) only when it is larger than the mark both
    ends had at the step's start. Micro-batches of varying shapes pay notices
    while the marks grow, then none. The price: receive buffers as large as
    the channel's largest message (a message using less than half of its
    buffer is copied out, so the activations a schedule holds do not pin
    oversized buffers).

    Args:
        link: the pipeline's process group and ranks.
        num_stages: stages of the pipeline (tags name the stage).
    """

    def __init__(self, link: Link, num_stages: int) -> None:
        self.link = link
        self.num_stages = num_stages
        self.stats = TransferStats()
        self._high: dict[Hashable, int] = {}  # channel -> largest message so far
        self._floor: dict[Hashable, int] = {}  # channel -> its mark at the step's start
        self._plan = PlanCursor()
        self._posted: dict[Hashable, deque[tuple[Recv, Any, torch.Tensor]]] = {}
        self._kept: dict[Message, Any] = {}
        self._aborted = False

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        """Takes the step's plan; both ends fix the marks notices are judged by."""
        self._plan.start(rows)
        self._posted.clear()
        self._kept.clear()
        self._floor = dict(self._high)  # every message of earlier steps was read: agreed

    def before(self, action: Action) -> None:
        """Posts every receive the plan puts before ``action``."""
        for recv in self._plan.receives_before(action):
            channel = (recv.message.kind, recv.message.stage)
            size = self._high.get(channel, HEADER_BYTES)
            work, buffer = self.link.post(size, recv.peer, self._tag(recv.message))
            self._posted.setdefault(channel, deque()).append((recv, work, buffer))

    def take(self, message: Message, peer: int, stream: Stream) -> Any:
        """Reads the channel of ``message`` up to it (keeping earlier ones) and returns it."""
        kept = self._kept.pop(message, _MISSING)
        if kept is not _MISSING:
            return kept
        channel = (message.kind, message.stage)
        posted = self._posted.get(channel)
        while True:
            if not posted:  # not posted by the plan: a direct, blocking receive
                self.stats.unplanned += 1
                size = self._high.get(channel, HEADER_BYTES)
                work, buffer = self.link.post(size, peer, self._tag(message))
                recv = Recv(message, peer)
            else:
                recv, work, buffer = posted.popleft()
            value = self._read(channel, recv, work, buffer)
            if recv.message == message:
                return value
            self._kept[recv.message] = value

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        """Starts sending ``value`` to pp rank ``peer`` as ``message``."""
        what = f"stage {message.source}'s value"
        layout, tensors = layout_of(value, f"stage {message.source}")
        channel = (message.kind, message.stage)
        size = message_bytes(layout)
        tag = self._tag(message)
        device = self.link.device
        if size > self._floor.get(channel, HEADER_BYTES):  # may not fit the receiver's buffer
            self.link.send(pack(NOTICE, message, layout, [], device), peer, tag, what)
            self.stats.notices += 1
        self.link.send(pack(DATA, message, layout, tensors, device), peer, tag, what)
        if size > self._high.get(channel, 0):
            self._high[channel] = size

    def finish(self) -> None:
        """Waits for every send of this step to complete."""
        self.stats.unread += sum(map(len, self._posted.values()))
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

    def _read(self, channel: Hashable, recv: Recv, work: Any, buffer: torch.Tensor) -> Any:
        what = str(recv.message)
        self.link.wait(work, recv.peer, what)
        code, message, layout = read_header(buffer)
        check_identity(recv, message)
        used = message_bytes(layout)
        if code == NOTICE:  # the data follows under the same tag, in a buffer of its size
            buffer = self.link.receive(used, recv.peer, self._tag(message), what)
        elif code != DATA:
            raise ScheduleError(f"pipesched: a message from pp rank {recv.peer} has code {code}")
        elif buffer.numel() > 2 * used:  # values a step keeps must not pin a buffer 2x+ too big
            buffer = buffer[:used].clone()
        if used > self._high.get(channel, 0):
            self._high[channel] = used
        return unpack(layout, buffer)

    def _tag(self, message: Message) -> int:
        return (message.microbatch * self.num_stages + message.stage) * 2 + (
            message.kind == BACKWARD
        )


_MISSING = object()


def tcp_transport() -> bool:
    """Whether gloo uses its TCP transport (Linux's default; uv elsewhere)."""
    transport = os.environ.get("GLOO_DEVICE_TRANSPORT", "TCP").upper()
    return sys.platform.startswith("linux") and transport == "TCP"
