"""The local runtime's worker threads, kept from one step to the next.

Why kept: starting a thread waits until it runs, a noticeable share of a short step.
A kept thread waits on its own queue, named ``pipesched-worker-<w>`` only while it
runs a step's actions; the threads are daemons that end with their owner.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

__all__ = ["WorkerThreads"]

Job = Callable[[], None]
"""A worker's actions of one step; it catches what they raise."""

_IDLE = "pipesched-idle"


class WorkerThreads:
    """Runs jobs each in a thread of its own, the threads kept for the next call.

    A job given to a thread still running an earlier one waits for it (a
    step that returned on a second Ctrl-C, its workers still stopping).
    """

    def __init__(self) -> None:
        self._inboxes: list[queue.SimpleQueue[_Task | None]] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()
        weakref.finalize(self, _stop, self._inboxes)

    def start(self, jobs: Sequence[tuple[str, Job]]) -> list[threading.Event]:
        """Starts each ``(name, job)``; returns an event per job, set once it has returned."""
        done = [threading.Event() for _ in jobs]
        # One caller at a time: two steps' jobs queued in the same order on every thread.
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's threads are not here
                self._inboxes.clear()
                self._pid = os.getpid()
            while len(self._inboxes) < len(jobs):
                inbox: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(inbox,), name=_IDLE, daemon=True).start()
                self._inboxes.append(inbox)
            for inbox, (name, job), event in zip(self._inboxes, jobs, done, strict=False):
                inbox.put((name, job, event))
        return done


_Task = tuple[str, Job, threading.Event]


def _serve(inbox: queue.SimpleQueue[_Task | None]) -> None:
    """A kept thread: runs the jobs it is given, one by one, until told to stop (None)."""
    me = threading.current_thread()
    while True:
        task = inbox.get()
        if task is None:
            return
        name, job, done = task
        del task
        me.name = name
        try:
            job()
        except BaseException:  # reported, as for a thread of its own
            threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), me)))
        finally:
            me.name = _IDLE  # before done: a caller that sees done sees no worker
            del job  # nothing of the step stays alive with the thread
            done.set()


def _stop(inboxes: list[queue.SimpleQueue[_Task | None]]) -> None:
    for inbox in inboxes:
        inbox.put(None)
