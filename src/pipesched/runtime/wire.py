"""The bytes of one transfer between ranks: a 512-byte header, then every tensor's bytes.

The header is 64 int64 words: a code (data or notice), the identity of the
value (kind, stage, micro-batch: what the receiver checks it got), and the
layout (structure, dtypes, shapes, Python scalars). Tensors follow, each
8-byte aligned. A notice is a header alone, announcing the layout of the
message that follows it; it may be padded to the size the receiver expects.
"""

from __future__ import annotations

import ctypes
import math
import struct
from typing import Any

import torch

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule import BACKWARD, FORWARD
from pipesched.schedule.dataflow import Message

__all__ = [
    "CROSSES",
    "DATA",
    "HEADER_BYTES",
    "NOTICE",
    "Header",
    "layout_of",
    "message_bytes",
    "pack",
    "read_header",
    "unpack",
]

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
_WORDS = 64
_FIXED = 4  # code, kind, stage, micro-batch
HEADER_BYTES = _WORDS * 8
_HEADER = struct.Struct(f"<{_WORDS}q")
_ZEROS = (0,) * _WORDS
DATA, NOTICE = 0, 1

_NONE, _INT, _FLOAT, _BOOL = -1, -2, -3, -4
"""Item codes of values that are not tensors (a tensor's item starts with its dtype index)."""

Spec = tuple[torch.dtype, list[int]] | tuple[None, Any]
"""A tensor's (dtype, shape), or (None, the value) for None and Python scalars."""

Header = tuple[int, Message, list[int]]
"""A header read back: (code, the value's identity, its layout)."""

CROSSES = (
    "between ranks a stage must return a tensor, or a tuple or list whose items are each a "
    "tensor, None, an int, a float or a bool; a bare None, int, float or bool, a dict, a "
    "string or a nested container cannot cross"
)
"""What may cross ranks, said once: every refusal quotes it."""


def layout_of(value: Any, what: str = "") -> tuple[list[int], list[torch.Tensor]]:
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
    if len(layout) + _FIXED > _WORDS:
        raise ConfigError(
            f"a stage boundary passes {len(items)} values with {len(layout)} header entries; "
            f"at most {_WORDS - _FIXED} fit: pass fewer tensors (e.g. concatenate them)"
        )
    return layout, tensors


def message_bytes(layout: list[int]) -> int:
    """The size of a data message of ``layout``: header and payload."""
    return _parsed(tuple(layout))[2]


def pack(
    code: int,
    message: Message,
    layout: list[int],
    tensors: list[torch.Tensor],
    device: torch.device,
    size: int = 0,
) -> torch.Tensor:
    """One message: the header, the tensors' bytes, zeros up to ``size`` bytes if larger."""
    words = [code, int(message.kind == BACKWARD), message.stage, message.microbatch, *layout]
    header = _HEADER.pack(*words, *_ZEROS[len(words) :])  # 10x cheaper than a tensor
    if device.type == "cpu" and all(t.device.type == "cpu" for t in tensors):
        # One buffer, filled by memmove from the tensors' own memory: a few us a
        # message less than cat(), and no byte views made of each tensor.
        tensors = [_plain(t) for t in tensors]
        sizes = [t.numel() * t.element_size() for t in tensors]
        used = HEADER_BYTES + sum(map(_aligned, sizes))
        out = torch.empty(max(size, used), dtype=torch.uint8)
        base = out.data_ptr()
        ctypes.memmove(base, header, HEADER_BYTES)
        offset = HEADER_BYTES
        for t, nbytes in zip(tensors, sizes, strict=True):
            ctypes.memmove(base + offset, t.data_ptr(), nbytes)
            offset += nbytes
            if offset % 8:
                ctypes.memset(base + offset, 0, 8 - offset % 8)
                offset = _aligned(offset)
        if out.numel() > offset:
            out[offset:].zero_()
        return out
    raws = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    used = HEADER_BYTES + sum(_aligned(r.numel()) for r in raws)
    parts = [torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)]
    for raw in raws:
        parts.append(raw.to(device))
        if raw.numel() % 8:
            parts.append(torch.zeros(8 - raw.numel() % 8, dtype=torch.uint8, device=device))
    if size > used:
        parts.append(torch.zeros(size - used, dtype=torch.uint8, device=device))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def read_header(buffer: torch.Tensor) -> Header:
    """The code, identity and layout at the start of a received ``buffer``."""
    head = buffer
    if head.device.type != "cpu" or not head.is_contiguous():
        head = buffer[:HEADER_BYTES].cpu().contiguous()
    # The header's bytes straight from memory: a few times cheaper than .tolist().
    words = _HEADER.unpack(ctypes.string_at(head.data_ptr(), HEADER_BYTES))
    code, backward, stage, microbatch = words[:_FIXED]
    message = Message(BACKWARD if backward else FORWARD, stage, microbatch)
    return code, message, list(_parsed(words[_FIXED:])[3])


def unpack(layout: list[int], buffer: torch.Tensor) -> Any:
    """The value a message of ``layout`` carries: tensors are views of ``buffer``."""
    kind, specs = _parsed(tuple(layout))[:2]
    values: list[Any] = []
    offset = HEADER_BYTES
    for dtype, shape in specs:
        if dtype is None:
            values.append(shape)  # None or a Python scalar
            continue
        nbytes = math.prod(shape) * dtype.itemsize
        values.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    if kind == 0:
        return values[0]
    return tuple(values) if kind == 1 else list(values)


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


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values in its own memory, in order (a lazy conjugate or negation resolved)."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _parsed(words: tuple[int, ...]) -> tuple[int, list[Spec], int, list[int]]:
    """The kind, specs, message size and layout of a layout's words (trailing zeros allowed).

    Why cached: a channel's messages mostly share one layout, and parsing it
    (at both ends, twice at the receiver) cost several us a message.
    """
    parsed = _PARSED.get(words)
    if parsed is None:
        kind, specs, length = _specs(list(words))
        payload = [math.prod(shape) * dtype.itemsize for dtype, shape in specs if dtype is not None]
        size = HEADER_BYTES + sum(map(_aligned, payload))
        parsed = (kind, specs, size, list(words[:length]))
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[words] = parsed
    return parsed


_PARSED: dict[tuple[int, ...], tuple[int, list[Spec], int, list[int]]] = {}
_PARSED_MAX = 4096  # layouts kept (varying shapes: one per shape seen)


def _aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8
