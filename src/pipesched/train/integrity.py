"""Checksums of checkpoints: what loads is what was saved, or it is refused.

Why our own: ``torch.load`` ignores its zips' CRC-32 and DCP keeps none. First
the files' bytes, before anything is unpickled (a flipped pickle byte can make
the unpickler allocate tens of GB): a single file's zip records against the
CRC-32 torch writes, a sharded version's files against those each rank records
in ``.crc32-{rank}.json``. Then the contents: a BLAKE2b digest over every
tensor's bytes (dtype and shape too) and the canonically pickled rest, taken at
save and checked before anything is applied; it also covers files with no CRC.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import torch

from pipesched.errors import CheckpointError

__all__ = [
    "CHECKSUM",
    "Span",
    "check",
    "checked_zip",
    "digest",
    "record",
    "verified",
]

CHECKSUM = "checksum"
"""The key of a single-file checkpoint's digest (over every other key)."""

_NOTHING = "Nothing was loaded or changed; load another checkpoint, or a good copy of this one"


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
        raise _changed(
            source, f"its content checksum differs (expected {expected!r}, found {found!r})"
        )
    return state


_ZIP_MAGIC = b"PK\x03\x04"
# torch's legacy (pre-zip) format opens with a pickle of this number: binary from
# protocol 2 on (after a frame header from 4 on), its decimal text in protocols 0 and 1.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_HEADS = (b"\x8a\x0a" + _LEGACY_MAGIC.to_bytes(10, "little"), b"L%dL" % _LEGACY_MAGIC)
_SUMS = ".crc32-"  # + rank + ".json": the CRC-32 of a sharded version's bytes
_CHUNK = 1 << 20

Span = tuple[str, int, int]
"""Bytes of a file of a sharded checkpoint: (file name, offset, length)."""


@contextmanager
def checked_zip(path: str) -> Iterator[str]:
    """Opens ``path``, checks it (:func:`_check_zip`), and yields a name of that open file.

    Why: ``torch.load`` opens a file by name, so a file replaced between the
    check and the load (another process saving to it) would load unchecked.
    The name yielded is ``/proc/self/fd/N``, the open file itself, where the
    system has it; else ``path``.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: as :func:`_check_zip`.
    """
    with open(path, "rb") as f:  # FileNotFoundError, IsADirectoryError: the caller's
        _check_zip(f, path)
        opened = f"/proc/self/fd/{f.fileno()}"
        yield opened if os.path.exists(opened) else path


def _check_zip(f: BinaryIO, path: str) -> None:
    """Refuses a ``torch.save`` file (``f``, open, named ``path``) whose zip records changed.

    Reads each record once, in 1 MiB pieces, against its CRC-32, without
    unpickling anything. A file in torch's legacy (pre-zip) format, or saved
    without CRCs (``torch.serialization.set_crc32_options(False)``: every
    record's is 0), has nothing to check here: it is unpickled unchecked, and
    only its contents are checked (after). Anything else is refused unread.

    Raises:
        CheckpointError: a record's bytes differ from its CRC-32, the zip's
            first bytes or directory are damaged, or the file is no
            ``torch.save`` file.
    """
    head = f.read(40)
    if head[:1] in (b"\x80", b"L") and any(h in head for h in _LEGACY_HEADS):
        return  # torch's legacy format
    if head[:4] != _ZIP_MAGIC and not zipfile.is_zipfile(f):
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: it is empty or not a file written by "
            f"torch.save (it opens with {head[:8]!r}); load another checkpoint"
        )
    try:
        z = zipfile.ZipFile(f)
    except Exception as err:  # BadZipFile: no directory where a zip keeps it
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read ({type(err).__name__}: {err}): it is "
            "truncated, or its zip directory is damaged; load another checkpoint"
        ) from err
    with z:
        if head[:4] != _ZIP_MAGIC:  # a zip, but torch.load would read it as the legacy one
            raise _changed(f"checkpoint {path!r}", "its first bytes")
        infos = z.infolist()
        if not any(info.CRC for info in infos):
            return
        for info in infos:
            try:
                with z.open(info) as r:  # raises at the end when the CRC-32 differs
                    while r.read(_CHUNK):
                        pass
            except Exception as err:  # BadZipFile, EOFError, NotImplementedError (method)...
                raise _changed(
                    f"checkpoint {path!r}",
                    f"its zip record {info.filename!r} ({type(err).__name__}: {err})",
                ) from err


def record(directory: str, rank: int, whole: list[str], spans: list[Span]) -> None:
    """Writes ``.crc32-{rank}.json``: the CRC-32 of the files ``whole`` and of ``spans``."""
    sums = {name: _crc32(os.path.join(directory, name)) for name in whole}
    sums.update({_key(span): _crc32(os.path.join(directory, span[0]), *span[1:]) for span in spans})
    with open(os.path.join(directory, f"{_SUMS}{rank}.json"), "w") as f:
        json.dump(sums, f)
        f.flush()
        os.fsync(f.fileno())


def check(directory: str, whole: list[str], spans: list[Span]) -> None:
    """Refuses when a file of ``whole``, or a span, differs from its recorded CRC-32.

    Only the bytes named are read. A directory with no records (saved before
    they were, or by torch's own tools) is read unchecked.

    Raises:
        CheckpointError: bytes differ from their record, a record cannot be
            read, or bytes have no record while others do.
    """
    source = f"checkpoint {directory!r}"
    recorded: dict[str, int] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith(_SUMS):
            try:
                with open(os.path.join(directory, name)) as f:
                    recorded.update({str(k): int(v) for k, v in json.load(f).items()})
            except (ValueError, TypeError, AttributeError, OSError) as err:
                raise CheckpointError(
                    f"{source} cannot be checked: its checksum record {name!r} cannot be "
                    f"read ({type(err).__name__}: {err}); it was changed or cut short. {_NOTHING}"
                ) from err
    if not recorded:
        return
    wanted = [(name, _crc32(os.path.join(directory, name)), name) for name in whole]
    wanted += [(_key(s), _crc32(os.path.join(directory, s[0]), *s[1:]), s[0]) for s in spans]
    for key, found, name in wanted:
        if key not in recorded:
            raise CheckpointError(
                f"{source} cannot be checked: no checksum is recorded for {key!r} (a record "
                f"file was removed, or a tool other than pipesched rewrote {name!r}). {_NOTHING}"
            )
        if found != recorded[key]:
            raise _changed(
                source,
                f"the file {name!r} (bytes {key!r}: CRC-32 {found:#010x}, recorded "
                f"{recorded[key]:#010x}; the file, or its record, changed)",
            )


def _key(span: Span) -> str:
    name, offset, length = span
    return f"{name}@{offset}+{length}"


def _crc32(path: str, offset: int = 0, length: int = -1) -> int:
    """The CRC-32 of ``length`` bytes of ``path`` from ``offset`` (-1: to its end)."""
    crc, left = 0, length
    with open(path, "rb") as f:
        f.seek(offset)
        while left and (chunk := f.read(_CHUNK if left < 0 else min(_CHUNK, left))):
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk) if left > 0 else 0
    return crc


def _changed(source: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{source} is not what was saved: {what}; a byte of it changed after it was "
        f"written (disk, copy, transfer). {_NOTHING}"
    )
