"""The docs' pattern on a mesh, and a window end failing on one rank (2 gloo processes).

Issue 25 item 11: a traced model with its optimizer built before the first
call (examples/gpt2_pipeline.py) crashed ``acc.save()`` at pp=2 with
``KeyError: <id>`` on every rank: the first cut gave the other rank's layers
new (meta) Parameters, and the optimizer still held the old ones. Item 1 on
a mesh: rank 1's optimizer failing after stepping puts every rank's window
end back; ``flush()`` on every rank retries it, and the run ends equal to
the same training in one process (fp64).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipesched.train import export_model
from tests.distributed import window_worker as ww
from tests.distributed.launch import launch

WORKER = Path(ww.__file__)


def _reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    acc = ww.accumulator(ww.pipeline(None))
    ww.train(acc, range(steps))
    return {n: p.detach().clone() for n, p in acc.pipe.named_parameters()}


def test_an_optimizer_built_before_a_traced_models_first_call_saves_and_recovers(tmp_path):
    exits = launch("traced", 2, tmp_path, timeout=120, worker=WORKER)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    records = [torch.load(tmp_path / f"traced-rank{r}.pt") for r in range(2)]
    torch.set_default_dtype(torch.float64)
    try:
        saved, total = _reference(ww.SAVE_AT), _reference(ww.TOTAL)
    finally:
        torch.set_default_dtype(torch.float32)
    export_model(str(tmp_path / "ckpt"), str(tmp_path / "plain.pt"))
    exported = torch.load(tmp_path / "plain.pt")
    for name, value in saved.items():  # the checkpoint is the run's state
        torch.testing.assert_close(exported[name], value, rtol=1e-12, atol=1e-14, msg=name)
    assert "rank 1's optimizer failed" in records[1]["error"]
    assert records[0]["error"].startswith("RemoteError"), records[0]["error"]
    for rank, record in enumerate(records):
        assert record["pending"] and record["put_back"], rank
        assert record["counters"] == (ww.TOTAL, ww.TOTAL // 2)
        # The optimizer holds this rank's parameters only: the others' memory is freed.
        assert record["optimizer_holds_real"] == record["own"]
        for name, value in record["params"].items():
            torch.testing.assert_close(
                value, total[name], rtol=1e-12, atol=1e-14, msg=f"rank {rank}: {name}"
            )
