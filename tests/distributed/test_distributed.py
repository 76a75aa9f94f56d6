"""The distributed runtime on 2 and 4 gloo processes against one process (INVARIANTS 20-22)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched.schedule import Action, Timeline
from tests.distributed import worker
from tests.distributed.launch import launch


def _reference(scenario: str) -> tuple[nn.Module, list[float], list[float]]:
    """The whole model in one process, trained on each window's data from every replica."""
    _, dp, _, _ = worker.SCENARIOS[scenario]
    model = worker.model_of(scenario)
    tokens = scenario in worker.TOKEN_SCENARIOS
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for window in range(worker.WINDOWS):
        batches = [
            (worker.tokens if tokens else worker.data)(window, step, replica)
            for step in range(worker.STEPS)
            for replica in range(dp)
        ]
        if scenario == "lazy":  # micro-batches of their own lengths
            pieces = [
                worker.token_pieces(window, step, replica)
                for step in range(worker.STEPS)
                for replica in range(dp)
            ]
            total = sum(
                worker.token_sum(model(x), y)
                for xs, ys, _ in pieces
                for x, y in zip(xs, ys, strict=True)
            )
            loss = total / sum(n for _, _, n in pieces)
        elif tokens:  # sequence lengths differ: sum per batch, divide once
            total = sum(worker.token_sum(model(x), y) for x, y, _ in batches)
            loss = total / sum(n for _, _, n in batches)
        else:
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return model, losses, norms


# Gradient all-reduces per rank and window (without dp: none), and how many of them
# start during the window's last step: one per stage (2 per rank when interleaved);
# traced: the stage's own bucket, then at the window's end the embedding tied across
# pp ranks, over dp and over its pp ranks.
BUCKETS = {"pp2dp2": (1, 1), "tokens": (2, 2), "traced": (3, 1), "lazy": (1, 0)}


@pytest.mark.parametrize(
    ("scenario", "world"),
    [
        ("pp2", 2),
        ("pp2dp2", 4),
        ("interleaved", 2),
        ("zbv", 2),
        ("tokens", 4),
        ("traced", 4),
        ("lazy", 2),
    ],
)
def test_two_windows_equal_the_single_process_reference(scenario, world, tmp_path):
    exits = launch(scenario, world, tmp_path, timeout=120)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    reference, losses, norms = _reference(scenario)
    expected = dict(reference.named_parameters())
    _, dp, _, _ = worker.SCENARIOS[scenario]
    seen = set()
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["foreign_devices"] in ([], ["meta"])  # other stages' tensors freed
        for name, value in result["params"].items():
            torch.testing.assert_close(
                value, expected[name], rtol=1e-12, atol=1e-14, msg=f"rank {rank}: {name}"
            )
            seen.add(name)
        assert result["window_losses"] == pytest.approx(losses, rel=1e-12)
        assert result["norms"] == pytest.approx(norms, rel=1e-12)
        # INVARIANT 20: one all-reduce per bucket per window; a stage's own parameters'
        # bucket starts as soon as the stage is done in the window's last step.
        per_window, overlapped = BUCKETS.get(scenario, (0, 0))
        assert result["all_reduces"] == worker.WINDOWS * per_window
        assert result["overlapped"] == worker.WINDOWS * overlapped
        # Every receive was posted ahead by the step's plan, and every posted one was read.
        assert result["receives"] == (0, 0)
    assert seen == set(expected)  # every parameter lives on some rank
    # pipe(x) under no_grad: the trained model's output on the last stage's rank.
    x = (worker.tokens if scenario in worker.TOKEN_SCENARIOS else worker.data)(
        worker.WINDOWS, 0, 0
    )[0]
    with torch.no_grad():
        plain_output = reference(x)
    outputs = [torch.load(tmp_path / f"rank{rank}.pt")["evaluated"] for rank in range(world)]
    assert all(torch.load(tmp_path / f"rank{r}.pt")["refused"] for r in range(world))
    # Every rank runs rank 0's cut, even where its own choice (or measurement) differed.
    assert len({tuple(torch.load(tmp_path / f"rank{r}.pt")["balance"]) for r in range(world)}) == 1
    given = [out for out in outputs if out is not None]
    assert len(given) == dp  # one rank of each replica holds the last stage (not always
    for out in given:  # the last rank: the V schedule puts it on pp rank 0)
        torch.testing.assert_close(out, plain_output, rtol=1e-12, atol=1e-14)
    # pp rank 0 of each replica gathered the last step's events of its whole pipeline.
    first = torch.load(tmp_path / "rank0.pt")
    own = sum(torch.load(tmp_path / f"rank{r}.pt")["own_events"] for r in range(world // dp))
    assert len(first["gathered"]) == own
    assert {worker_index for _, worker_index, _, _ in first["gathered"]} == set(range(world // dp))
    assert 0.0 <= min(begin for _, _, begin, _ in first["gathered"]) < 1.0  # one clock
    # predict() on each rank of a pipeline: the same whole step, from every rank's actions.
    predicted = {torch.load(tmp_path / f"rank{r}.pt")["predicted"] for r in range(world // dp)}
    assert len(predicted) == 1
    timeline = Timeline.from_json(predicted.pop())
    assert {e.action for e in timeline.events} == {Action(*a) for a, _, _, _ in first["gathered"]}
    assert timeline.breakdown is not None and "measured actions" in timeline.breakdown.source


def test_a_schedule_read_from_csv_runs_bitwise_as_the_named_one(tmp_path):
    results = {}
    for scenario in ("pp2", "csv"):
        (tmp_path / scenario).mkdir()
        exits = launch(scenario, 2, tmp_path / scenario, timeout=120)
        for e in exits:
            assert e.code == 0, f"{scenario} rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
        results[scenario] = [torch.load(tmp_path / scenario / f"rank{r}.pt") for r in range(2)]
    for named, given in zip(results["pp2"], results["csv"], strict=True):
        assert named["params"].keys() == given["params"].keys()
        assert all(torch.equal(named["params"][n], given["params"][n]) for n in named["params"])
        assert named["window_losses"] == given["window_losses"]


def test_an_exception_on_one_rank_stops_every_rank(tmp_path):
    exits = launch("raise", 2, tmp_path, timeout=60)
    for e in exits:
        assert e.code not in (0, None), f"rank {e.rank}: {e.code}\n{e.output[-2000:]}"
    assert "ValueError: boom in a stage" in exits[1].output
    assert "rank 1 (pp 1, dp 0) failed in action 1F2 (stage 1, micro-batch 2)" in exits[0].output


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins threads (Linux)")
def test_a_script_that_ends_right_after_a_step_exits_cleanly(tmp_path):
    """No gloo thread is left to free a step's tensors while the interpreter exits."""
    exit_worker = Path(__file__).with_name("exit_worker.py")  # a script: not imported
    exits = launch("exit", 2, tmp_path, timeout=90, worker=exit_worker, fresh=True)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-2000:]}"


def test_an_exception_on_one_replica_is_named_on_the_other(tmp_path):
    exits = launch("raise-replica", 4, tmp_path, timeout=90)
    for e in exits:
        assert e.code not in (0, None), f"rank {e.rank}: {e.code}\n{e.output[-2000:]}"
    assert "ValueError: boom in a stage" in exits[3].output
    # Replica 0's steps ran; it reads why replica 1 stopped from the job's store, which rank 0
    # holds (rank 1 may find it gone: a RemoteError still, without the cause).
    assert "rank 3 (pp 1, dp 1) failed in action" in exits[0].output, exits[0].output[-3000:]
    assert "RemoteError" in exits[1].output, exits[1].output[-3000:]


def test_replicas_of_other_models_are_refused_on_every_rank_at_the_build(tmp_path):
    """Replicas' weights are made replica 0's at the build; before, shapes that differ would
    have stopped gloo with a process abort. Now every rank refuses, naming the replica."""
    exits = launch("wider-replica", 4, tmp_path, timeout=90)
    for e in exits:
        assert e.code not in (0, None), f"rank {e.rank}: {e.code}\n{e.output[-2000:]}"
    assert "replica 1 of pp rank 0 holds other stages than replica 0" in exits[0].output
    assert "shape [9, 6] torch.float64 against shape [8, 6] torch.float64" in exits[2].output
    assert "replica 1 of pp rank 1" not in exits[1].output  # pp rank 1's stages agree
    assert exits[1].code not in (0, None)


def test_a_hung_replica_is_told_to_the_others_within_the_timeout(tmp_path):
    """Before, replica 0 waited in the gradients' all-reduce for torch's default 30 minutes
    (a DeviceMesh's groups do not take init_mesh's timeout), whatever timeout was set."""
    exits = launch("hung-replica", 4, tmp_path, timeout=80)
    for e in exits[:2]:  # replica 0's ranks: rank 1 waits in the window's all-reduce
        waited = float(e.output.split("stopped after ")[1].split(" s")[0])
        assert e.code not in (0, None) and "RemoteError" in e.output
        assert waited < 15, e.output[-2000:]  # timeout=5, and rank 3 hangs for 20 s


def test_a_rank_killed_in_its_window_end_is_a_remote_error_naming_it(tmp_path):
    # The window end's agreement runs over the pipeline's own group: a lost rank is
    # explained as in a step, not a raw gloo error.
    exits = launch("window-kill", 2, tmp_path, timeout=60)
    assert exits[1].code == -9  # SIGKILL
    assert exits[0].code not in (0, None), exits[0].output[-2000:]
    assert "RemoteError" in exits[0].output, exits[0].output[-2000:]
    assert "lost pp rank 1" in exits[0].output, exits[0].output[-2000:]
    assert "to end the window" in exits[0].output, exits[0].output[-2000:]


def test_a_killed_rank_makes_the_others_exit_with_a_clear_error(tmp_path):
    exits = launch("kill", 3, tmp_path, timeout=60)
    assert exits[1].code == -9  # SIGKILL
    for e in (exits[0], exits[2]):
        assert e.code not in (0, None), f"rank {e.rank} did not stop:\n{e.output[-2000:]}"
        assert "lost pp rank 1" in e.output, e.output[-2000:]
