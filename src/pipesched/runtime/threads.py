"""What a stage worker thread inherits from the caller: grad mode, autocast, intra-op threads."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

__all__ = ["ThreadState"]


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

    @classmethod
    def capture(cls, num_threads: int) -> ThreadState:
        """The calling thread's state, with ``num_threads`` intra-op threads per worker."""
        autocast = tuple(
            (device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
            for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)
        )
        return cls(
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, num_threads
        )

    def enter(self, stack: ExitStack) -> None:
        """Applies this state to the current thread until ``stack`` closes."""
        torch.set_num_threads(self.num_threads)
        stack.enter_context(torch.inference_mode(self.inference_mode))
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device, dtype, cache in self.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
