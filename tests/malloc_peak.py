"""The most bytes glibc's malloc held at once while a block ran: memory tests on CPU."""

from __future__ import annotations

import ctypes
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


try:
    _mallinfo2 = ctypes.CDLL(None).mallinfo2
    _mallinfo2.restype = _MallInfo2
except (AttributeError, OSError):  # not glibc >= 2.33
    _mallinfo2 = None

AVAILABLE = _mallinfo2 is not None


def malloc_bytes() -> int:
    """Bytes malloc has handed out and not taken back (``mallinfo2``: arenas and mmaps)."""
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


class MallocPeak:
    """``with MallocPeak() as peak: ...``; then ``peak.extra``: the most bytes above the start.

    Sampled every 0.2 ms from a thread: a buffer held for a while is seen, a
    short transient may not be.
    """

    def __enter__(self) -> MallocPeak:
        self.start = self.peak = malloc_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, malloc_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, malloc_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.start
