"""Sharded checkpoint directories: DCP versions, each committed atomically.

Why not save straight into ``path``: a rank killed halfway would leave a mix of two
checkpoints. Each save writes a new version, and once every rank has written, rank 0
commits it by replacing ``path/latest`` atomically. A version is a plain DCP
directory that torch's tools read directly.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipesched.errors import CheckpointError
from pipesched.train.integrity import Span, check, record

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

# torch.distributed.checkpoint is imported where a sharded checkpoint is read or written,
# not with this module: it takes 0.8 s, which every rank would pay at start-up.

__all__ = ["LATEST", "files_of", "is_sharded", "read", "read_metadata", "resolve", "write"]

LATEST = "latest"
"""The file in a checkpoint directory that names its committed version."""

_METADATA = ".metadata"  # what torch.distributed.checkpoint writes last, once all ranks have


def is_sharded(path: str) -> bool:
    """Whether ``path`` is a directory (a sharded checkpoint), not a ``torch.save`` file."""
    return os.path.isdir(path)


def resolve(path: str) -> str:
    """The committed DCP directory of the checkpoint at ``path``.

    Raises:
        FileNotFoundError: nothing is at ``path``.
        CheckpointError: ``path`` is a directory with no committed version.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if os.path.isfile(os.path.join(path, _METADATA)):
        return path  # a plain torch.distributed.checkpoint directory
    pointer = os.path.join(path, LATEST)
    try:
        with open(pointer, errors="replace") as f:  # a changed byte: no such version below
            version = f.read().strip()
    except OSError as err:
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: it is a directory without a committed "
            f"version (no {LATEST!r} file, no {_METADATA!r}); its first save did not "
            "finish, or it is not a checkpoint. Load another"
        ) from err
    directory = os.path.join(path, version)
    if os.sep in version or not os.path.isfile(os.path.join(directory, _METADATA)):
        raise CheckpointError(
            f"checkpoint {path!r} names version {version!r} in {LATEST!r}, which is not a "
            f"complete checkpoint (its files were removed, or {LATEST!r} changed); load another"
        )
    return directory


def read_metadata(directory: str) -> dict[str, Any]:
    """Each key of the DCP checkpoint in ``directory``: its tensor metadata, or bytes metadata."""
    return dict(_metadata(directory).state_dict_metadata)


def files_of(directory: str) -> dict[str, str]:
    """Which file of the DCP checkpoint in ``directory`` holds each key (for messages)."""
    try:
        storage = _metadata(directory).storage_data
    except CheckpointError:  # read already; only a message needs it
        return {}
    return {index.fqn: getattr(info, "relative_path", "?") for index, info in storage.items()}


def _metadata(directory: str) -> Any:
    """The DCP ``Metadata`` of ``directory``, its file checked before it is unpickled."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    check(directory, [_METADATA], [])
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {directory!r} cannot be read ({type(err).__name__}: {err}); load another"
        ) from err


def read(directory: str, keys: list[str], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Reads only ``keys`` of the checkpoint in ``directory`` (tensors on the CPU).

    Each process reads by itself, no collective: a rank reads its own stages'
    entries and never holds the rest. The bytes holding them are checked
    against their recorded CRC-32 first (only those bytes).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    request: dict[str, Any] = {}
    for key in keys:
        entry = metadata[key]
        if isinstance(entry, TensorStorageMetadata):
            request[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            request[key] = None  # an object: replaced by what was saved
    if not request:
        return request
    spans = _spans(_metadata(directory).storage_data)
    check(directory, [], [span for key, span in spans if key in request])
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(
                request,
                storage_reader=FileSystemReader(directory),
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
    except (Exception, CheckpointException) as err:  # (the latter is a BaseException)
        failure = err.failures.get(0) if isinstance(err, CheckpointException) else None
        stop = _interrupt(failure[0] if failure is not None else err)
        if stop is not None:  # Ctrl-C while reading: a Ctrl-C, not a damaged file
            raise stop from None
        raise CheckpointError(
            f"checkpoint {directory!r} cannot be read ({type(err).__name__}: {err}): a file "
            "of it is missing, truncated or changed; load another"
        ) from err
    return request


def write(state: dict[str, Any], path: str, *, distributed: bool) -> None:
    """Writes ``state`` (flat: names to tensors or small objects) as a new version of ``path``.

    With ``distributed``, every rank of the job calls it with its own
    entries (an entry that several ranks hold, the same tensor, is written
    once), and the version is committed only when every rank has written
    (see the module); else this process writes the whole checkpoint.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    rank = dist.get_rank() if distributed else 0
    version, problem = f"v-{uuid.uuid4().hex[:12]}", None
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:  # a file there, no permission, ...
            problem = f"{type(err).__name__}: {err}"
    if distributed:  # every rank learns rank 0's version name, or that it cannot write
        box = [(version, problem)]
        dist.broadcast_object_list(box, src=0)
        version, problem = box[0]
    if problem is not None:
        raise CheckpointError(
            f"cannot save the checkpoint to {path!r} ({problem}): a sharded checkpoint is a "
            "directory; give a path where one can be made (not an existing file)"
        )
    directory = os.path.join(path, version)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            saved = dcp_save(
                state,
                storage_writer=FileSystemWriter(directory, sync_files=True),
                planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=not distributed,
            )  # returns on any rank only once every rank's files and the metadata are written
        except CheckpointException as err:  # a BaseException, whatever failed inside
            raise _unwrapped(err, path, rank) from err
    _record(directory, path, rank, distributed, [span for _, span in _spans(saved.storage_data)])
    if rank == 0:
        _commit(path, version)
    if distributed:
        dist.barrier()  # no rank reads path before it is committed


def _spans(storage: Mapping[Any, Any]) -> list[tuple[str, Span]]:
    """Each key's stored bytes, from DCP's ``storage_data`` (a key stored in chunks: each)."""
    return [
        (index.fqn, (info.relative_path, info.offset, info.length))
        for index, info in storage.items()
    ]


def _writer(name: str, world: int) -> int:
    """The rank that wrote ``name``, as DCP's FileSystemWriter names files; else 0."""
    found = re.match(r"__(\d+)_", name)
    return int(found[1]) % world if found else 0


def _record(directory: str, path: str, rank: int, distributed: bool, spans: list[Span]) -> None:
    """Every rank records the CRC-32 of the bytes it wrote (see integrity), or none commits.

    ``spans`` are every item's bytes, from the metadata DCP's save returns on
    every rank. A rank reads back only its own files' bytes (never
    ``.metadata``, which only rank 0 may see), so this holds where each node
    has its own disk; rank 0 also records ``.metadata``, whole, and the bytes
    of any file named otherwise than DCP names them.
    """
    problem, interrupted = None, None
    world = dist.get_world_size() if distributed else 1
    try:
        mine = [span for span in spans if _writer(span[0], world) == rank]
        record(directory, rank, [_METADATA] if rank == 0 else [], mine)
    except BaseException as err:  # a Ctrl-C too: the other ranks must not wait for this one
        problem = f"rank {rank}: {type(err).__name__}: {err}"
        interrupted = None if isinstance(err, Exception) else err
    problems = [problem]
    if distributed:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    if interrupted is not None:
        raise interrupted
    found = [p for p in problems if p is not None]
    if found:
        raise CheckpointError(
            f"cannot save the checkpoint to {path!r} (recording its checksums: "
            f"{'; '.join(found)}); nothing was committed: its previous version is still "
            "the one that loads"
        )


def _unwrapped(err: CheckpointException, path: str, rank: int) -> BaseException:
    """What a failed DCP save raises instead: this rank's Ctrl-C as Ctrl-C, else a CheckpointError.

    Nothing was committed: ``path`` keeps its previous version, and the
    half-written one is removed by the next save.
    """
    own = err.failures.get(rank)
    stop = _interrupt(own[0]) if own is not None else None
    if stop is not None:
        return stop
    return CheckpointError(
        f"cannot save the checkpoint to {path!r} ({err}); nothing was committed: its "
        "previous version is still the one that loads"
    )


def _interrupt(error: BaseException) -> BaseException | None:
    """A fresh Ctrl-C (or exit) where ``error`` is one or follows from one, else None.

    Why the chain: torch's zip writer, closing on a Ctrl-C, raises its own error over it.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt | SystemExit):
            return type(cause)()
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _commit(path: str, version: str) -> None:
    """Points ``path/latest`` at ``version`` atomically, then removes every other version."""
    tmp = os.path.join(path, f".{LATEST}-{version}.tmp")
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, LATEST))
    _fsync_directory(path)
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if name.startswith("v-") and name != version and os.path.isdir(entry):
            shutil.rmtree(entry, ignore_errors=True)  # older or half-written versions
        elif name.startswith(f".{LATEST}-") and name.endswith(".tmp"):
            os.unlink(entry)


def _fsync_directory(path: str) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
