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
import re
import zipfile
import zlib
from typing import Any

import torch

from pipesched.errors import CheckpointError

__all__ = [
    "CHECKSUM",
    "check_files",
    "check_zip",
    "digest",
    "record_files",
    "verified",
]

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


_ZIP_MAGIC = b"PK\x03\x04"
_SUMS = ".crc32-"  # + rank + ".json": the CRC-32 of the files of a sharded version
_CHUNK = 1 << 20


def check_zip(path: str) -> None:
    """Refuses a ``torch.save`` file whose zip records differ from their CRC-32.

    Reads each record once, in 1 MiB pieces, without unpickling anything. A
    file that is not a zip (torch's legacy format) is left to ``torch.load``,
    and one saved without CRCs (``torch.serialization.set_crc32_options(False)``:
    every record's is 0) to the content checksum.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: a record's bytes differ from its CRC-32, or the zip's
            directory is damaged. Nothing was read into the program.
    """
    with open(path, "rb") as f:  # FileNotFoundError, IsADirectoryError: the caller's
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            return
    try:
        z = zipfile.ZipFile(path)
    except Exception as err:  # BadZipFile: no directory where a zip keeps it
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read ({type(err).__name__}: {err}): it is "
            "truncated, or its zip directory is damaged; load another checkpoint"
        ) from err
    with z:
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


def record_files(directory: str, rank: int, world: int) -> None:
    """Records the CRC-32 of this rank's files in ``directory``, once every rank has written.

    A rank takes the files DCP names after it (``__{rank}_*.distcp``, which it
    wrote, so this holds where each node has its own disk); rank 0 also takes
    every other file (``.metadata``, and any file named otherwise).
    """
    sums = {
        name: _crc32(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
        if not name.startswith(_SUMS) and _writer(name, world) == rank
    }
    target = os.path.join(directory, f"{_SUMS}{rank}.json")
    with open(target, "w") as f:
        json.dump(sums, f)
        f.flush()
        os.fsync(f.fileno())


def _writer(name: str, world: int) -> int:
    """The rank that records ``name``: the one DCP named it after, else 0."""
    found = re.match(r"__(\d+)_", name)
    return int(found[1]) % world if found else 0


def check_files(directory: str, names: list[str]) -> None:
    """Refuses when a file of ``names`` in ``directory`` differs from its recorded CRC-32.

    A directory with no records (saved before they were, or by torch's own
    tools) is read unchecked.

    Raises:
        CheckpointError: a file, or the record of it, changed; or a file
            has no record while others do (its record file was removed).
    """
    recorded: dict[str, int] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith(_SUMS):
            try:
                with open(os.path.join(directory, name)) as f:
                    recorded.update({str(k): int(v) for k, v in json.load(f).items()})
            except (ValueError, TypeError, AttributeError, OSError) as err:
                raise _changed(
                    f"checkpoint {directory!r}", f"its checksum record {name!r} ({err})"
                ) from err
    if not recorded:
        return
    for name in names:
        if name not in recorded:
            raise _changed(
                f"checkpoint {directory!r}", f"{name!r}, of which no checksum is recorded"
            )
        found = _crc32(os.path.join(directory, name))
        if found != recorded[name]:
            raise _changed(
                f"checkpoint {directory!r}",
                f"the file {name!r} (CRC-32 {found:#010x}, recorded {recorded[name]:#010x})",
            )


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _changed(source: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{source} is not what was saved: {what}; a byte of it changed after it was "
        "written (disk, copy, transfer). Nothing was loaded or changed; load another "
        "checkpoint, or a good copy of this one"
    )
