"""Hand-off of activations and gradients between stage workers, abortable so nothing hangs."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

__all__ = ["Aborted", "Mailbox"]


class Aborted(Exception):
    """Raised in a worker waiting on the mailbox after another worker failed."""


class Mailbox:
    """Values keyed by (kind, stage, micro-batch), put by one worker and taken once by another.

    ``take`` blocks until the value is there or :meth:`abort` is called, so a
    failure in any worker releases every other one at once.
    """

    def __init__(self) -> None:
        self._items: dict[Hashable, Any] = {}
        self._ready = threading.Condition()
        self._aborted = False

    def put(self, key: Hashable, value: Any) -> None:
        """Leaves ``value`` for whoever takes ``key``."""
        with self._ready:
            self._items[key] = value
            self._ready.notify_all()

    def take(self, key: Hashable) -> Any:
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

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._aborted

    def abort(self) -> None:
        """Wakes every waiting worker with :class:`Aborted`."""
        with self._ready:
            self._aborted = True
            self._ready.notify_all()
