"""Micro-batches of their own shapes on a mesh (pp=2 x dp=2, gloo) against the plain model.

What the mesh's data-parallel normalization does, checked here: in
GradientAccumulator, each replica passes ``num_items`` for its OWN
micro-batches (or none: its rows count); at the window's end gradients and
counts are summed over replicas and divided once by the global count, so the
window equals the plain model's loss over every replica's micro-batches,
divided by the total tokens (or rows) of both replicas. ``pipe.step`` alone
does not reduce over replicas: each replica's gradients are its own
micro-batches' loss divided by the ``num_items`` it was given.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distributed import varlen_worker as w
from tests.distributed.launch import launch

WORKER = Path(w.__file__)
# The p2p transport the workers get: PIPESCHED_P2P=ordered runs this suite under NCCL's rules.
MODE = "ordered" if os.environ.get("PIPESCHED_P2P", "").strip().lower() == "ordered" else "tagged"


def _window_grads(schedule: str, window: int, summed: bool) -> tuple[dict, float, int]:
    """The plain model's gradients of one window over both replicas' micro-batches."""
    plain = w.model()
    loss_fn = w.token_sum if summed else w.token_mean
    total, count, rows = 0.0, 0, 0
    for step in range(w.STEPS):
        for replica in range(w.DP):
            xs, ys, n = w.batches(schedule, window, step, replica)
            for x, y in zip(xs, ys, strict=True):
                total = total + loss_fn(plain(x), y) * (1 if summed else x.shape[0])
                rows += x.shape[0]
            count += n if summed else sum(x.shape[0] for x in xs)
    (total / count).backward()
    grads = {name: p.grad for name, p in plain.named_parameters()}
    return grads, float(total.detach() / count), rows


def _step_grads(schedule: str, replica: int) -> dict:
    plain = w.model()
    xs, ys, n = w.batches(schedule, 2, 0, replica)
    (sum(w.token_sum(plain(x), y) for x, y in zip(xs, ys, strict=True)) / n).backward()
    return {name: p.grad for name, p in plain.named_parameters()}


def _close(got: dict, want: dict, where: str) -> None:
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-10, atol=1e-13, msg=f"{where}: {name}")


def test_each_replica_s_own_shapes_equal_the_plain_model_on_every_schedule(tmp_path):
    exits = launch("varlen", w.PP * w.DP, tmp_path, timeout=240, worker=WORKER)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(w.PP * w.DP)]
    for result in ranks:  # pp ranks given other row counts: all refuse, then step on
        assert "micro-batches' losses otherwise than pp rank 0" in result["disagree"]["refused"]
        # Before, silent: a rank given another batch of the same sizes trained on it.
        assert "pp rank 1 was given another batch" in result["disagree"]["other batch"]
        assert result["disagree"]["then"] > 0
    for schedule in w.SCHEDULES:
        seen: set[str] = set()
        for window, summed in enumerate((True, False)):
            want, loss, rows = _window_grads(schedule, window, summed)
            for rank, result in enumerate(ranks):
                record = result[schedule]
                where = f"{schedule}, window {window}, rank {rank}"
                _close(record["grads"][window], want, where)
                seen |= set(record["grads"][window])
                window_loss, effective_batch = record[f"window{window}"]
                assert abs(window_loss - loss) <= 1e-12 * abs(loss), where
                assert effective_batch == rows, where
        assert seen == set(want)  # every parameter lives on some rank
        for rank, result in enumerate(ranks):
            record = result[schedule]
            replica = rank // w.PP
            _close(record["step_grads"], _step_grads(schedule, replica), f"{schedule} step {rank}")
            # every receiving rank was told of new layouts; every receive was posted ahead
            assert record["receives"] == (0, 0)
            notices, last_step = record["notices"]
            assert notices > 0
            mode = "ordered" if MODE == "ordered" or schedule in w.EXACT else "tagged"
            assert record["mode"] == mode, (schedule, rank)
            # tagged: receive buffers as large as each channel's largest message so far;
            # ordered: layouts known per micro-batch input shapes. Either way the last
            # step, of shapes and sizes seen in the first window, sends no notice.
            assert last_step == 0, (schedule, rank, last_step)
