"""What a stage worker thread inherits from the caller: grad mode, autocast, intra-op threads."""

from __future__ import annotations

import ctypes
import os
from contextlib import ExitStack
from dataclasses import dataclass

import torch

__all__ = ["ThreadState", "current_cpu"]


@dataclass(frozen=True)
class ThreadState:
    """What a worker thread must inherit from the caller: grad mode, autocast, intra-op threads.

    autocast and grad mode are thread-local in torch; torchgpipe's workers
    drop autocast, so its stage outputs come out fp32 under bf16 autocast.
    """

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]
    num_threads: int
    cpu: int | None = None
    """The one CPU every worker runs on (workers taking turns), or None: anywhere.

    Why one CPU for workers that take turns (:mod:`pipesched.runtime.turns`):
    only one runs at a time anyway, and on one CPU the hand-over is a switch
    between threads, not a wake-up of another CPU, and each finds the other's
    tensors in its cache (a 2-stage step of 512 tiny micro-batches: 240 ms on
    two CPUs, 160 ms on one)."""

    @classmethod
    def capture(cls, num_threads: int, cpu: int | None = None) -> ThreadState:
        """The calling thread's state, with ``num_threads`` intra-op threads per worker."""
        autocast = tuple(
            (device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
            for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)
        )
        return cls(
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, num_threads, cpu
        )

    def enter(self, stack: ExitStack) -> None:
        """Applies this state to the current thread until ``stack`` closes."""
        if self.cpu is not None:
            _pin(stack, self.cpu)
        torch.set_num_threads(self.num_threads)
        stack.enter_context(torch.inference_mode(self.inference_mode))
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device, dtype, cache in self.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))


def _pin(stack: ExitStack, cpu: int) -> None:
    """Runs the calling thread on ``cpu`` only, until ``stack`` closes (Linux; else nothing)."""
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
    except (AttributeError, OSError):  # not Linux, or the CPU is not ours: run anywhere
        return
    stack.callback(os.sched_setaffinity, 0, before)


def _libc_sched_getcpu() -> object:
    """glibc's ``sched_getcpu`` (a vDSO read, no system call), or None (not Linux)."""
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError, TypeError):  # TypeError: Windows takes no None
        return None


_sched_getcpu = _libc_sched_getcpu()


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (Linux), or None where that cannot be told."""
    if _sched_getcpu is None:
        return None
    cpu = _sched_getcpu()  # type: ignore[operator]
    return cpu if isinstance(cpu, int) and cpu >= 0 else None
