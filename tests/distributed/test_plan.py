"""``Pipeline(schedule="auto")`` on 2 gloo processes: every rank builds rank 0's pick."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from tests.distributed.launch import launch

PLAN_WORKER = Path(__file__).with_name("plan_worker.py")


def _worker():
    spec = importlib.util.spec_from_file_location("plan_worker", PLAN_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ranks_build_rank_0s_plan_and_train_like_the_model(tmp_path):
    exits = launch("auto", 2, tmp_path, timeout=120, worker=PLAN_WORKER)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0]["pick"] == results[1]["pick"] == results[0]["built"] == results[1]["built"]
    # Alone, rank 1 (whose second layer is slow) plans otherwise: the agreement mattered.
    assert results[1]["own"] != results[0]["pick"]
    worker = _worker()
    model = worker.model(0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(worker.STEPS):
        x, y = worker.batch(step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    expected = dict(model.named_parameters())
    seen = set()
    for r in results:
        assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(r["losses"], losses, strict=True))
        for name, value in r["params"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-12, atol=1e-14)
            seen.add(name)
    assert seen == set(expected)
