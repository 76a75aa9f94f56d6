"""The distributed runtime under NCCL's matching rules on gloo (``PIPESCHED_P2P=ordered``).

Every built-in schedule and a user's Schedule read from CSV, at pp=2 and
pp=4, each with dp=2, train as the single-process model does while
every message is sent under one tag and matched by posting order. And the
mode bites: one rank posting two receives out of the agreed order fails
the step under ordered, while the same misordering under the default tagged
transport (which matches by tag) still trains right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched import get_schedule
from pipesched.errors import ConfigError
from tests.distributed import ordered_worker as w
from tests.distributed.launch import Exit, launch

WORKER = Path(w.__file__)
BUILT_IN = [name for name in w.SCHEDULES if name != "csv"]


def _reference(dp: int, rows: tuple[int, ...]) -> tuple[nn.Module, list[float], list[float]]:
    """The whole MLP in one process, each window on every step's data from every replica."""
    model = w.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for window in range(w.WINDOWS):
        batches = [
            w.data(window, step, replica, rows[replica])
            for step in range(w.STEPS)
            for replica in range(dp)
        ]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return model, losses, norms


def _check_trained(record: dict, reference: tuple, mode: str, where: str) -> set[str]:
    """One rank's record of one schedule against the reference: the names it holds."""
    model, losses, norms = reference
    expected = dict(model.named_parameters())
    assert record["mode"] == mode, where
    stats = record["stats"]  # every receive posted ahead by the plan, and read
    assert (stats["unplanned"], stats["unread"]) == (0, 0), (where, stats)
    for name, value in record["params"].items():
        torch.testing.assert_close(
            value, expected[name], rtol=1e-12, atol=1e-14, msg=f"{where}: {name}"
        )
    assert record["window_losses"] == pytest.approx(losses, rel=1e-12), where
    assert record["norms"] == pytest.approx(norms, rel=1e-12), where
    return set(record["params"])


def _tail(exits: list[Exit]) -> str:
    return "\n".join(
        f"--- rank {e.rank} exited {e.code} (None: still running at the deadline, killed):\n"
        f"{e.output[-2500:]}"
        for e in exits
    )


@pytest.mark.parametrize("pp", [2, 4])
def test_the_user_schedule_differs_from_every_built_in_one(pp):
    user = w.user_schedule(pp).to_csv()
    for name in BUILT_IN:
        try:
            built = get_schedule(name, pp, w.CHUNKS).to_csv()
        except ConfigError:  # needs more stages than pp
            continue
        assert built != user, name
    for name in ("interleaved-1f1b", "zb-v"):  # these run 2 stages per worker
        assert get_schedule(name, 2 * pp, w.CHUNKS).num_workers == pp


@pytest.mark.parametrize("scenario", list(w.SCENARIOS))
def test_every_schedule_under_ordered_equals_the_single_process_reference(
    scenario, tmp_path, monkeypatch
):
    monkeypatch.setenv("PIPESCHED_P2P", "ordered")
    pp, dp = w.SCENARIOS[scenario]
    world = pp * dp
    exits = launch(scenario, world, tmp_path, timeout=240, worker=WORKER)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{_tail(exits)}"
    reference = _reference(dp, w.ROWS)
    names = {n for n, _ in reference[0].named_parameters()}
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for schedule in w.SCHEDULES:
        seen: set[str] = set()
        for rank, result in enumerate(ranks):
            record = result[schedule]
            assert record["num_stages"] == w.spec(schedule, pp)[1]
            seen |= _check_trained(record, reference, "ordered", f"{schedule}, rank {rank}")
        assert seen == names, schedule  # every parameter lives on some rank


def test_a_misordered_posting_fails_under_ordered(tmp_path, monkeypatch):
    """pp rank 1 posts two receives from pp rank 0 in swapped order: the step must stop."""
    monkeypatch.setenv("PIPESCHED_P2P", "ordered")
    exits = launch("misordered", 2, tmp_path, timeout=60, worker=WORKER)
    hung = [e.rank for e in exits if e.code is None]
    outcome = f"ranks {hung} hung until the 60 s deadline (killed)" if hung else "every rank failed"
    for e in exits:  # hangs-or-fails: never a clean exit with swapped tensors
        assert e.code != 0, f"rank {e.rank} exited 0 ({outcome}):\n{_tail(exits)}"
    assert not list(tmp_path.glob("rank*.pt")), f"a rank finished training ({outcome})"
    # Today it fails fast, and the receiving rank reads the header of the wrong message.
    assert not hung, f"{outcome}: expected every rank to fail fast\n{_tail(exits)}"
    expected = "received stage 1's input for micro-batch 2 where stage 3's input for micro-batch 1"
    assert expected in exits[1].output, _tail(exits)
    assert "posted their transfers in different orders" in exits[1].output, _tail(exits)
    # Rank 0 is told why, not left guessing that its peer died.
    assert "RemoteError" in exits[0].output, _tail(exits)
    assert "posted their transfers in different orders" in exits[0].output, _tail(exits)


def test_the_same_misordering_under_tagged_trains_right(tmp_path, monkeypatch):
    """Tags match messages whatever the posting order: it is the mode that bites."""
    monkeypatch.setenv("PIPESCHED_P2P", "tagged")
    exits = launch("misordered", 2, tmp_path, timeout=60, worker=WORKER)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{_tail(exits)}"
    name, rows = w.MISORDERED
    reference = _reference(1, (rows,))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["swaps"] == []
    assert set(ranks[1]["swaps"]) == {"recv 3F1 from 0 <-> recv 1F2 from 0"}
    seen: set[str] = set()
    for rank, result in enumerate(ranks):
        seen |= _check_trained(result[name], reference, "tagged", f"{name}, rank {rank}")
    assert seen == {n for n, _ in reference[0].named_parameters()}
