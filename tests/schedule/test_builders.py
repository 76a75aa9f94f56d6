"""Each builder against a literal table, and get_schedule's argument checks."""

from __future__ import annotations

import pytest

from pipesched import ConfigError
from pipesched.schedule import SCHEDULES, Schedule, get_schedule, stages_per_worker

# (name, num_stages, num_microbatches) -> each worker's row, as Schedule.to_csv writes it.
TABLES = {
    ("gpipe", 3, 2): """
        0F0,0F1,0B0,0B1
        1F0,1F1,1B0,1B1
        2F0,2F1,2B0,2B1
    """,
    # Warm-up p-1-s forwards, then F/B pairs, then the remaining backwards.
    ("1f1b", 3, 4): """
        0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3
        1F0,1F1,1B0,1F2,1B1,1F3,1B2,1B3
        2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3
    """,
    # m < p: the warm-up shortens to m and the schedule still runs.
    ("1f1b", 4, 2): """
        0F0,0F1,0B0,0B1
        1F0,1F1,1B0,1B1
        2F0,2F1,2B0,2B1
        3F0,3B0,3F1,3B1
    """,
    # Megatron's order: rounds of p=2 micro-batches per stage, warm-up (v-1)p + 2(p-1-w).
    ("interleaved-1f1b", 4, 4): """
        0F0,0F1,2F0,2F1,0F2,2B0,0F3,2B1,2F2,0B0,2F3,0B1,2B2,2B3,0B2,0B3
        1F0,1F1,3F0,3B0,3F1,3B1,1F2,1B0,1F3,1B1,3F2,3B2,3F3,3B3,1B2,1B3
    """,
    # m=5 on 2 workers (torch rejects it): two rounds, [0,1,2] and [3,4]; warm-up 3 + 2(p-1-w).
    ("interleaved-1f1b", 4, 5): """
        0F0,0F1,0F2,2F0,2F1,2F2,2B0,0F3,2B1,0F4,2B2,2F3,0B0,2F4,0B1,0B2,2B3,2B4,0B3,0B4
        1F0,1F1,1F2,3F0,3B0,3F1,3B1,3F2,3B2,1F3,1B0,1F4,1B1,3F3,1B2,3F4,3B3,3B4,1B3,1B4
    """,
    # Stage s delays its Ws by s backwards.
    ("zb-h1", 3, 4): """
        0F0,0F1,0F2,0B0,0W0,0F3,0B1,0W1,0B2,0W2,0B3,0W3
        1F0,1F1,1B0,1F2,1B1,1W0,1F3,1B2,1W1,1B3,1W2,1W3
        2F0,2B0,2F1,2B1,2F2,2B2,2W0,2F3,2B3,2W1,2W2,2W3
    """,
    # Worker 0 runs stages 0 and 3, worker 1 stages 1 and 2.
    ("zb-v", 4, 3): """
        0F0,0F1,0F2,3F0,3B0,3W0,3F1,3B1,3W1,0B0,0W0,3F2,3B2,3W2,0B1,0W1,0B2,0W2
        1F0,2F0,1F1,2F1,2B0,2W0,1F2,1B0,1W0,2F2,2B1,2W1,1B1,2B2,1B2,1W1,2W2,1W2
    """,
    # Warm-up up to 2p-1 forwards; Ws run where no B or F can, the last ones at the tail.
    ("zb-h2", 3, 4): """
        0F0,0F1,0F2,0F3,0B0,0W0,0B1,0W1,0B2,0W2,0B3,0W3
        1F0,1F1,1F2,1B0,1F3,1B1,1W0,1B2,1W1,1B3,1W2,1W3
        2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3,2W0,2W1,2W2,2W3
    """,
    # torch's ScheduleDualPipeV order, its overlapped F&B run as F, B, W (test_against_torch).
    ("dualpipev", 4, 4): """
        0F0,0F1,0F2,3F0,3B0,3W0,3F1,0F3,3B1,3W1,3F2,0B0,0W0,3B2,3W2,3F3,0B1,0W1,3B3,3W3,0B2,0W2,0B3,0W3
        1F0,2F0,1F1,2F1,1F2,2B0,2W0,2F2,1B0,1W0,1F3,2B1,2W1,2F3,1B1,1W1,2B2,2W2,1B2,1W2,2B3,1B3,2W3,1W3
    """,
    # The controllable-memory reference's orders (zbv_greedy.py, 'half' and 'min' for 3 ranks
    # and 3 micro-batches), ranks' types F f B b W w mapped onto stages w and 2p-1-w.
    ("v-half", 6, 3): """
        0F0,0F1,0F2,5F0,5B0,5W0,5F1,5B1,5W1,0B0,0W0,5F2,5B2,0B1,5W2,0W1,0B2,0W2
        1F0,1F1,4F0,4F1,4B0,4W0,1F2,4B1,1B0,4W1,1W0,4F2,1B1,4B2,4W2,1W1,1B2,1W2
        2F0,3F0,2F1,3F1,3B0,3W0,2B0,2W0,2F2,3F2,3B1,2B1,3W1,2W1,3B2,2B2,3W2,2W2
    """,
    ("v-min", 6, 3): """
        0F0,0F1,0F2,5F0,5B0,5W0,5F1,5B1,5W1,0B0,0W0,5F2,0B1,5B2,5W2,0W1,0B2,0W2
        1F0,1F1,4F0,4F1,4B0,4W0,1B0,1W0,4B1,1F2,4W1,4F2,1B1,1W1,4B2,4W2,1B2,1W2
        2F0,3F0,2F1,3F1,3B0,2B0,3W0,2W0,3B1,2F2,3F2,2B1,3W1,2W1,3B2,2B2,3W2,2W2
    """,
}


@pytest.mark.parametrize(("key", "table"), TABLES.items(), ids=[str(k) for k in TABLES])
def test_literal_table(key, table):
    expected = "".join(line.strip() + "\n" for line in table.strip().splitlines())
    schedule = get_schedule(*key)
    assert schedule.to_csv() == expected
    assert schedule.name == key[0]
    schedule.validate()


def test_placement():
    assert get_schedule("1f1b", 4, 8).placement == (0, 1, 2, 3)
    assert get_schedule("interleaved-1f1b", 6, 3).placement == (0, 1, 2, 0, 1, 2)
    assert get_schedule("interleaved-1f1b", 6, 3, virtual_stages=3).placement == (0, 1, 0, 1, 0, 1)
    assert get_schedule("zb-v", 6, 3).placement == (0, 1, 2, 2, 1, 0)
    assert get_schedule("zb-v", 6, 3).stages_of(0) == (0, 5)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_names_are_forgiving_about_case_and_underscores(name):
    v = stages_per_worker(name)
    assert get_schedule(name.upper().replace("-", "_"), 2 * v, 2).name == name


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown schedule 'pipedream'.*'gpipe'.*'zb-v'"):
        get_schedule("pipedream", 4, 4)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("num_stages", 0),
        ("num_stages", -2),
        ("num_microbatches", 0),
        ("num_microbatches", 2.5),
        ("num_microbatches", True),
    ],
)
def test_counts_must_be_positive_integers(name, arg, value):
    kwargs = {"num_stages": 4, "num_microbatches": 4, arg: value}
    with pytest.raises(ConfigError, match=f"{arg} must be a positive integer, got {value!r}"):
        get_schedule(name, kwargs["num_stages"], kwargs["num_microbatches"])


def test_virtual_stages_must_divide_stages():
    with pytest.raises(
        ConfigError, match=r"num_stages=7 is not divisible by virtual_stages=2.*6 or 8"
    ):
        get_schedule("interleaved-1f1b", 7, 4)
    with pytest.raises(ConfigError, match="virtual_stages must be a positive integer, got 0"):
        get_schedule("interleaved-1f1b", 8, 4, virtual_stages=0)


@pytest.mark.parametrize("name", ["zb-v", "dualpipev", "v-half", "v-min"])
def test_v_schedules_need_an_even_number_of_stages(name):
    with pytest.raises(ConfigError, match="num_stages must be even, got 5; use num_stages=4 or 6"):
        get_schedule(name, 5, 4)


@pytest.mark.parametrize("name", ["dualpipev", "v-half", "v-min"])
def test_v_placement(name):
    schedule = get_schedule(name, 6, 3)
    assert schedule.placement == (0, 1, 2, 2, 1, 0)
    assert stages_per_worker(name) == 2


@pytest.mark.parametrize(
    ("name", "v"),
    [("1f1b", 2), ("gpipe", 3), ("zb-h1", 2), ("zb-v", 3), ("zb-h2", 2), ("dualpipev", 3)],
)
def test_fixed_virtual_stages_are_checked(name, v):
    with pytest.raises(ConfigError, match=f"virtual_stages={v}.*interleaved-1f1b"):
        get_schedule(name, 6, 4, virtual_stages=v)
    assert get_schedule(name, 6, 4, virtual_stages=stages_per_worker(name)).num_stages == 6


def test_unknown_option():
    with pytest.raises(ConfigError, match=r"unknown options \['chunks'\]"):
        get_schedule("1f1b", 4, 4, chunks=8)


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        get_schedule("gpipe", 0, 1)


def test_builders_return_schedules():
    for name in SCHEDULES:
        assert isinstance(get_schedule(name, 4, 4), Schedule)
