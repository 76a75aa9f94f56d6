"""CUDA streams and events for the stage workers, with a CPU stand-in so every path runs on CPU.

On CUDA each stage computes on its own stream and tensors cross to the next
device on a copy stream; events order the two, and ``record_stream`` tells
the caching allocator that a tensor made on one stream is used on another.
On CPU every function here is a no-op over the same calls, so the runtime
has a single code path (torchgpipe's ``stream.py`` idea).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

__all__ = [
    "Stream",
    "copy_to",
    "join_stream",
    "new_stream",
    "record_event",
    "use_stream",
    "wait_event",
]

Stream = Any  # a torch.cuda.Stream, or None standing in for the CPU's one sequential stream


def new_stream(device: torch.device) -> Stream:
    """A new stream on ``device``; None on CPU."""
    if device.type == "cuda":
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return None


@contextmanager
def use_stream(stream: Stream) -> Iterator[None]:
    """Makes ``stream`` current in this thread (nothing on CPU)."""
    if stream is None:
        with nullcontext():
            yield
    else:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield


def record_event(stream: Stream) -> Any:
    """An event marking the work queued on ``stream`` so far; None on CPU."""
    if stream is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def wait_event(stream: Stream, event: Any) -> None:
    """Makes ``stream`` wait for ``event`` (nothing on CPU or without an event)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def join_stream(stream: Stream) -> None:
    """Makes the calling thread's current stream on ``stream``'s device wait for all work
    queued on ``stream`` so far, without blocking the host (nothing on CPU)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def copy_to(tensor: torch.Tensor, device: torch.device, stream: Stream) -> torch.Tensor:
    """``tensor`` on ``device``, copied on ``stream``; the tensor itself when already there.

    Where a copy is made on CUDA, the source is marked as used by ``stream``
    so the allocator does not reuse its memory before the copy has run.
    """
    if tensor.device == device:
        return tensor
    if stream is None:
        return tensor.to(device)
    with use_stream(stream):
        copied = tensor.to(device, non_blocking=True)
    if tensor.is_cuda:
        tensor.record_stream(stream)
    return copied
