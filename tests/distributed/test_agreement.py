"""Across ranks: a step's shape is agreed, failures and timeouts are named (INVARIANTS 26, 29).

Each test runs tests/distributed/agreement_worker.py on 2 gloo processes,
bounded by a deadline far below the process group's timeout where that
matters, and reads what each rank's own ``except`` block saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.distributed import agreement_worker
from tests.distributed.launch import Exit, launch

WORKER = Path(agreement_worker.__file__)


def _run(scenario: str, tmp_path: Path, timeout: float) -> list[dict[str, Any]]:
    exits = launch(scenario, 2, tmp_path, timeout=timeout, worker=WORKER)
    _check_exits(exits)
    return [json.loads((tmp_path / f"rank{e.rank}.json").read_text()) for e in exits]


def _check_exits(exits: list[Exit]) -> None:
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"


def test_ranks_with_different_batch_sizes_fail_together_within_seconds(tmp_path):
    """The mesh's timeout is 600 s; both ranks name the mismatch in seconds, and go on."""
    ranks = _run("sizes", tmp_path, timeout=90)
    for rank, seen in enumerate(ranks):
        for call in ("step", "eval"):
            error = seen[call]
            assert error is not None, f"rank {rank}: {call} did not fail"
            assert error["type"] == "ConfigError", error
            assert error["elapsed"] < 20, error
            assert "pp rank 0 has 4 micro-batches, pp rank 1 has 3" in error["message"]
            assert "same size" in error["message"]
        # Nothing crossed before the check: the pipeline still runs a matching step.
        assert seen["then"] == ranks[0]["then"]


def test_a_hung_peer_is_reported_as_a_timeout_not_as_dead(tmp_path):
    ranks = _run("hung", tmp_path, timeout=90)
    waiting = ranks[0]["error"]  # stage 0 waits for stage 1's gradient
    assert waiting is not None and waiting["type"] == "RemoteError", waiting
    message = waiting["message"]
    assert f"did not answer within {agreement_worker.HUNG_TIMEOUT} s" in message, message
    assert "init_mesh(" in message and "timeout=" in message  # how to change it
    assert "died" not in message
    assert waiting["attributes"]["kind"] == "timeout"
    assert waiting["attributes"]["pp_rank"] == 1  # the rank that did not answer
    assert waiting["elapsed"] < agreement_worker.HUNG_SLEEP - 5
    # The hung rank, once awake, stops too (rank 0, which hosts the store here, is gone).
    assert ranks[1]["error"]["type"] == "RemoteError", ranks[1]["error"]


def test_none_between_ranks_is_refused_with_one_consistent_message(tmp_path):
    ranks = _run("none", tmp_path, timeout=60)
    sender, receiver = ranks[0]["error"], ranks[1]["error"]
    assert sender["type"] == "ConfigTypeError", sender  # a value of the wrong type
    assert receiver["type"] == "RemoteError", receiver
    assert receiver["attributes"]["error_type"] == "ConfigTypeError"
    for message in (sender["message"], receiver["message"]):
        assert "stage 0 returned None" in message, message
        assert "a bare None" in message, message
        assert "(and None" not in message  # the old text allowed None, then refused it


def test_after_a_failure_the_users_except_block_sees_the_error_and_the_group(tmp_path):
    ranks = _run("except", tmp_path, timeout=90)
    for rank, seen in enumerate(ranks):
        error = seen["error"]
        assert error["get_rank"] == rank and error["get_world_size"] == 2
        assert seen["group_answers"] is True  # the default process group still works
        again = seen["again"]  # the failed pipeline refuses its next step, saying why
        assert again["type"] == "RemoteError" and "stopped after a failed step" in again["message"]
        assert "boom in a stage" in again["message"]
        assert again["attributes"]["action"] == "1F2"
    assert ranks[0]["fresh_loss"] == ranks[1]["fresh_loss"] > 0  # a new pipeline runs
    failing, other = ranks[1]["error"], ranks[0]["error"]
    assert failing["type"] == "ValueError" and "boom in a stage" in failing["message"]
    assert other["type"] == "RemoteError"
    assert other["attributes"] == {
        "rank": 1,
        "pp_rank": 1,
        "dp_rank": 0,
        "action": "1F2",
        "error_type": "ValueError",
        "error_message": "boom in a stage",
        "kind": "error",
    }
    assert "ValueError: boom in a stage" in other["message"]


def test_ranks_run_with_pp_rank_0s_seed_whatever_their_generators(tmp_path):
    ranks = _run("seed", tmp_path, timeout=90)
    assert len(ranks[0]["seeds"]) == 2
    assert ranks[0]["seeds"] == ranks[1]["seeds"]
    assert ranks[0]["seeds"][0] != ranks[0]["seeds"][1]  # a new seed each step


def test_a_step_after_destroy_process_group_says_so_not_that_a_rank_died(tmp_path):
    """Issue 25 item 10: the next step said the other rank "died"."""
    for rank, seen in enumerate(_run("destroyed", tmp_path, timeout=60)):
        error = seen["error"]
        assert error is not None and error["type"] == "ConfigError", (rank, error)
        assert "destroy_process_group()" in error["message"], error
        assert "died" not in error["message"], error
        assert error["elapsed"] < 20, error
