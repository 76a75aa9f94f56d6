"""The in-process transport: values handed between worker threads, abortable so nothing hangs."""

from __future__ import annotations

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
    """Values keyed by message, put by one worker thread and taken once by another.

    ``take`` blocks until the value is there or :meth:`abort` is called, so a
    failure in any worker releases every other one at once. On CUDA a value
    travels with an event recorded on the producer's stream, which the
    consumer's stream waits for. A Mailbox serves one step.
    """

    def __init__(self) -> None:
        self._items: dict[Hashable, Any] = {}
        self._ready = threading.Condition()
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
        value, event = self.get(message)
        wait_event(stream, event)
        return value

    def put(self, message: Message, peer: int, value: Any, stream: Stream) -> None:
        """Leaves ``value`` for whoever takes ``message``."""
        self.set(message, (value, record_event(stream)))

    def set(self, key: Hashable, value: Any) -> None:
        """Leaves ``value`` for whoever gets ``key``."""
        with self._ready:
            self._items[key] = value
            self._ready.notify_all()

    def get(self, key: Hashable) -> Any:
        """Waits for ``key`` and removes its value.

        Raises:
            Aborted: :meth:`abort` was called before the value arrived.
        """
        with self._ready:
            while key not in self._items:
                if self._aborted:
                    raise Aborted
                self._ready.wait()
            return self._items.pop(key)

    def finish(self) -> None:
        """Nothing in flight once every worker has stopped."""

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._aborted

    def abort(self) -> None:
        """Wakes every waiting worker with :class:`Aborted`."""
        with self._ready:
            self._aborted = True
            self._ready.notify_all()
