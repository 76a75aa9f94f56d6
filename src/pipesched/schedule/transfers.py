"""Where values cross between workers, in one order every worker agrees on.

NCCL matches messages by posting order, not tag. :func:`transfer_plan` takes one
global (topological) order of the actions and puts each send right after its
action and the receive at the same point on the receiver, so no wait waits behind
one of its own. Example::

    >>> from pipesched.schedule import get_schedule
    >>> rows = transfer_plan(get_schedule("1f1b", 2, 2))
    >>> print(", ".join(map(str, rows[1])))
    recv 1F0 from 0, recv 1F1 from 0, 1F0, 1B0, send 0B0 to 0, 1F1, 1B1, send 0B1 to 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pipesched.schedule.action import Action
from pipesched.schedule.dataflow import Message, message_out

if TYPE_CHECKING:
    from pipesched.schedule.schedule import Schedule

__all__ = ["Recv", "Send", "transfer_plan"]


class Send(NamedTuple):
    """Send ``message`` to worker ``peer`` (right after the action that made it)."""

    message: Message
    peer: int

    def __str__(self) -> str:
        return f"send {_short(self.message)} to {self.peer}"


class Recv(NamedTuple):
    """Receive ``message`` from worker ``peer``."""

    message: Message
    peer: int

    def __str__(self) -> str:
        return f"recv {_short(self.message)} from {self.peer}"


Item = Action | Send | Recv


def transfer_plan(schedule: Schedule) -> tuple[tuple[Item, ...], ...]:
    """Each worker's actions, with its sends and receives between workers, in the agreed order.

    A value that stays on one worker (the turn of a V schedule) gets no
    send or receive. The result is cached on the schedule.

    Raises:
        ScheduleError: the schedule cannot run.
    """
    cached = schedule._cache.get("transfers")
    if cached is None:
        schedule.validate()
        order: list[Action] = schedule._cache["order"]  # type: ignore[assignment]
        placement, num_stages = schedule.placement, schedule.num_stages
        rows: list[list[Item]] = [[] for _ in range(schedule.num_workers)]
        for action in order:
            w = placement[action.stage]
            rows[w].append(action)
            message = message_out(action, num_stages)
            if message is not None and (peer := placement[message.stage]) != w:
                rows[w].append(Send(message, peer))
                rows[peer].append(Recv(message, w))
        cached = schedule._cache["transfers"] = tuple(map(tuple, rows))
    return cached  # type: ignore[return-value]


def _short(message: Message) -> str:
    return f"{message.stage}{message.kind}{message.microbatch}"
