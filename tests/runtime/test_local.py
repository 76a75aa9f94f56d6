"""The local runtime's parts: worker threads, their inherited state, the mailbox, timelines."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from pipesched import Pipeline, Timeline
from pipesched.runtime.mailbox import Aborted, Mailbox
from pipesched.runtime.threads import ThreadState


class Record(nn.Module):
    """Records the thread it ran on and that thread's torch state."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, bool]] = []

    def forward(self, x):
        self.seen.append(
            (threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled())
        )
        return x


def test_one_thread_per_stage_on_one_device_with_threads_shared_out():
    first, second = Record(), Record()
    pipe = Pipeline(
        nn.Sequential(nn.Linear(3, 3), first, nn.Linear(3, 3), second),
        2,
        balance=[2, 2],
        devices=["cpu", "cpu"],
    )
    cores = torch.get_num_threads()
    pipe(torch.randn(4, 3))
    assert {name for name, _, _ in first.seen} == {"pipesched-worker-0"}
    assert {name for name, _, _ in second.seen} == {"pipesched-worker-1"}
    assert {n for _, n, _ in first.seen + second.seen} == {max(1, cores // 2)}
    assert torch.get_num_threads() == cores  # restored in the caller


def test_two_cpu_stages_overlap_in_time():
    class Sleep(nn.Module):
        def forward(self, x):
            time.sleep(0.02)  # releases the GIL, like a torch kernel
            return x

    pipe = Pipeline(
        nn.Sequential(nn.Linear(3, 3), Sleep(), nn.Linear(3, 3), Sleep()),
        8,
        balance=[2, 2],
        devices=["cpu", "cpu"],
        schedule="1f1b",
    )
    pipe.step(torch.randn(8, 3), torch.randn(8, 3), loss_fn=nn.functional.mse_loss)
    timeline = pipe.last_timeline
    assert isinstance(timeline, Timeline)
    # 16 forwards of 20 ms: serial would take 320 ms; pipelined about 9 x 20 ms.
    busy = sum(timeline.busy)
    assert timeline.makespan < 0.8 * busy


def test_grad_mode_reaches_the_workers():
    record = Record()
    pipe = Pipeline(
        nn.Sequential(nn.Linear(3, 3), record), 1, balance=[1, 1], devices=["cpu", "cpu"]
    )
    with torch.no_grad():
        pipe(torch.randn(2, 3))
    pipe(torch.randn(2, 3))
    assert [g for _, _, g in record.seen] == [False, True]


def test_thread_state_captures_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = ThreadState.capture(1)
    assert state.autocast == (("cpu", torch.bfloat16, torch.is_autocast_cache_enabled()),)
    assert ThreadState.capture(1).autocast == ()


def test_measured_timeline_has_every_action_in_order():
    pipe = Pipeline(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)),
        3,
        balance=[1, 1],
        devices=["cpu", "cpu"],
        schedule="zb-h1",
    )
    pipe.step(torch.randn(6, 3), torch.randn(6, 3), loss_fn=nn.functional.mse_loss)
    schedule = pipe.schedule_for(3)
    for w in range(2):
        events = pipe.last_timeline.worker_events(w)
        assert [e.action for e in events] == list(schedule.actions[w])
        assert all(e.start <= e.end for e in events)


def test_mailbox_hands_over_and_aborts():
    box = Mailbox()
    box.set(0, "b", 2)  # arrives first, kept for later
    box.set(0, "a", 1)
    assert box.get(0, "a") == 1
    assert box.get(0, "b") == 2
    errors = []

    def wait():
        try:
            box.get(0, "never")
        except Aborted:
            errors.append("aborted")

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.05)
    box.abort()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert errors == ["aborted"]
    with pytest.raises(Aborted):
        box.get(1, "later")


def test_measured_actions_exclude_the_wait_for_their_inputs():
    class Sleep(nn.Module):
        def forward(self, x):
            time.sleep(0.03)
            return x

    pipe = Pipeline(
        nn.Sequential(Sleep(), nn.Linear(3, 3)),
        4,
        balance=[1, 1],
        devices=["cpu", "cpu"],
        schedule="1f1b",
    )
    pipe.step(torch.randn(4, 3), torch.randn(4, 3), loss_fn=nn.functional.mse_loss)
    second = [e for e in pipe.last_timeline.worker_events(1) if e.action.kind == "F"]
    # Stage 1 waits ~30 ms for each input, but its own forward is a tiny Linear.
    assert max(e.duration for e in second) < 0.015
    assert pipe.last_timeline.idle[1] > 0.05
