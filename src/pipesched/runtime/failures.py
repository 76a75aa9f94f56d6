"""What every rank of a pipeline learns when one fails, dies, or stops answering.

Why a failure channel: gloo cannot poll a pending receive, so a failing rank first
writes a :class:`Failure` to the job's TCP store, then closes its connections; every
rank then reads it and raises a :class:`~pipesched.errors.RemoteError`. A rank that
wrote nothing is named by how the wait ended: connection closed (dead) or timed out.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pipesched.errors import RemoteError

__all__ = ["Failure", "FailureChannel", "is_timeout"]


@dataclass(frozen=True)
class Failure:
    """The first failure of a pipeline, as every rank reports it.

    Attributes:
        kind: "error" (raised), "died" (connection closed, no report) or
            "timeout" (no answer within the timeout).
        summary: one sentence naming the rank, what happened and the fix.
        rank, pp_rank, dp_rank: the rank that failed (or was lost), if known.
        action: the action it ran (``"1F2"``), if known.
        error_type, error_message: the original exception (kind "error").
    """

    kind: str
    summary: str
    rank: int | None = None
    pp_rank: int | None = None
    dp_rank: int | None = None
    action: str | None = None
    error_type: str | None = None
    error_message: str | None = None

    _PREFIX = "pipesched: stopping: "

    def error(self) -> RemoteError:
        """The RemoteError a rank raises for this failure."""
        return RemoteError(f"{self._PREFIX}{self.summary}", **self.facts())

    def facts(self) -> dict[str, Any]:
        """The attributes of its RemoteError: everything but the summary."""
        fields = asdict(self)
        del fields["summary"]
        return fields

    @classmethod
    def of(cls, error: RemoteError) -> Failure:
        """The failure a RemoteError was raised for."""
        summary = str(error).removeprefix(cls._PREFIX)
        return cls(
            error.kind,
            summary,
            rank=error.rank,
            pp_rank=error.pp_rank,
            dp_rank=error.dp_rank,
            action=error.action,
            error_type=error.error_type,
            error_message=error.error_message,
        )


def is_timeout(error: BaseException, waited: float, timeout: float) -> bool:
    """Whether a failed wait ran out of time (the peer may be alive) rather than lost its peer.

    gloo says "Timed out waiting ..." for the wait that ran out, and "Application
    timeout caused pair closure" for later waits on the same connection; a wait
    that lasted the whole timeout counts too, whatever the backend says.
    """
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or waited >= 0.95 * timeout


class FailureChannel:
    """The first failure of one pipeline (all its replicas), shared through torchrun's TCP store.

    Args:
        serial: tells this pipeline from others built in the same job (every
            rank builds its pipelines in the same order).
        pp_rank, dp_rank: this rank's place (named in the failures it reports).
        timeout: seconds a transfer may wait (named in timeout reports).
    """

    def __init__(
        self, serial: int = 0, pp_rank: int = 0, dp_rank: int = 0, timeout: float = 600.0
    ) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job starts clean
        self.key = f"pipesched/failure/{restart}/{serial}"
        self.pp_rank, self.dp_rank = pp_rank, dp_rank
        self.timeout = timeout
        self._store: Any = None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port:
            try:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), is_master=False, timeout=timedelta(seconds=10)
                )
            except Exception:  # no store: failures still end the job, less explained
                self._store = None

    def report(self, failure: Failure) -> None:
        """Records ``failure`` unless an earlier one was recorded."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.compare_set(self.key, "", json.dumps(asdict(failure)))

    def first(self, wait: float = 2.0) -> Failure | None:
        """The first recorded failure, waiting up to ``wait`` seconds for one to appear."""
        if self._store is None:
            return None
        deadline = time.monotonic() + wait
        try:
            while True:
                if self._store.check([self.key]):
                    return Failure(**json.loads(bytes(self._store.get(self.key)).decode()))
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        except Exception:  # the store's host (rank 0) is gone too
            return None

    def lost(
        self, error: BaseException, waited: float, doing: str, pp_rank: int | None, rank: int | None
    ) -> Failure:
        """The failure to report when a transfer failed and nobody reported why.

        Args:
            error: what the transfer raised.
            waited: seconds it lasted.
            doing: what this rank was doing, in words ("waiting for ...").
            pp_rank, rank: the peer (None: one of the pipeline's ranks).
        """
        me = f"pp rank {self.pp_rank} (dp {self.dp_rank})"
        peer = "a rank of this pipeline" if pp_rank is None else f"pp rank {pp_rank}"
        if rank is not None:
            peer += f" (global rank {rank})"
        kind = "timeout" if is_timeout(error, waited, self.timeout) else "died"
        if kind == "timeout":
            summary = (
                f"{peer} did not answer within {self.timeout:g} s while {me} was {doing}: "
                "it is alive but hung, or slower than the timeout (a stage, a data "
                "loader or a checkpoint that takes longer); if it is only slow, raise the "
                f"timeout with init_mesh(pp, dp, timeout=...) (now timeout={self.timeout:g})"
            )
        else:
            summary = (
                f"lost {peer} while {me} was {doing}: its connection closed without an "
                "error report, so the process died (killed, out of memory, or exited); "
                "look at its own log"
            )
        dp_rank = None if pp_rank is None else self.dp_rank
        return Failure(kind, summary, rank=rank, pp_rank=pp_rank, dp_rank=dp_rank)
