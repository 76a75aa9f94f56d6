"""The in-process transport: values handed between worker threads, abortable so nothing hangs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from pipesched.runtime.link import TransferStats
from pipesched.runtime.streams import Stream, record_event, wait_event
from pipesched.schedule import Action
from pipesched.schedule.dataflow import Message
from pipesched.schedule.transfers import Item

__all__ = ["Aborted", "Mailbox"]


class Aborted(Exception):
    """Raised in a worker waiting on the mailbox after another worker failed."""


class Mailbox:
    """Values handed from one worker thread to another, each taken once.

    Each receiving stage has an inbox (a C-level ``queue.SimpleQueue``: one
    put wakes its reader directly) and a stash for values that arrived before
    the one it waits for. ``take`` blocks until its value is there or
    :meth:`abort` is called, so a failure in any worker releases every other
    one at once. On CUDA a value travels with an event recorded on the
    producer's stream, which the consumer's stream waits for. A Mailbox
    serves one step.
    """

    def __init__(self) -> None:
        self._inboxes: dict[int, queue.SimpleQueue[Any]] = {}
        self._stashes: dict[int, dict[Hashable, Any]] = {}
        self._lock = threading.Lock()
        self._aborted = False
        self.stats = TransferStats()

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        """Nothing to plan: threads hand values over as they come."""

    def before(self, action: Action) -> None:
        """Nothing to post."""

    def take(self, message: Message, peer: int, stream: Stream) -> Any:
        """Waits for ``message`` and removes it; ``stream`` waits for its producer.

        Raises:
            Aborted: :meth:`abort` was called before the value arrived.
        """
        value, event = self.get(message.stage, message)
        wait_event(stream, event)
        return value

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        """Leaves ``value`` for whoever takes ``message``."""
        self.set(message.stage, message, (value, record_event(stream)))

    def set(self, box: int, key: Hashable, value: Any) -> None:
        """Leaves ``value`` under ``key`` in inbox ``box``."""
        self._inbox(box).put((key, value))

    def get(self, box: int, key: Hashable) -> Any:
        """Waits for ``key`` in inbox ``box`` and removes its value (one reader per inbox).

        Raises:
            Aborted: :meth:`abort` was called before the value arrived.
        """
        stash = self._stashes.get(box)
        if stash is not None and key in stash:
            return stash.pop(key)
        inbox = self._inbox(box)
        while True:
            if self._aborted:
                raise Aborted
            item = inbox.get()
            if item is _ABORT:
                inbox.put(_ABORT)  # for the next wait, if any
                raise Aborted
            got, value = item
            if got == key:
                return value
            self._stashes.setdefault(box, {})[got] = value

    def finish(self) -> None:
        """Nothing in flight once every worker has stopped."""

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._aborted

    def abort(self) -> None:
        """Wakes every waiting worker with :class:`Aborted`."""
        with self._lock:
            self._aborted = True
            for inbox in self._inboxes.values():
                inbox.put(_ABORT)

    def _inbox(self, box: int) -> queue.SimpleQueue[Any]:
        inbox = self._inboxes.get(box)
        if inbox is None:
            with self._lock:
                inbox = self._inboxes.setdefault(box, queue.SimpleQueue())
                if self._aborted:
                    inbox.put(_ABORT)
        return inbox


_ABORT = object()
