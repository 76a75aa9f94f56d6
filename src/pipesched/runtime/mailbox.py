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
from pipesched.schedule.transfers import Item, Send

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

    Args:
        hold: hold each worker's values back until it is about to wait (or has
            made its last one), and deliver them then, together. Why: every
            value delivered wakes its reader, and two workers awake at once
            pass the GIL back and forth at each of torch's calls (each call
            releases it); where actions last tens of microseconds those
            switches can cost more than the overlap gains (a 2-stage step of
            512 tiny micro-batches, on 2 idle cores: 260-290 ms free, 175
            ms held). Held, the workers take turns: one runs while the other
            sleeps. Whether to hold is measured (:mod:`pipesched.runtime.turns`).
    """

    def __init__(self, *, hold: bool = False) -> None:
        self._inboxes: dict[int, queue.SimpleQueue[Any]] = {}
        self._stashes: dict[int, dict[Hashable, Any]] = {}
        self._lock = threading.Lock()
        self._aborted = False
        self._hold = hold
        self._held = threading.local()  # .values: this worker's undelivered (box, key, value)
        self._last: frozenset[Message] = frozenset()  # each worker's last value sent
        self.stats = TransferStats()

    def start(self, rows: Mapping[int, Sequence[Item]], inputs: Sequence[Any]) -> None:
        """Notes each worker's last value sent: holding stops there (see ``hold``)."""
        if self._hold:
            sent = [
                [item.message for item in row if isinstance(item, Send)] for row in rows.values()
            ]
            self._last = frozenset(messages[-1] for messages in sent if messages)

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
        """Leaves ``value`` for whoever takes ``message`` (held back: see ``hold``)."""
        item = (message.stage, message, (value, record_event(stream)))
        if not self._hold:
            self.set(*item)
            return
        held = self._held.__dict__.setdefault("values", [])
        held.append(item)
        if message in self._last:  # this worker sends nothing more: nobody may wait on it
            self._deliver()

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
            if self._hold:
                try:
                    item = inbox.get_nowait()
                except queue.Empty:  # about to wait: what this worker holds goes first
                    self._deliver()
                    item = inbox.get()
            else:
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

    def _deliver(self) -> None:
        """Delivers the values the calling worker holds back, in the order it made them."""
        held = self._held.__dict__.get("values")
        if held:
            for box, key, value in held:
                self.set(box, key, value)
            held.clear()

    def _inbox(self, box: int) -> queue.SimpleQueue[Any]:
        inbox = self._inboxes.get(box)
        if inbox is None:
            with self._lock:
                inbox = self._inboxes.setdefault(box, queue.SimpleQueue())
                if self._aborted:
                    inbox.put(_ABORT)
        return inbox


_ABORT = object()
