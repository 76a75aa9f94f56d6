"""The process-group side of point-to-point transfers: post, wait, and name who failed.

Both p2p transports send and receive through a :class:`Link`; sends never block
and are kept until :meth:`Link.finish`. A failure is a
:class:`~pipesched.errors.RemoteError` naming the peer (:mod:`pipesched.runtime.failures`).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipesched.errors import ScheduleError
from pipesched.runtime.failures import FailureChannel
from pipesched.schedule import Action
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item, Recv

__all__ = ["Link", "PlanCursor", "TransferStats", "check_identity"]


@dataclass
class TransferStats:
    """What a step's transfers did, counted for tests and benchmarks.

    Attributes:
        notices: notices sent (a layout the receiver did not expect).
        unplanned: receives the step's plan did not post ahead.
        unread: receives posted but never read (left after the last step).
        stalls: receives whose size was unknown, so the posting waited for them.
    """

    notices: int = 0
    unplanned: int = 0
    unread: int = 0
    stalls: int = 0


class PlanCursor:
    """This rank's transfer plan for one step, walked in order (both p2p transports post by it)."""

    def __init__(self) -> None:
        self._queue: deque[Item] = deque()

    def start(self, rows: Mapping[int, Sequence[Item]]) -> None:
        """Takes the plan of the one worker this rank runs."""
        (row,) = rows.values()
        self._queue = deque(row)

    def receives_before(self, action: Action) -> Iterator[Recv]:
        """The receives the plan puts before ``action`` (and after the previous action)."""
        queue = self._queue
        while queue:
            item = queue.popleft()
            if item == action:
                return
            if type(item) is Recv:
                yield item

    def clear(self) -> None:
        """Forgets the rest of the plan (after a failure)."""
        self._queue.clear()


def check_identity(recv: Recv, got: Message) -> None:
    """Raises unless the message read is the one ``recv`` waits for.

    Raises:
        ScheduleError: the two ranks posted their transfers in different
            orders (not a RemoteError: this rank reports it to every other).
    """
    if got != recv.message:
        raise ScheduleError(
            f"pipesched: received {got} where {recv.message} was expected from pp rank "
            f"{recv.peer}: the two ranks posted their transfers in different orders, which "
            "NCCL's matching (by order, not tag) turns into swapped tensors"
        )


class Link:
    """Posts sends and receives to the ranks of one pipeline over ``group``.

    Args:
        ranks: the global rank of each pp index.
        device: this rank's device (where received tensors land).
        failures: where failures are reported and read.
        group: the process group (None: the default one).
    """

    def __init__(
        self, ranks: tuple[int, ...], device: torch.device, failures: FailureChannel, group: Any
    ) -> None:
        self.ranks = ranks
        self.device = device
        self.failures = failures
        self.group = group
        self._pending: list[tuple[Any, torch.Tensor, int]] = []  # (work, buffer, peer)
        # The last works waited for, kept: gloo's thread may hold a finished work when
        # wait() returns, and freeing it from there at interpreter exit aborts the
        # process (see pipesched.runtime.mesh.wait_kept). Freed by Python instead.
        self._recent: deque[Any] = deque(maxlen=8)

    # A try/except around each call rather than ``with self.peer(...)``: these run
    # several times per action, and a generator context manager costs a few us.

    def send(self, buffer: torch.Tensor, peer: int, tag: int, what: str) -> None:
        """Starts sending ``buffer`` to pp rank ``peer``; ``what`` it carries, for errors."""
        start = time.monotonic()
        try:
            work = dist.isend(buffer, dst=self.ranks[peer], group=self.group, tag=tag)
        except Exception as error:
            raise self._failed(error, start, peer, f"sending {what} to it") from error
        self._pending.append((work, buffer, peer))

    def post(self, size: int, peer: int, tag: int) -> tuple[Any, torch.Tensor]:
        """Posts a receive of ``size`` bytes from pp rank ``peer``: ``(work, buffer)``."""
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        start = time.monotonic()
        try:
            work = dist.irecv(buffer, src=self.ranks[peer], group=self.group, tag=tag)
        except Exception as error:
            raise self._failed(error, start, peer, "posting a receive from it") from error
        return work, buffer

    def wait(self, work: Any, peer: int, what: str) -> None:
        """Waits for a posted receive from ``peer`` of ``what``."""
        start = time.monotonic()
        try:
            if work is not None:
                work.wait()
        except Exception as error:
            raise self._failed(error, start, peer, f"waiting for {what}") from error
        self._recent.append(work)

    def receive(self, size: int, peer: int, tag: int, what: str) -> torch.Tensor:
        """Posts a receive and waits for it."""
        work, buffer = self.post(size, peer, tag)
        self.wait(work, peer, what)
        return buffer

    def finish(self) -> None:
        """Waits for every send started so far."""
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            with self.peer(peer, "finishing this step's sends to it"):
                work.wait()
            self._recent.append(work)

    def drop(self) -> None:
        """Forgets every pending send and the group (after a failure, before it closes)."""
        self._pending.clear()
        self._recent.clear()
        self.group = None

    @contextlib.contextmanager
    def peer(self, peer: int, doing: str) -> Iterator[None]:
        """Turns a failed transfer with pp rank ``peer`` into the RemoteError that explains it.

        ``doing``: what this rank was doing, in words ("waiting for ...").
        The error reported first by any rank wins; with none, the peer is named
        from how the wait ended (see :meth:`FailureChannel.lost`).
        """
        start = time.monotonic()
        try:
            yield
        except Exception as error:
            raise self._failed(error, start, peer, doing) from error

    def _failed(self, error: Exception, start: float, peer: int, doing: str) -> Exception:
        failure = self.failures.first()
        if failure is None:  # nobody reported: name the peer from how the wait ended
            waited = time.monotonic() - start
            failure = self.failures.lost(error, waited, doing, peer, self.ranks[peer])
            self.failures.report(failure)
        return failure.error()
