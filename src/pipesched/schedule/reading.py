"""Schedules written by hand: rows of short-form actions, checked against the size they imply.

One cell (``0F99999999``) can imply a huge schedule, so :func:`layout` checks the
implied actions against :data:`~pipesched.schedule.limits.MAX_ACTIONS` and the
listed ones before sizing anything, naming the cell; a text listing under half the
actions its indexes imply is refused as a typo.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence

from pipesched.errors import ScheduleError
from pipesched.schedule.action import WEIGHT, Action
from pipesched.schedule.limits import MAX_ACTIONS, limit_text

__all__ = ["layout", "rows_from_csv", "rows_from_lists"]


def rows_from_csv(text: str) -> tuple[list[list[Action]], list[str]]:
    """Each non-empty row's actions, and where each row is (``"line 3"``).

    Blank cells, blank lines and lines starting with ``#`` are skipped; line
    numbers count every line of ``text``.

    Raises:
        ScheduleError: a cell is not an action, or the text lists more than
            MAX_ACTIONS actions; the message names the line.
    """
    rows: list[list[Action]] = []
    where: list[str] = []
    listed = 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        label = f"line {number}"
        try:
            cells = [c for c in next(csv.reader([line]), []) if c.strip()]
        except csv.Error as error:
            raise ScheduleError(f"{label}: not a CSV row ({error})") from None
        if not cells:
            continue
        listed += len(cells)
        if listed > MAX_ACTIONS:
            raise ScheduleError(f"{label}: the text lists more than {limit_text()}")
        rows.append(_parse(cells, label))
        where.append(label)
    return rows, where


def rows_from_lists(
    actions: Sequence[Iterable[str | Action]],
) -> tuple[list[list[Action]], list[str]]:
    """Each worker's actions (short forms parsed), and where each row is (``"worker 0"``).

    Raises:
        ScheduleError: an action is malformed; the message names the worker.
    """
    rows = [_parse(row, f"worker {w}") for w, row in enumerate(actions)]
    return rows, [f"worker {w}" for w in range(len(rows))]


def _parse(cells: Iterable[str | Action], label: str) -> list[Action]:
    try:
        return [a if isinstance(a, Action) else Action.parse(a) for a in cells]
    except ScheduleError as error:
        raise ScheduleError(f"{label}: {error}") from None


def layout(
    rows: list[list[Action]], where: Sequence[str], source: str = "the text"
) -> tuple[tuple[int, ...], int]:
    """The placement and micro-batch count ``rows`` imply, once they are known to fit.

    A stage runs on the worker whose row holds its actions; the stage and
    micro-batch counts are the largest indexes plus one.

    Args:
        rows: each worker's actions.
        where: how an error names each row (``"line 3"``, ``"worker 0"``).
        source: how an error names the whole input.

    Raises:
        ScheduleError: a stage is on two workers or has no actions; the rows
            list more than MAX_ACTIONS actions; or their largest indexes imply
            more than MAX_ACTIONS actions, or more than twice those listed.
    """
    listed = sum(map(len, rows))
    if listed > MAX_ACTIONS:
        raise ScheduleError(f"{source} lists {listed} actions, more than {limit_text()}")
    worker_of: dict[int, int] = {}
    microbatches: set[int] = set()
    top_stage = top_microbatch = (-1, 0)  # (index, row) where the largest index is
    weight = False
    for w, row in enumerate(rows):
        for a in row:
            if worker_of.setdefault(a.stage, w) != w:
                raise ScheduleError(
                    f"stage {a.stage} has actions on workers {worker_of[a.stage]} and {w}; "
                    "each stage runs on exactly one worker"
                )
            microbatches.add(a.microbatch)
            if a.stage > top_stage[0]:
                top_stage = (a.stage, w)
            if a.microbatch > top_microbatch[0]:
                top_microbatch = (a.microbatch, w)
            weight = weight or a.kind == WEIGHT
    if not worker_of:
        raise ScheduleError("the schedule has no actions")
    p, m, kinds = top_stage[0] + 1, top_microbatch[0] + 1, 3 if weight else 2
    implied = p * m * kinds
    if implied > MAX_ACTIONS or implied > 2 * listed:
        # Name the index that is further from the indexes the rows actually use.
        by_stage = p * len(microbatches) >= m * len(worker_of)
        what, (index, w) = ("stage", top_stage) if by_stage else ("micro-batch", top_microbatch)
        cell = next(a for a in rows[w] if (a.stage if by_stage else a.microbatch) == index)
        raise ScheduleError(
            f"{where[w]}: {cell} has {what} index {index}, so the schedule would have {m} "
            f"micro-batches x {p} stages x {kinds} kinds = {implied} actions, but only {listed} "
            f"are listed; a schedule lists each action once, with stages and micro-batches "
            f"numbered from 0 without gaps, and may not exceed {limit_text()}"
        )
    missing = [s for s in range(p) if s not in worker_of]
    if missing:
        raise ScheduleError(f"stages {missing} have no actions (stages seen: {sorted(worker_of)})")
    return tuple(worker_of[s] for s in range(p)), m
