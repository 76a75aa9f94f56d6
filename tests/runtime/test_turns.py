"""Workers taking turns (held hand-offs) and kept between steps: same results, no hang."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.mailbox import Aborted, Mailbox
from pipesched.runtime.turns import Turns
from pipesched.schedule import FORWARD
from pipesched.schedule.dataflow import Message


class _Always:
    """A turns policy that always answers ``turns``."""

    def __init__(self, turns: bool) -> None:
        self.turns = turns

    def choose(self, forward_only: bool) -> bool:
        return self.turns

    def measured(self, *args: object) -> None:
        pass


def _run(schedule: str, stages: int, workers: int, turns: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.2), nn.Tanh()) for _ in range(stages)]
    model = nn.Sequential(*layers).double()
    pipe = Pipeline(model, 5, balance=[1] * stages, devices=["cpu"] * workers, schedule=schedule)
    pipe.engine.runtime.turns = _Always(turns)  # type: ignore[union-attr]
    x, y = torch.randn(20, 6, dtype=torch.float64), torch.randn(20, 6, dtype=torch.float64)
    losses = [pipe.step(x, y, loss_fn=nn.functional.mse_loss) for _ in range(2)]
    with torch.no_grad():
        out = pipe(x)
    return [*losses, out, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize(
    ("schedule", "stages", "workers"),
    [("1f1b", 2, 2), ("gpipe", 3, 3), ("zb-h1", 2, 2), ("zb-v", 4, 2), ("interleaved-1f1b", 4, 2)],
)
def test_taking_turns_gives_bitwise_the_same_step(schedule, stages, workers):
    free = _run(schedule, stages, workers, turns=False)
    held = _run(schedule, stages, workers, turns=True)
    assert all(torch.equal(a, b) for a, b in zip(free, held, strict=True))


def test_a_failing_worker_releases_the_others_while_they_take_turns():
    class Fail(nn.Module):
        def forward(self, x):
            if x.shape[0] == 4:  # the last micro-batch (20 rows cut in 5 and 4)
                raise ValueError("boom")
            return x

    model = nn.Sequential(nn.Linear(3, 3), Fail())
    pipe = Pipeline(model, 2, balance=[1, 1], devices=["cpu", "cpu"], schedule="1f1b")
    pipe.engine.runtime.turns = _Always(True)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="boom"):
        pipe.step(torch.randn(9, 3), loss_fn=lambda y: y.sum())


def test_held_values_arrive_when_their_maker_would_wait():
    message = Message(FORWARD, 1, 0)
    box = Mailbox(hold=True)
    box.put(message, 1, "first", None)
    seen: list[str] = []

    def reader() -> None:
        seen.append(box.take(message, 0, None))

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(timeout=0.2)
    assert thread.is_alive() and not seen  # held: the maker has not waited yet
    with pytest.raises(Aborted):  # the maker waits: what it holds goes first
        threading.Timer(0.2, box.abort).start()
        box.get(0, "never")
    thread.join(timeout=5)
    assert seen == ["first"]


def _steps(turns: Turns, times: dict[bool, float], count: int, cores: float = 1.0) -> str:
    """The ways ``turns`` picks over ``count`` steps whose times per action are ``times``."""
    picked = ""
    for _ in range(count):
        way = turns.choose(False)
        picked += "T" if way else "f"
        turns.measured(False, way, times[way], cores if not way else 1.0)
    return picked


def test_turns_are_measured_both_ways_then_the_faster_is_kept_and_checked_ever_more_rarely():
    turns = Turns()
    picked = _steps(turns, {True: 1.0, False: 2.0}, 60)
    assert picked.startswith("ffT" + "T" * 8 + "f")  # warm-up, each way once, then a check
    assert picked.count("f") == 2 + 2  # checks after 8 steps, then 16, 32, ...
    turns = Turns()
    assert _steps(turns, {True: 2.0, False: 1.0}, 12) == "ffT" + "f" * 8 + "T"


def test_turns_are_not_tried_where_the_workers_overlap():
    turns = Turns()
    assert _steps(turns, {True: 0.5, False: 1.0}, 12, cores=1.9) == "f" * 12


def test_a_way_that_became_faster_is_taken_at_its_check():
    turns = Turns()
    _steps(turns, {True: 1.0, False: 2.0}, 11)
    assert _steps(turns, {True: 1.0, False: 0.5}, 3) == "fff"  # the check wins: kept


def test_worker_threads_are_kept_between_steps_and_end_with_their_pipeline():
    import gc

    seen: list[tuple[int, str]] = []

    class Spy(nn.Module):
        def forward(self, x):
            me = threading.current_thread()
            seen.append((me.ident, me.name))
            return x

    before = set(threading.enumerate())
    pipe = Pipeline(nn.Sequential(nn.Linear(3, 3), Spy()), 2, balance=[1, 1], devices=["cpu"] * 2)
    for _ in range(3):
        pipe.step(torch.randn(4, 3), loss_fn=lambda y: y.sum())
    assert len({ident for ident, _ in seen}) == 1 and {name for _, name in seen} == {
        "pipesched-worker-1"
    }
    assert not [t for t in threading.enumerate() if t.name.startswith("pipesched-worker")]
    kept = [t for t in set(threading.enumerate()) - before if t.name == "pipesched-idle"]
    assert len(kept) == 2
    del pipe
    gc.collect()
    for thread in kept:
        thread.join(timeout=5)
        assert not thread.is_alive()


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux only")
def test_workers_taking_turns_share_one_cpu_for_the_step_only():
    import os

    seen: list[set[int]] = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))  # a step needs something to train

        def forward(self, x):
            seen.append(os.sched_getaffinity(0))
            return x * self.w

    everywhere = os.sched_getaffinity(0)
    pipe = Pipeline(nn.Sequential(Spy(), Spy()), 2, balance=[1, 1], devices=["cpu"] * 2)
    pipe.engine.runtime.turns = _Always(True)  # type: ignore[union-attr]
    pipe.step(torch.randn(4, 3), loss_fn=lambda y: y.sum())
    if len(everywhere) > 1 and seen[0] != everywhere:  # pinned (sched_getcpu available)
        assert all(len(cpus) == 1 for cpus in seen) and len({min(c) for c in seen}) == 1
    pipe.engine.runtime.turns = _Always(False)  # type: ignore[union-attr]
    seen.clear()
    pipe.step(torch.randn(4, 3), loss_fn=lambda y: y.sum())
    assert all(cpus == everywhere for cpus in seen)  # the kept threads run anywhere again


def test_a_pick_made_on_a_lucky_measurement_is_undone_within_three_steps():
    turns = Turns()
    picked = ""
    for step in range(10):
        way = turns.choose(False)
        picked += "T" if way else "f"
        lucky = way and step == 2  # the first measurement with turns: noise made it fast
        turns.measured(False, way, 0.5 if lucky else (2.0 if way else 1.0), 1.0)
    assert picked == "ffT" + "TTT" + "ffff"
