"""Reproducible dropout under concurrent stage threads: seeds per (call, micro-batch, layer).

Why: torch draws dropout masks from one generator per device, shared by every
thread. With one worker thread per stage, two stages on the CPU draw from it
concurrently, so masks depend on thread timing; worse, activation
checkpointing stashes the generator's state before a stage's forward and
replays it in recomputation, and a concurrent draw in between makes the
recomputed mask differ from the forward's: silently wrong gradients.
torchgpipe avoids the race by running all CPU stages on one thread, giving up
parallelism. We keep the threads and instead give every random module a seed
of its own: each random layer runs under a process-wide lock with its
device's generator seeded from (the call's seed, the micro-batch, the
layer's name in the model), and restored afterwards. Masks then depend on
neither timing, nor balance, nor schedule, and recomputation reproduces
them exactly.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["RANDOM_MODULES", "microbatch_seed", "seed_random_layers"]

RANDOM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.dropout._DropoutNd,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)
"""Modules that draw random numbers in training mode."""

_LOCK = threading.RLock()
_context = threading.local()


@contextmanager
def microbatch_seed(call_seed: int, microbatch: int) -> Iterator[None]:
    """Within this block, random layers in this thread draw for ``(call_seed, microbatch)``."""
    previous = getattr(_context, "key", None)
    _context.key = (call_seed, microbatch)
    try:
        yield
    finally:
        _context.key = previous


def seed_random_layers(model: nn.Module) -> list[Any]:
    """Makes every random layer of ``model`` seed itself when run inside :func:`microbatch_seed`.

    Returns the hook handles (``handle.remove()`` undoes it). Outside a
    ``microbatch_seed`` block, or in eval mode, layers run unchanged.
    """
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, RANDOM_MODULES):
            handles.append(module.register_forward_pre_hook(_Enter(name)))
            handles.append(module.register_forward_hook(_exit, always_call=True))
    return handles


class _Enter:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        key = getattr(_context, "key", None)
        if key is None or not module.training:
            return
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        digest = hashlib.blake2b(repr((*key, self.name)).encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") >> 1
        _LOCK.acquire()
        saved: list[tuple[str, Any]] = [("cpu", torch.get_rng_state())]
        torch.default_generator.manual_seed(seed)
        if device is not None and device.type == "cuda":
            saved.append((str(device), torch.cuda.get_rng_state(device)))
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        module._pipesched_rng = saved  # type: ignore[assignment]


def _exit(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    saved = module.__dict__.pop("_pipesched_rng", None)
    if saved is None:
        return
    for device, state in saved:
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)
    _LOCK.release()
