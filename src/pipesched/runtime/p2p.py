"""Point-to-point transfers between pipeline ranks, and what every rank learns when one fails.

Each transfer is one message, sent with ``isend`` under a tag naming it
(kind, stage, micro-batch): a header and the tensors' bytes. Sends never
block, so the order of the blocking receives is the schedule's, which
validation proved acyclic: no deadlock for any valid schedule. Tags keep
transfers apart when one pair of ranks exchanges several stage boundaries
(interleaved and V schedules). Shapes and dtypes travel only when they
change (see :class:`Transport`).

Why a failure channel: gloo cannot poll a pending receive (its wait with a
timeout closes the connection), so a rank blocked in a receive learns about
a failure only when its peer's connection closes. A failing rank therefore
writes its error to the job's TCP store first, then closes its connections;
every rank then fails in turn, reads the first error from the store, and
raises it (a killed rank writes nothing: its neighbours say they lost it).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
from collections import deque
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipesched.errors import ConfigError, ConfigTypeError, RemoteError

__all__ = ["FailureChannel", "Transport"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_HEADER = 64


class FailureChannel:
    """The first failure of the job, shared through torchrun's TCP store."""

    KEY = "pipesched/failure"

    def __init__(self) -> None:
        self._store: Any = None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port:
            try:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), is_master=False, timeout=timedelta(seconds=10)
                )
            except Exception:  # no store: failures still end the job, less explained
                self._store = None

    def report(self, message: str) -> None:
        """Records ``message`` unless an earlier failure was recorded."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.compare_set(self.KEY, "", message)

    def first(self, wait: float = 2.0) -> str | None:
        """The first recorded failure, waiting up to ``wait`` seconds for one to appear."""
        if self._store is None:
            return None
        deadline = time.monotonic() + wait
        try:
            while True:
                if self._store.check([self.KEY]):
                    return bytes(self._store.get(self.KEY)).decode()
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        except Exception:  # the store's host (rank 0) is gone too
            return None


class Transport:
    """Sends and receives tensors, tuples and lists of tensors between the ranks of one pipeline.

    Each transfer is ONE message: a 512-byte header (structure, dtypes,
    shapes) followed by every tensor's bytes, 8-byte aligned. Layouts are
    tracked per channel (a kind and a receiving stage): while a channel's
    layout does not change the receiver knows the message's size in advance;
    when it changes (the first transfer, a short micro-batch, a new sequence
    length) the sender first sends a notice, sized as the receiver expects,
    carrying the new layout. Both sides walk each channel's transfers in the
    same order (every stage runs its micro-batches' F, and its B, in
    increasing order; the runtime checks it), so their views of the layout
    agree.

    Args:
        ranks: the global rank of each pp index.
        device: this rank's device (where received tensors land).
        failures: where failures are reported and read.
    """

    def __init__(
        self, ranks: tuple[int, ...], device: torch.device, failures: FailureChannel
    ) -> None:
        self.ranks = ranks
        self.device = device
        self.failures = failures
        self._pending: list[tuple[Any, Any]] = []  # (work, buffer kept alive until sent)
        self._sent: dict[Hashable, tuple[list[int], int]] = {}  # channel -> (layout, size)
        self._expected: dict[Hashable, tuple[list[int], int]] = {}
        self._planned: dict[Hashable, deque[tuple[int, int]]] = {}  # channel -> (src, tag)s
        self._posted: dict[tuple[Hashable, int], tuple[Any, torch.Tensor]] = {}
        self.notices = 0  # layout changes sent so far (tests count them)
        self.unplanned = 0  # receives that plan() did not announce (tests count them)
        # NCCL ignores tags and runs a pair's sends and receives on one stream in issue
        # order: a receive posted ahead of this rank's own sends to that peer would wait
        # for a message that waits behind it. Only gloo, which matches by tag, posts ahead.
        self._post_ahead = dist.is_initialized() and dist.get_backend() == "gloo"

    def send(self, value: Any, dst: int, channel: Hashable, tag: int) -> None:
        """Starts sending ``value`` to pp rank ``dst`` on ``channel`` under ``tag``."""
        layout, tensors = _layout(value)
        message = _pack(layout, tensors, self.device)
        last_layout, expected_size = self._sent.get(channel, ([], _HEADER_BYTES))
        if layout != last_layout:
            notice = torch.zeros(expected_size, dtype=torch.uint8, device=self.device)
            notice[:_HEADER_BYTES] = _header_bytes([_NOTICE, *layout], self.device)
            self._isend(notice, dst, tag)
            self.notices += 1
        self._isend(message, dst, tag)
        self._sent[channel] = (layout, message.numel())

    def plan(self, receives: dict[Hashable, list[tuple[int, int]]]) -> None:
        """Announces a step's receives, per channel in order, and posts each channel's first.

        A channel's next receive is posted as soon as the one before it is
        read, when its size is known: one receive ahead per channel. On gloo
        only (see ``__init__``); elsewhere each receive is posted when taken.

        Args:
            receives: per channel, the ``(source pp rank, tag)`` of each transfer.
        """
        if not self._post_ahead:
            return
        self._planned = {channel: deque(queue) for channel, queue in receives.items()}
        for channel in self._planned:
            self._post_next(channel)

    def recv(self, src: int, channel: Hashable, tag: int, what: str) -> Any:
        """Receives what pp rank ``src`` sent on ``channel`` under ``tag`` (``what``: in errors)."""
        layout, size = self._expected.get(channel, ([], _HEADER_BYTES))
        posted = self._posted.pop((channel, tag), None)
        if posted is None:  # not announced by plan()
            self.unplanned += 1
            buffer = self._irecv(size, src, tag, what)
        else:
            work, buffer = posted
            self._wait(work, src, what)
        header = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
        if header[0] == _NOTICE:
            layout = _trim(header[1:])
            size = _HEADER_BYTES + _payload_bytes(layout)
            buffer = self._irecv(size, src, tag, what)
            self._expected[channel] = (layout, size)
        self._post_next(channel)
        return _unpack(layout, buffer)

    def _post_next(self, channel: Hashable) -> None:
        queue = self._planned.get(channel)
        if not queue:
            return
        src, tag = queue.popleft()
        _, size = self._expected.get(channel, ([], _HEADER_BYTES))
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._posted[channel, tag] = (dist.irecv(buffer, src=self.ranks[src], tag=tag), buffer)

    def finish(self) -> None:
        """Waits for every send of this step to complete."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def _isend(self, buffer: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(buffer, dst=self.ranks[dst], tag=tag), buffer))

    def _irecv(self, size: int, src: int, tag: int, what: str) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(buffer, src=self.ranks[src], tag=tag), src, what)
        return buffer

    def _wait(self, work: Any, src: int, what: str) -> None:
        try:
            work.wait()
        except Exception as error:
            reason = self.failures.first()
            if reason is None:
                reason = (
                    f"lost pp rank {src} (global rank {self.ranks[src]}) while waiting for "
                    f"{what}: its connection closed without an error report, so the process "
                    "probably died (killed, or out of memory)"
                )
                self.failures.report(reason)
            raise RemoteError(f"pipesched: stopping: {reason}") from error


_NOTICE, _DATA = 1, 0
_HEADER_BYTES = _HEADER * 8


_NONE, _INT, _FLOAT, _BOOL = -1, -2, -3, -4
"""Item codes of values that are not tensors (a tensor's item starts with its dtype index)."""

Spec = tuple[torch.dtype, list[int]] | tuple[None, Any]
"""A tensor's (dtype, shape), or (None, the value) for None and Python scalars."""


def _layout(value: Any) -> tuple[list[int], list[torch.Tensor]]:
    """``[kind, count, per item: dtype, ndim, *shape | code[, bits]]`` and the tensors.

    Items are tensors, None, or Python ints, floats and bools (a traced
    model's stages pass sizes along): those travel in the layout itself.
    """
    items = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(value, torch.Tensor | tuple | list) or not all(
        v is None or isinstance(v, torch.Tensor | int | float) for v in items
    ):
        kinds = sorted({type(v).__name__ for v in items}) if isinstance(value, tuple | list) else []
        raise ConfigTypeError(
            "between ranks a stage may pass a tensor or a tuple/list of tensors (and None, "
            f"int, float, bool), got {type(value).__name__}{kinds or ''}; return tensors "
            "only from stages that end on another rank"
        )
    kind = 0 if isinstance(value, torch.Tensor) else 1 if isinstance(value, tuple) else 2
    layout = [kind, len(items)]
    tensors = []
    for t in items:
        if isinstance(t, torch.Tensor):
            layout += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            tensors.append(t.detach())
        elif t is None:
            layout.append(_NONE)
        elif isinstance(t, bool):
            layout += [_BOOL, int(t)]
        elif isinstance(t, int):
            layout += [_INT, t]
        else:
            layout += [_FLOAT, struct.unpack("<q", struct.pack("<d", t))[0]]
    if len(layout) + 1 > _HEADER:
        raise ConfigError(
            f"a stage boundary passes {len(items)} values with {len(layout)} header entries; "
            f"at most {_HEADER - 1} fit: pass fewer tensors (e.g. concatenate them)"
        )
    return layout, tensors


def _specs(layout: list[int]) -> tuple[int, list[Spec], int]:
    """The kind, each item's spec, and the layout's length."""
    kind, count, i = layout[0], layout[1], 2
    specs: list[Spec] = []
    for _ in range(count):
        code = layout[i]
        if code == _NONE:
            specs.append((None, None))
            i += 1
        elif code < 0:
            raw = layout[i + 1]
            scalar = (
                bool(raw)
                if code == _BOOL
                else raw
                if code == _INT
                else struct.unpack("<d", struct.pack("<q", raw))[0]
            )
            specs.append((None, scalar))
            i += 2
        else:
            ndim = layout[i + 1]
            specs.append((_DTYPES[code], layout[i + 2 : i + 2 + ndim]))
            i += 2 + ndim
    return kind, specs, i


def _trim(header: list[int]) -> list[int]:
    """The layout at the start of a zero-padded header."""
    return header[: _specs(header)[2]]


def _aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def _payload_bytes(layout: list[int]) -> int:
    _, specs, _ = _specs(layout)
    return sum(
        _aligned(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        for dtype, shape in specs
        if dtype is not None
    )


def _header_bytes(values: list[int], device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header.view(torch.uint8).to(device)


def _pack(layout: list[int], tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    parts = [_header_bytes([_DATA, *layout], device)]
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8).to(device)
        parts.append(raw)
        if raw.numel() % 8:
            parts.append(torch.zeros(8 - raw.numel() % 8, dtype=torch.uint8, device=device))
    return torch.cat(parts)


def _unpack(layout: list[int], buffer: torch.Tensor) -> Any:
    kind, specs, _ = _specs(layout)
    values: list[Any] = []
    offset = _HEADER_BYTES
    for dtype, shape in specs:
        if dtype is None:
            values.append(shape)  # None or a Python scalar
            continue
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        values.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    if kind == 0:
        return values[0]
    return tuple(values) if kind == 1 else list(values)
