"""Point-to-point transfers between pipeline ranks, and what every rank learns when one fails.

Each transfer is a small header (structure, dtypes, shapes) followed by the
tensors, all sent with ``isend`` under a tag naming the transfer (kind,
stage, micro-batch). Sends never block, so the order of the blocking receives
is the schedule's, which validation proved acyclic: no deadlock for any valid
schedule. Tags keep transfers apart when one pair of ranks exchanges several
stage boundaries (interleaved and V schedules). The header goes with every
transfer rather than once per shape: uneven micro-batches change shapes
within a step anyway, and the header is 512 bytes.

Why a failure channel: gloo cannot poll a pending receive (its wait with a
timeout closes the connection), so a rank blocked in a receive learns about
a failure only when its peer's connection closes. A failing rank therefore
writes its error to the job's TCP store first, then closes its connections;
every rank then fails in turn, reads the first error from the store, and
raises it (a killed rank writes nothing: its neighbours say they lost it).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipesched.errors import ConfigError, RemoteError

__all__ = ["FailureChannel", "Transport"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_HEADER = 64
_KIND = {torch.Tensor: 0, tuple: 1, list: 2}


class FailureChannel:
    """The first failure of the job, shared through torchrun's TCP store."""

    KEY = "pipesched/failure"

    def __init__(self) -> None:
        self._store: Any = None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port:
            try:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), is_master=False, timeout=timedelta(seconds=10)
                )
            except Exception:  # no store: failures still end the job, less explained
                self._store = None

    def report(self, message: str) -> None:
        """Records ``message`` unless an earlier failure was recorded."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.compare_set(self.KEY, "", message)

    def first(self, wait: float = 2.0) -> str | None:
        """The first recorded failure, waiting up to ``wait`` seconds for one to appear."""
        if self._store is None:
            return None
        deadline = time.monotonic() + wait
        try:
            while True:
                if self._store.check([self.KEY]):
                    return bytes(self._store.get(self.KEY)).decode()
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        except Exception:  # the store's host (rank 0) is gone too
            return None


class Transport:
    """Sends and receives nested tuples/lists of tensors between the ranks of one pipeline.

    Args:
        ranks: the global rank of each pp index.
        device: this rank's device (where received tensors land).
        failures: where failures are reported and read.
    """

    def __init__(
        self, ranks: tuple[int, ...], device: torch.device, failures: FailureChannel
    ) -> None:
        self.ranks = ranks
        self.device = device
        self.failures = failures
        self._pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive until sent)

    def send(self, value: Any, dst: int, tag: int) -> None:
        """Starts sending ``value`` (a tensor, or a tuple/list of tensors) to pp rank ``dst``."""
        tensors, header = _encode(value, self.device)
        for t in (header, *tensors):
            work = dist.isend(t.contiguous(), dst=self.ranks[dst], tag=tag)
            self._pending.append((work, t))

    def recv(self, src: int, tag: int, what: str) -> Any:
        """Receives what pp ``src`` sent under ``tag``; ``what`` names it in errors."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(header, src=self.ranks[src], tag=tag), src, what)
        kind, specs = _decode(header)
        values: list[torch.Tensor | None] = []
        for spec in specs:
            if spec is None:
                values.append(None)
                continue
            dtype, shape = spec
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._wait(dist.irecv(t, src=self.ranks[src], tag=tag), src, what)
            values.append(t)
        if kind == 0:
            return values[0]
        return tuple(values) if kind == 1 else list(values)

    def finish(self) -> None:
        """Waits for every send of this step to complete."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def _wait(self, work: Any, src: int, what: str) -> None:
        try:
            work.wait()
        except Exception as error:
            reason = self.failures.first()
            if reason is None:
                reason = (
                    f"lost pp rank {src} (global rank {self.ranks[src]}) while waiting for "
                    f"{what}: its connection closed without an error report, so the process "
                    "probably died (killed, or out of memory)"
                )
                self.failures.report(reason)
            raise RemoteError(f"pipesched: stopping: {reason}") from error


def _encode(value: Any, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    items = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(value, torch.Tensor | tuple | list) or not all(
        v is None or isinstance(v, torch.Tensor) for v in items
    ):
        raise ConfigError(
            "between ranks a stage may pass a tensor or a tuple/list of tensors, got "
            f"{type(value).__name__}; return tensors only from stages that end on another rank"
        )
    kind = 0 if isinstance(value, torch.Tensor) else 1 if isinstance(value, tuple) else 2
    header = [kind, len(items)]
    tensors = []
    for t in items:
        if t is None:
            header += [-1]
            continue
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        tensors.append(t.detach())
    if len(header) > _HEADER:
        raise ConfigError(
            f"a stage boundary passes {len(items)} tensors with {len(header)} header entries; "
            f"at most {_HEADER} fit: pass fewer tensors (e.g. concatenate them)"
        )
    padded = torch.zeros(_HEADER, dtype=torch.int64)
    padded[: len(header)] = torch.tensor(header, dtype=torch.int64)
    return tensors, padded.to(device)


def _decode(header: torch.Tensor) -> tuple[int, list[tuple[torch.dtype, list[int]] | None]]:
    h = header.tolist()
    kind, count, i = h[0], h[1], 2
    specs: list[tuple[torch.dtype, list[int]] | None] = []
    for _ in range(count):
        if h[i] == -1:
            specs.append(None)
            i += 1
            continue
        dtype, ndim = _DTYPES[h[i]], h[i + 1]
        specs.append((dtype, h[i + 2 : i + 2 + ndim]))
        i += 2 + ndim
    return kind, specs
