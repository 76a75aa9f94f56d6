"""The data-flow rule, written once: which action's result each action consumes, and what moves.

F(s,i) takes F(s-1,i)'s output; B(s,i) takes B(s+1,i)'s input gradient; W(s,i)
needs B(s,i). A :class:`Message` names a value crossing stages by its consumer. The
graph, simulator, transfer plan and runtimes all read the rule here.
"""

from __future__ import annotations

from typing import NamedTuple

from pipesched.schedule.action import BACKWARD, FORWARD, Action, Kind

__all__ = ["Message", "data_predecessor", "message_in", "message_out"]


class Message(NamedTuple):
    """A value that crosses between stages: ``stage``'s input (F) or output gradient (B).

    ``kind`` is the pass that consumes it: ``Message(F, s, i)`` is made by
    F(s-1,i) and taken by F(s,i); ``Message(B, s, i)`` is made by B(s+1,i)
    and taken by B(s,i).
    """

    kind: Kind
    stage: int
    microbatch: int

    @property
    def source(self) -> int:
        """The stage that makes the value."""
        return self.stage - 1 if self.kind == FORWARD else self.stage + 1

    def __str__(self) -> str:
        what = "input" if self.kind == FORWARD else "output gradient"
        return f"stage {self.stage}'s {what} for micro-batch {self.microbatch}"


def data_predecessor(action: Action, num_stages: int) -> tuple[int, str, int] | None:
    """The action whose result ``action`` consumes, or None for the first forward.

    F(s,i) needs F(s-1,i); B(last,i) needs F(last,i); B(s,i) needs B(s+1,i);
    W(s,i) needs B(s,i). Returned as a plain tuple, which is equal to (and
    hashes like) the Action, and is several times cheaper to make.

    Example:
        >>> data_predecessor(Action(1, "B", 0), num_stages=2)
        (1, <Kind.F: 'F'>, 0)
    """
    s, kind, i = action
    if kind == FORWARD:
        return (s - 1, FORWARD, i) if s > 0 else None
    if kind == BACKWARD:
        return (s + 1, BACKWARD, i) if s < num_stages - 1 else (s, FORWARD, i)
    return (s, BACKWARD, i)


def message_in(action: Action, num_stages: int) -> Message | None:
    """The value ``action`` takes from another stage, or None (first F, last B, any W).

    Example:
        >>> str(message_in(Action(0, "B", 3), num_stages=2))
        "stage 0's output gradient for micro-batch 3"
    """
    s, kind, i = action
    if kind == FORWARD:
        return Message(FORWARD, s, i) if s > 0 else None
    if kind == BACKWARD and s < num_stages - 1:
        return Message(BACKWARD, s, i)
    return None


def message_out(action: Action, num_stages: int) -> Message | None:
    """The value ``action`` makes for another stage, or None (last F, first B, any W).

    Example:
        >>> message_out(Action(0, "F", 3), num_stages=2)
        Message(kind=<Kind.F: 'F'>, stage=1, microbatch=3)
    """
    s, kind, i = action
    if kind == FORWARD:
        return Message(FORWARD, s + 1, i) if s < num_stages - 1 else None
    if kind == BACKWARD and s > 0:
        return Message(BACKWARD, s - 1, i)
    return None
