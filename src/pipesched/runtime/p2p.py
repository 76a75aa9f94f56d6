"""Point-to-point transfers between pipeline ranks, and what every rank learns when one fails.

Each transfer is one message, sent with ``isend`` under a tag naming it
(kind, stage, micro-batch): a header and the tensors' bytes. Sends never
block, so the order of the blocking receives is the schedule's, which
validation proved acyclic: no deadlock for any valid schedule. Tags keep
transfers apart when one pair of ranks exchanges several stage boundaries
(interleaved and V schedules). Shapes and dtypes travel only when they
change (see :class:`Transport`).

A failed wait raises :class:`~pipesched.errors.RemoteError` naming the peer and
why: the failure it reported, or how the wait ended (connection closed: it
died; ran out of time: it is alive but hung); see :mod:`pipesched.runtime.failures`.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import sys
import time
from collections import deque
from collections.abc import Hashable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.failures import FailureChannel

__all__ = ["Transport"]

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

    On gloo over TCP (Linux's default) a receive may take any message up to
    its buffer's size (gloo checks ``length <= nbytes``), and every message's
    header carries its layout anyway. There each channel's receive buffer is
    the largest message seen on it so far, and a notice (a header only) is
    sent only for a message larger than that: micro-batches of varying shapes
    (sequence lengths 37, 512, 129, ...) pay a notice while a step grows the
    high-water mark, then none, and every receive stays posted ahead. The
    price: a receive buffer as large as the channel's largest message (a
    message using less than half of it is copied out, so the activations a
    schedule holds do not pin oversized buffers). NCCL
    and gloo's other transports need exact sizes: there a notice precedes
    every layout change, sized as the receiver expects.

    Args:
        ranks: the global rank of each pp index.
        device: this rank's device (where received tensors land).
        failures: where failures are reported and read.
        group: the process group the transfers use (None: the default one).
    """

    def __init__(
        self,
        ranks: tuple[int, ...],
        device: torch.device,
        failures: FailureChannel,
        group: Any = None,
    ) -> None:
        self.ranks = ranks
        self.device = device
        self.failures = failures
        self.group = group
        self._pending: list[tuple[Any, Any, int]] = []  # (work, buffer kept until sent, dst)
        self._sent: dict[Hashable, tuple[list[int], int]] = {}  # channel -> (layout, size)
        self._expected: dict[Hashable, tuple[list[int], int]] = {}
        self._planned: dict[Hashable, deque[tuple[int, int]]] = {}  # channel -> (src, tag)s
        self._posted: dict[tuple[Hashable, int], tuple[Any, torch.Tensor]] = {}
        self.notices = 0  # notices sent so far (tests and benchmarks count them)
        self.unplanned = 0  # receives that plan() did not announce (tests count them)
        # NCCL ignores tags and runs a pair's sends and receives on one stream in issue
        # order: a receive posted ahead of this rank's own sends to that peer would wait
        # for a message that waits behind it. Only gloo, which matches by tag, posts ahead.
        self._post_ahead = dist.is_initialized() and dist.get_backend(group) == "gloo"
        # gloo's TCP transport (not uv, Windows' and macOS's) reads a message into any
        # larger posted buffer: see the class docstring.
        self._roomy = self._post_ahead and _tcp_transport()

    def send(self, value: Any, dst: int, channel: Hashable, tag: int, what: str = "") -> None:
        """Starts sending ``value`` to pp rank ``dst`` on ``channel`` under ``tag``.

        ``what``: whose value it is, for errors ("stage 0").
        """
        layout, tensors = _layout(value, what)
        message = _pack(layout, tensors, self.device)
        last_layout, expected_size = self._sent.get(channel, ([], _HEADER_BYTES))
        doing = f"sending {what or 'a stage'}'s value to it"
        size = message.numel()
        if self._roomy and size <= expected_size:
            size = expected_size  # the receiver's buffer: large enough, layout in the header
        elif layout != last_layout or self._roomy:
            if self._roomy:
                notice = _header_bytes([_NOTICE, *layout], self.device)
            else:
                notice = torch.zeros(expected_size, dtype=torch.uint8, device=self.device)
                notice[:_HEADER_BYTES] = _header_bytes([_NOTICE, *layout], self.device)
            self._isend(notice, dst, tag, doing)
            self.notices += 1
        self._isend(message, dst, tag, doing)
        self._sent[channel] = (layout, size)

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
            with self._peer(src, f"waiting for {what}"):
                work.wait()
        header = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
        if header[0] == _NOTICE:
            layout = _trim(header[1:])
            size = _HEADER_BYTES + _payload_bytes(layout)
            buffer = self._irecv(size, src, tag, what)
            self._expected[channel] = (layout, size)
        elif self._roomy:  # a message no larger than the buffer: its header says its layout
            layout = _trim(header[1:])
            used = _HEADER_BYTES + _payload_bytes(layout)
            if buffer.numel() > 2 * used:  # values a step keeps must not pin a buffer 2x+ too big
                buffer = buffer[:used].clone()
        self._post_next(channel)
        return _unpack(layout, buffer)

    def _post_next(self, channel: Hashable) -> None:
        queue = self._planned.get(channel)
        if not queue:
            return
        src, tag = queue.popleft()
        _, size = self._expected.get(channel, ([], _HEADER_BYTES))
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        with self._peer(src, "posting a receive from it"):
            work = dist.irecv(buffer, src=self.ranks[src], group=self.group, tag=tag)
        self._posted[channel, tag] = (work, buffer)

    def finish(self) -> None:
        """Waits for every send of this step to complete."""
        pending, self._pending = self._pending, []
        for work, _, dst in pending:
            with self._peer(dst, "finishing this step's sends to it"):
                work.wait()

    def drop(self) -> None:
        """Forgets every pending transfer and the group (after a failure, before it closes)."""
        self._pending.clear()
        self._posted.clear()
        self._planned.clear()
        self.group = None

    def _isend(self, buffer: torch.Tensor, dst: int, tag: int, what: str) -> None:
        with self._peer(dst, what):
            work = dist.isend(buffer, dst=self.ranks[dst], group=self.group, tag=tag)
        self._pending.append((work, buffer, dst))

    def _irecv(self, size: int, src: int, tag: int, what: str) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        with self._peer(src, f"waiting for {what}"):
            work = dist.irecv(buffer, src=self.ranks[src], group=self.group, tag=tag)
            if work is not None:
                work.wait()
        return buffer

    @contextlib.contextmanager
    def _peer(self, peer: int, doing: str) -> Iterator[None]:
        """Turns a failed transfer with pp rank ``peer`` into the RemoteError that explains it.

        ``doing``: what this rank was doing, in words ("waiting for ...").

        The error reported first by any rank wins; with none, the peer is named
        from how the wait ended (see :meth:`FailureChannel.lost`).
        """
        start = time.monotonic()
        try:
            yield
        except Exception as error:
            failure = self.failures.first()
            if failure is None:  # nobody reported: name the peer from how the wait ended
                waited = time.monotonic() - start
                failure = self.failures.lost(error, waited, doing, peer, self.ranks[peer])
                self.failures.report(failure)
            raise failure.error() from error


_NOTICE, _DATA = 1, 0
_HEADER_BYTES = _HEADER * 8


_NONE, _INT, _FLOAT, _BOOL = -1, -2, -3, -4
"""Item codes of values that are not tensors (a tensor's item starts with its dtype index)."""

Spec = tuple[torch.dtype, list[int]] | tuple[None, Any]
"""A tensor's (dtype, shape), or (None, the value) for None and Python scalars."""


CROSSES = (
    "between ranks a stage must return a tensor, or a tuple or list whose items are each a "
    "tensor, None, an int, a float or a bool; a bare None, int, float or bool, a dict, a "
    "string or a nested container cannot cross"
)
"""What may cross ranks, said once: every refusal quotes it."""


def _layout(value: Any, what: str = "") -> tuple[list[int], list[torch.Tensor]]:
    """``[kind, count, per item: dtype, ndim, *shape | code[, bits]]`` and the tensors.

    Items are tensors, None, or Python ints, floats and bools (a traced
    model's stages pass sizes along): those travel in the layout itself.
    ``what`` names the value in errors ("stage 0's output").

    Raises:
        ConfigTypeError: ``value`` cannot cross (see ``CROSSES``).
        ConfigError: it holds more values than a header fits.
    """
    items = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(value, torch.Tensor | tuple | list) or not all(
        v is None or isinstance(v, torch.Tensor | int | float) for v in items
    ):
        if isinstance(value, tuple | list):
            kinds = ", ".join(sorted({type(v).__name__ for v in items}))
            seen = f"a {type(value).__name__} holding {kinds}"
        else:
            seen = "None" if value is None else f"a bare {type(value).__name__}"
        fix = (
            "return tensors from the last layer before the cut (wrap a None or a number "
            "in a tuple: `return (x, None)`), or move the cut so this value stays on one rank"
        )
        raise ConfigTypeError(
            f"{what or 'a stage'} returned {seen}, which cannot cross to another rank: "
            f"{CROSSES}. Fix: {fix}"
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


def _tcp_transport() -> bool:
    """Whether gloo uses its TCP transport (Linux's default; uv elsewhere)."""
    transport = os.environ.get("GLOO_DEVICE_TRANSPORT", "TCP").upper()
    return sys.platform.startswith("linux") and transport == "TCP"


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
