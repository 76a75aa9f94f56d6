"""Checkpoint files: atomic saves that clean up after killed ones, and the RNG states."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipesched.errors import CheckpointError
from pipesched.runtime import deferred_interrupts
from pipesched.train.integrity import checked_zip

__all__ = [
    "load_checkpoint",
    "remove_stale_temp_files",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]


def rng_state() -> dict[str, Any]:
    """The states of torch's CPU and CUDA generators, Python's, and NumPy's if it is loaded."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename over it.

    The temporary file is ``.{name}.pipesched-{host}-{pid}-{random}.tmp``
    beside ``path``. A save killed outright (SIGKILL, power loss) leaves it
    behind, and the previous file at ``path`` intact; the next save to the
    same ``path`` first removes such leftovers of processes of this host that
    are no longer alive (never a live process's file, never another host's).

    A Ctrl-C during the write stops it and surfaces as KeyboardInterrupt once
    the temporary file is removed, ``path`` untouched (torch's writer would
    turn it into a ``RuntimeError`` from its zip writer, its file half-written).

    Each zip record gets its CRC-32 even where torch's option to skip them is
    set: :func:`load_checkpoint` checks them before it unpickles anything.
    """
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temp_files(path)
    prefix = f"{_temp_prefix(path)}{_HOST}-{os.getpid()}-"
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    with _interrupts_stop_the_write() as interrupted:
        try:
            with os.fdopen(fd, "wb") as f, _crc32_written():
                torch.save(state, _Writer(f, interrupted))  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
            if interrupted:
                raise KeyboardInterrupt
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            if not interrupted:
                raise  # else: the held Ctrl-C is raised as the block ends


_CRC32_OPTION = threading.Lock()  # torch's option is the process's: one save sets it at a time


@contextmanager
def _crc32_written() -> Iterator[None]:
    with _CRC32_OPTION:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(True)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(previous)


class _Writer:
    """The file torch.save writes to; stops the write once a Ctrl-C came."""

    def __init__(self, f: Any, interrupted: list[Any]) -> None:
        self.f, self.interrupted = f, interrupted

    def write(self, data: Any) -> int:
        if self.interrupted:
            raise KeyboardInterrupt  # torch's writer raises its own error: the caller sees ours
        return int(self.f.write(data))

    def flush(self) -> None:
        self.f.flush()


@contextmanager
def _interrupts_stop_the_write() -> Iterator[list[Any]]:
    """Holds a Ctrl-C back until the block ends, then raises it; the list tells it came.

    :func:`pipesched.runtime.deferred_interrupts`, but the block sees that
    one came, to stop the write, only where it raises KeyboardInterrupt
    (Python's handler) or ends the process. A handler of the program's own is
    called once the save is done (it may want the save); an ignored SIGINT
    stays ignored.
    """
    previous = signal.getsignal(signal.SIGINT)
    stops = previous is signal.default_int_handler or previous == signal.SIG_DFL
    with deferred_interrupts() as caught:
        yield caught if stops else []


def load_checkpoint(path: str) -> Any:
    """Reads a file written by :func:`save_checkpoint` (every tensor is loaded on the CPU).

    Its zip records are checked against their CRC-32 first
    (:func:`~pipesched.train.integrity.checked_zip`), so a damaged file is
    refused before anything of it is unpickled.

    Raises:
        FileNotFoundError: there is no file at ``path`` (Python's convention,
            so that ``except FileNotFoundError`` can mean "start afresh").
        CheckpointError: the file cannot be read: truncated, empty, a
            directory, not a ``torch.save`` file, or changed since it was
            written. The reader's error is chained.
    """
    try:
        with checked_zip(path) as checked:
            return torch.load(checked, map_location="cpu", weights_only=False)
    except (FileNotFoundError, CheckpointError):
        raise
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read ({type(err).__name__}: {err}): it is "
            "truncated, empty, a directory or not a file written by torch.save; load "
            "another checkpoint"
        ) from err


def remove_stale_temp_files(path: str) -> list[str]:
    """Removes the temporary files that killed saves to ``path`` left; returns their paths.

    Only files named by :func:`save_checkpoint` for this ``path`` on this
    host whose process is gone; a file of a live process (another save in
    progress) or of another host (a shared file system) is left alone.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _temp_prefix(path)
    removed = []
    for name in os.listdir(directory):
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        owner = name[len(prefix) : -len(".tmp")].rpartition("-")[0]  # host-pid
        host, _, pid = owner.rpartition("-")
        if host != _HOST or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:  # another process cleaned it first
            continue
        removed.append(os.path.join(directory, name))
    return removed


def _temp_prefix(path: str) -> str:
    # Bounded, so that the temporary name stays within the file system's limit.
    return f".{os.path.basename(path)[:96]}.pipesched-"


def _alive(pid: int) -> bool:
    # This process's own file may be another thread's save in progress; on
    # Windows os.kill(pid, 0) would terminate the process: keep both.
    if pid == os.getpid() or sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process; else: cannot tell
        return True
    return True


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"
