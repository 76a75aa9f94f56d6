"""The CPU heap: glibc's adaptive thresholds raised once, so memory a step frees stays mapped.

Why: glibc unmaps a freed block above its mmap threshold and gives a free heap top
above its trim threshold back to the system, so the next pass faults those pages
in again (zero-filled by the kernel, a few microseconds each). Both thresholds
start low (128 KiB) and rise only when a program frees an mmapped block larger
than the current threshold, up to 32 MiB (trim: twice that). A pipeline's passes
allocate and free tens of MiB each: a split backward's B holds each deferred
op's operands until its W, and a checkpointed stage recomputes its activations
in every backward. On 4 Transformer encoder layers with dropout 0.1, B faulted
about 2,500 pages per micro-batch, and B + W went from 1.08x a whole backward to
1.02x with the thresholds raised (docs/guide.md, "CPU memory").

How: one block of just under 32 MiB allocated and freed through torch's CPU
allocator, which is what glibc adapts to when any program frees a tensor that
size; nothing is written (no page is touched) and nothing else changes.
glibc's own adaptation stays in charge: freed memory beyond 64 MiB still goes
back. Where the thresholds are set (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``mallopt``) glibc does not adapt, so this does
nothing; elsewhere than glibc it allocates and frees one block.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_BYTES", "keep_freed_memory"]

BLOCK_BYTES = (32 << 20) - (64 << 10)
"""The block: under glibc's ceiling for the adaptive mmap threshold (32 MiB on 64-bit),
less room for the chunk's header and alignment."""

_kept = False


def keep_freed_memory() -> None:
    """Raises glibc's adaptive mmap and trim thresholds to their ceilings; once a process.

    Called when a pipeline with a CPU worker is built.
    """
    global _kept
    if _kept:
        return
    _kept = True
    torch.empty(BLOCK_BYTES, dtype=torch.uint8, device="cpu")  # freed at once
