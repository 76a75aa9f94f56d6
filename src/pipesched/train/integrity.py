"""Content checksums of checkpoints: what loads is what was saved, or it is refused.

Why our own: ``torch.load`` ignores its zips' CRC-32 and DCP keeps none. A BLAKE2b
digest over every tensor's bytes (dtype and shape too) and the canonically pickled
rest is taken at save and checked at load before anything is applied.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import torch

from pipesched.errors import CheckpointError

__all__ = ["CHECKSUM", "digest", "verified"]

CHECKSUM = "checksum"
"""The key of a single-file checkpoint's digest (over every other key)."""


def digest(value: Any) -> str:
    """The BLAKE2b digest of ``value``: its tensors' bytes and its other contents."""
    h = hashlib.blake2b(digest_size=20)
    buffer = io.BytesIO()
    pickler = _Canonical(buffer, h)
    pickler.fast = True  # no memo: the same bytes whether objects were shared or not
    pickler.dump(value)
    h.update(buffer.getvalue())
    return h.hexdigest()


class _Canonical(pickle.Pickler):
    """Pickles with each tensor hashed in place (by dtype, shape and bytes), sets sorted."""

    def __init__(self, file: io.BytesIO, h: Any) -> None:
        super().__init__(file, protocol=4)
        self.h = h
        self.count = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach()
        self.h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel() > 0 and not t.is_meta:
            flat = t.cpu().contiguous().reshape(-1)
            self.h.update(flat.view(torch.uint8).numpy().tobytes())
        self.count += 1
        return ("tensor", self.count)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, set | frozenset):  # iteration order varies with the hash seed
            return type(obj), (sorted(obj, key=repr),)
        return NotImplemented


def verified(state: Any, source: str) -> Any:
    """``state`` without its checksum, once its contents match it; as it is if it has none.

    Args:
        state: what was read (a file's contents, or a state dict).
        source: how messages name it (``checkpoint 'path'``).

    Raises:
        CheckpointError: the contents differ from what was saved.
    """
    if not isinstance(state, dict) or CHECKSUM not in state:
        return state  # written before checksums, or not a checkpoint: checked as it is
    state = dict(state)
    expected = state.pop(CHECKSUM)
    try:
        found = digest(state)
    except Exception as err:  # contents a flipped byte made unpicklable
        found = f"unreadable ({type(err).__name__}: {err})"
    if found != expected:
        raise CheckpointError(
            f"{source} is not what was saved: its content checksum differs (expected "
            f"{expected!r}, found {found!r}): a byte of the file changed after it was "
            "written (disk, copy, transfer). Nothing was loaded or changed; load another "
            "checkpoint, or a good copy of this one"
        )
    return state
