"""The CPU heap: glibc's adaptive thresholds raised once, so freed memory stays mapped.

Why: glibc gives a freed block above its mmap threshold, or a free heap top above
its trim threshold, back to the system, and the next pass faults it in again. Both
start at 128 KiB and rise only as a program frees larger mmapped blocks, up to 32
MiB (trim: 64). A pipeline's passes free tens of MiB each (B holds the operands W
needs; a checkpointed stage recomputes): docs/guide.md, "CPU memory".

How: a block of just under 32 MiB allocated and freed through torch's allocator,
as any program freeing a tensor that size does; no page is touched. Where the
thresholds are set (``MALLOC_TRIM_THRESHOLD_``, ``mallopt``) this changes nothing.
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
