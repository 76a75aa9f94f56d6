"""Tiny input, bounded work: sizes are checked against MAX_ACTIONS before anything is built.

Each test is a reproduction of issue 11, item 7: before the limits, these
inputs grew to gigabytes (``Schedule.from_csv`` of a four-cell row with
micro-batch 99999999 reached 21 GB in ``validate``), raised a raw
``ValueError``, or were accepted. An autouse fixture caps the address space
of the test process, so a regression fails with MemoryError instead of
eating the machine.
"""

from __future__ import annotations

import json
import resource
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipesched.analysis import compare
from pipesched.errors import ConfigError, ScheduleError
from pipesched.schedule import (
    MAX_ACTIONS,
    SCHEDULES,
    Action,
    Schedule,
    Timeline,
    get_schedule,
    stages_per_worker,
)

HEADROOM = 2 * 2**30  # bytes the guarded tests may grow by
FAST_S = 1.0  # a refusal is a few comparisons; this bound is generous


@pytest.fixture(autouse=True)
def bounded_memory() -> Iterator[None]:
    """Caps the address space at its size now plus HEADROOM for the test, then restores it."""
    status = Path("/proc/self/status")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if not status.exists():  # not Linux: run unguarded
        yield
        return
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmSize:"))
    cap = int(line.split()[1]) * 1024 + HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def refused(error: type[Exception], call: Callable[[], object]) -> str:
    """``call()`` raises ``error`` in well under a second; returns the message."""
    start = time.perf_counter()
    with pytest.raises(error) as info:
        call()
    elapsed = time.perf_counter() - start
    assert elapsed < FAST_S, f"the refusal took {elapsed:.2f} s"
    return str(info.value)


# Schedules read from text.


def test_the_issues_sparse_csv_is_refused_at_parse():
    # The issue's reproduction: before the limit, from_csv accepted this and validate grew to 21 GB.
    text = "0F0,0B0,0F99999999,0B99999999\n1F0,1B0,1F99999999,1B99999999\n"
    message = refused(ScheduleError, lambda: Schedule.from_csv(text))
    assert message.startswith("line 1: action '0F99999999' has micro-batch index 99999999")
    assert f"limit of {MAX_ACTIONS} actions" in message


def test_sparse_csv_over_the_cap_is_refused_by_the_count_it_implies():
    # Every index is below MAX_ACTIONS, but together they imply 8000000 actions from 8 cells.
    last = MAX_ACTIONS - 1
    text = f"0F0,0B0,0F{last},0B{last}\n1F0,1B0,1F{last},1B{last}\n"
    message = refused(ScheduleError, lambda: Schedule.from_csv(text))
    assert f"line 1: 0F{last} has micro-batch index {last}" in message
    total = MAX_ACTIONS * 2 * 2
    assert f"{MAX_ACTIONS} micro-batches x 2 stages x 2 kinds = {total} actions" in message
    assert "but only 8 are listed" in message
    assert f"limit of {MAX_ACTIONS} actions" in message


def test_sparse_lists_name_the_worker_row():
    rows = [["0F0", "0B0", "0F999999", "0B999999"], ["1F0", "1B0"]]
    message = refused(ScheduleError, lambda: Schedule.from_lists(rows))
    assert "worker 0: 0F999999 has micro-batch index 999999" in message
    assert "but only 6 are listed" in message
    assert f"limit of {MAX_ACTIONS} actions" in message


def test_sparse_text_under_the_cap_is_refused_by_the_count_it_lists():
    # 200000 actions would fit the cap, but the text lists 4 of them: an index typo.
    message = refused(ScheduleError, lambda: Schedule.from_csv("0F0,0B0,0F99999,0B99999"))
    assert "line 1: 0F99999 has micro-batch index 99999" in message
    assert "= 200000 actions" in message
    assert "but only 4 are listed" in message


def test_a_huge_stage_index_is_named_with_its_line_counting_comments_and_blanks():
    # Before: the "stages [...] have no actions" check listed 10**8 stages (gigabytes).
    text = "0F0,0B0\n# a comment\n\n999999F0,999999B0\n"
    message = refused(ScheduleError, lambda: Schedule.from_csv(text))
    assert "line 4: 999999F0 has stage index 999999" in message
    assert f"limit of {MAX_ACTIONS} actions" in message
    assert len(message) < 1000


def test_an_absurd_index_is_named_with_its_line_not_a_raw_value_error():
    # Before: int() of 5000 digits raised Python's own ValueError (int max str digits).
    text = "0F0,0B0\n0F" + "9" * 5000 + "\n"
    message = refused(ScheduleError, lambda: Schedule.from_csv(text))
    assert message.startswith("line 2: ")
    assert "micro-batch index 999999999999... (5000 digits)" in message
    assert f"limit of {MAX_ACTIONS} actions" in message
    assert len(message) < 1000


def test_a_negative_index_is_named_with_its_line():
    message = refused(ScheduleError, lambda: Schedule.from_csv("0F0,0B0\n1F0,1B0,-1F0\n"))
    assert message.startswith("line 2: action '-1F0'")
    assert "from 0" in message


@pytest.mark.parametrize(
    ("text", "index"),
    [(f"0F{MAX_ACTIONS}", "micro-batch index"), (f"{MAX_ACTIONS}B0", "stage index")],
)
def test_action_parse_refuses_an_index_no_schedule_can_reach(text, index):
    message = refused(ScheduleError, lambda: Action.parse(text))
    assert f"{index} {MAX_ACTIONS}" in message
    assert f"limit of {MAX_ACTIONS} actions" in message
    assert Action.parse(f"0F{MAX_ACTIONS - 1}") == Action(0, "F", MAX_ACTIONS - 1)


# Schedules built in code.


def test_the_constructor_refuses_the_size_it_implies():
    one = ((Action(0, "F", 0), Action(0, "B", 0)),)
    m = MAX_ACTIONS // 2  # 1 stage x m x 2 kinds = MAX_ACTIONS: the largest allowed
    assert Schedule(one, (0,), m).num_microbatches == m
    message = refused(ScheduleError, lambda: Schedule(one, (0,), m + 1))
    assert f"{m + 1} micro-batches x 1 stages x 2 kinds = {2 * m + 2} actions" in message
    assert f"exceeds pipesched's limit of {MAX_ACTIONS} actions" in message


def test_validate_of_a_sparse_schedule_under_the_cap_lists_missing_actions_in_little_memory():
    # Before: validate built the list of every missing action (a million here) to show 12.
    m = MAX_ACTIONS // 2
    row = tuple(Action(0, kind, i) for i in (0, m - 1) for kind in "FB")
    schedule = Schedule((row,), (0,), m)
    get_schedule("1f1b", 2, 2).validate()  # imports networkx first, outside the measure
    tracemalloc.start()
    try:
        message = refused(ScheduleError, schedule.validate)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"validate allocated {peak / 2**20:.0f} MB to report 4 actions"
    assert "missing: 0F1 0B1 0F2 0B2" in message
    assert f"... and {2 * m - 4 - 12} more" in message


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_builders_refuse_before_allocating(name):
    v = stages_per_worker(name)
    kinds = 3 if get_schedule(name, 2 * v, 1).split_backward else 2
    total = 10**6 * 4 * v * kinds
    message = refused(ConfigError, lambda: get_schedule(name, 4 * v, 10**6))
    assert message.startswith(f"{name}: a schedule of 1000000 micro-batches x {4 * v} stages")
    assert (
        f"x {kinds} kinds = {total} actions exceeds pipesched's limit of {MAX_ACTIONS}" in message
    )


def test_zb_v_refuses_the_work_of_its_order_not_only_the_actions_it_keeps():
    # 1000 workers, 1 micro-batch keeps 6000 actions, but the order is built for 1999
    # micro-batches first: 12 million actions. Before: gigabytes.
    message = refused(ConfigError, lambda: get_schedule("zb-v", 2000, 1))
    assert "built for 2p - 1 = 1999 micro-batches" in message
    assert f"= 11994000 actions exceeds pipesched's limit of {MAX_ACTIONS} actions" in message
    assert get_schedule("zb-v", 2 * 64, 8).num_microbatches == 8  # 64 workers: 0.15M made


def test_compare_refuses_non_positive_counts_instead_of_n_a_rows():
    message = refused(ConfigError, lambda: compare(0, 8))
    assert "num_workers must be a positive integer, got 0" in message
    message = refused(ConfigError, lambda: compare(4, -1))
    assert "num_microbatches must be a positive integer, got -1" in message


def test_compare_refuses_a_huge_size_before_building_any_schedule():
    message = refused(ConfigError, lambda: compare(4, 10**6))
    assert "1000000 micro-batches" in message
    assert f"limit of {MAX_ACTIONS} actions" in message


# Timelines read from JSON.


def _timeline_json(placement: list[int], events: list[list[object]]) -> str:
    return json.dumps(
        {"format": "pipesched.timeline", "version": 1, "placement": placement, "events": events}
    )


def test_timeline_json_refuses_a_worker_index_beyond_the_stages():
    # Before: accepted, and num_workers became 10**8 (render_timeline draws a row per worker).
    text = _timeline_json([0, 99999999], [])
    message = refused(ConfigError, lambda: Timeline.from_json(text))
    assert "worker 99999999" in message
    assert "2 stages" in message


def test_timeline_json_refuses_an_absurd_event_index_as_a_config_error():
    # Before: Python's own ValueError (int max str digits) escaped.
    text = _timeline_json([0], [["0F" + "9" * 5000, 0, 0.0, 1.0]])
    message = refused(ConfigError, lambda: Timeline.from_json(text))
    assert f"limit of {MAX_ACTIONS} actions" in message
    assert len(message) < 1000
