"""Whether the local runtime's workers take turns: measured, since only the machine can tell.

Two worker threads share the GIL: with long actions they overlap, with actions of
microseconds they pass the GIL at every call and can run faster taking turns. Which
wins depends on layers, cores and load, so :class:`Turns` measures both on the
pipeline's own steps, keeps the faster and rechecks ever more rarely. Results never
depend on it: each worker runs its actions in the schedule's order either way.
"""

from __future__ import annotations

__all__ = ["Turns"]

_FIRST = 1  # measurements of each way before the first comparison (a wrong pick from
# a noisy one is undone within _KEEP steps: the least of the chosen way's times rises)
_FIRST_RECHECK = 8  # steps before the losing way runs again, doubled each time it loses
_LAST_RECHECK = 512
_KEEP = 3  # measurements kept per way: the least counts (a slow outlier is the machine's load)
_OVERLAPPING = 1.5  # cores kept busy by a step without turns above which turns cannot win


class Turns:
    """Picks, step by step, whether the workers take turns (see the module).

    Keyed by the kind of step (training, forward only): their actions differ.
    The first step of each kind only warms up (lazy imports, allocations);
    the next runs without turns and the one after with them, unless the step
    without turns kept more than 1.5 cores busy (its workers overlapped for
    real: nothing to gain). From then on the way with the lower time per
    action (the least of its last 3), the other measured again after 8, 16,
    32, ... steps while it keeps losing.
    """

    def __init__(self) -> None:
        self._kinds: dict[bool, _Kind] = {}

    def choose(self, forward_only: bool) -> bool:
        """Whether the step about to run takes turns."""
        kind = self._kinds.get(forward_only)
        if kind is None:
            kind = self._kinds[forward_only] = _Kind()
        return kind.choose()

    def measured(self, forward_only: bool, turns: bool, per_action: float, cores: float) -> None:
        """Records a step that ran (``turns`` as chosen).

        Args:
            forward_only: the kind of step, as given to :meth:`choose`.
            turns: whether it took turns.
            per_action: its time (seconds) divided by its number of actions.
            cores: its CPU time divided by its time: how many cores it kept busy.
        """
        self._kinds[forward_only].measured(turns, per_action, cores)


class _Kind:
    """The measurements of one kind of step."""

    def __init__(self) -> None:
        self.steps = 0
        self.recent: dict[bool, list[float]] = {False: [], True: []}
        self.compared = False  # both ways measured _FIRST times
        self.recheck = _FIRST_RECHECK
        self.next_check = 0  # from this step on, the losing way (or untried turns) runs again

    def choose(self) -> bool:
        if self.steps < 2:
            return False  # the warm-up, then the first measurement without turns
        if self.steps < self.next_check:
            return self.compared and self._best()
        if not self.compared:  # each way in turn: without, with
            return len(self.recent[True]) < len(self.recent[False])
        return not self._best()  # a check of the losing way

    def measured(self, turns: bool, per_action: float, cores: float) -> None:
        self.steps += 1
        if self.steps == 1:
            return  # the warm-up
        before = self._best() if self.compared else None
        kept = self.recent[turns]
        kept.append(per_action)
        del kept[:-_KEEP]
        if not turns and cores > _OVERLAPPING and not (self.compared and self._best()):
            self._later(lost=True)  # the workers overlapped for real: turns cannot win
        elif not self.compared:
            if min(map(len, self.recent.values())) >= _FIRST:
                self.compared = True
                self._later(lost=False)
        elif self.steps > self.next_check:  # a check of the losing way
            self._later(lost=self._best() == before)

    def _later(self, *, lost: bool) -> None:
        """The losing way runs again later: ever later while it keeps losing."""
        self.recheck = min(2 * self.recheck, _LAST_RECHECK) if lost else _FIRST_RECHECK
        self.next_check = self.steps + self.recheck

    def _best(self) -> bool:
        """Whether taking turns was the faster way (the least of each way's last times)."""
        return min(self.recent[True]) < min(self.recent[False])
