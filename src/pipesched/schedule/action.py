"""The unit of a schedule: one stage running one pass over one micro-batch."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final, NamedTuple

from pipesched.errors import ScheduleError
from pipesched.schedule.limits import MAX_ACTIONS, limit_text

__all__ = ["BACKWARD", "FORWARD", "KINDS", "WEIGHT", "Action", "Kind"]


class Kind(StrEnum):
    """The passes an action can run: a closed set, so an unknown kind cannot be built.

    Each member is its one-letter string (``Kind.F == "F"``, same hash), so
    tables keyed by ``"F"`` find it and the short form stays ``"2F0"``.
    """

    F = "F"
    """Forward pass of a stage on a micro-batch."""
    B = "B"
    """Backward pass. In schedules that also have W it computes only the input gradient."""
    W = "W"
    """Weight-gradient pass (zero-bubble schedules): the half of backward no stage waits for."""


FORWARD: Final = Kind.F
BACKWARD: Final = Kind.B
WEIGHT: Final = Kind.W
KINDS: Final = (FORWARD, BACKWARD, WEIGHT)
_KIND_OF: Final[dict[object, str]] = {k.value: k.value for k in Kind}
"""A kind, given as a Kind or its letter, to the plain letter an Action stores."""

_SHORT_FORM = re.compile(r"\s*(\d+)\s*([FBW])\s*(\d+)\s*")


class _Fields(NamedTuple):
    stage: int
    kind: str  # one of Kind's letters: Action.__new__ refuses anything else
    microbatch: int


class Action(_Fields):
    """Stage ``stage`` runs pass ``kind`` (F, B or W) on micro-batch ``microbatch``.

    The short form ``"2F0"`` (stage, kind, micro-batch) round-trips through
    ``str`` and :meth:`parse`.

    Why a NamedTuple and not a frozen dataclass: actions are the nodes of the
    schedule graph and are hashed hundreds of thousands of times when a large
    schedule is validated or simulated; a tuple hashes and compares in C.

    ``kind`` is one of :class:`Kind` (given as a member or its letter);
    anything else is refused when the action is made. It is stored as the
    plain letter, equal to the member, so actions pickle, print and load
    (``torch.load(weights_only=True)``) as tuples of builtins.

    Example:
        >>> a = Action(2, Kind.F, 0)
        >>> str(a), a.kind == "F"
        ('2F0', True)
        >>> Action.parse("2F0") == a
        True
    """

    __slots__ = ()

    def __new__(cls, stage: int, kind: Kind | str, microbatch: int) -> Action:
        closed = _KIND_OF.get(kind)
        if closed is None:
            raise ScheduleError(
                f"action kind {kind!r} (stage {stage}, micro-batch {microbatch}) is not one of "
                f"{', '.join(map(repr, _KIND_OF))}: F forward, B backward (input gradient "
                "where W appears), W weight gradient"
            )
        if type(stage) is not int or type(microbatch) is not int or stage < 0 or microbatch < 0:
            raise ScheduleError(
                f"action {stage!r}{closed}{microbatch!r}: a stage and a micro-batch are ints "
                f">= 0, got stage {stage!r} and micro-batch {microbatch!r}; write "
                "Action(stage, kind, microbatch) or the short form '2F0'"
            )
        return tuple.__new__(cls, (stage, closed, microbatch))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads the short form ``"<stage><F|B|W><micro-batch>"``.

        Raises:
            ScheduleError: ``text`` is not in the short form, or an index is
                one no schedule within :data:`MAX_ACTIONS` can reach.
        """
        match = _SHORT_FORM.fullmatch(text)
        if match is None:
            shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
            raise ScheduleError(
                f"action {shown!r} is not in the short form <stage><F|B|W><micro-batch>; "
                "write e.g. '2F0' for stage 2, forward, micro-batch 0 (indexes count from 0)"
            )
        return cls(_index("stage", match[1], text), match[2], _index("micro-batch", match[3], text))


def _index(what: str, digits: str, text: str) -> int:
    """``digits`` as an index, or a ScheduleError when it is past any schedule within the cap.

    A stage or micro-batch index ``i`` implies at least ``i + 1`` of them, so
    one at or past MAX_ACTIONS cannot belong to a schedule pipesched runs.
    Very long numbers are refused before ``int`` reads them.
    """
    digits = digits.lstrip("0") or "0"
    if len(digits) <= len(str(MAX_ACTIONS)) and int(digits) < MAX_ACTIONS:
        return int(digits)
    shown = digits if len(digits) <= 12 else f"{digits[:12]}... ({len(digits)} digits)"
    action = text.strip() if len(text) <= 40 else f"{text.strip()[:20]}..."
    raise ScheduleError(
        f"action {action!r} has {what} index {shown}, but a schedule within {limit_text()} "
        f"has fewer than {MAX_ACTIONS} {what}{'es' if what.endswith('batch') else 's'}"
    )
