"""A weight tied between the first and last layer, whole on one rank or split over two.

Sharded checkpoints saved at each layout (one process; pp=2 under ``1f1b``, the
tie split over the pp ranks; under ``zb-v``, whole on pp rank 0; pp=2 x dp=2)
resume at every other (one process; pp=2 under each schedule; pp=2 x dp=2), and
two windows later every rank's parameters, both copies of the tied weight
included, equal the plain model trained uninterrupted (fp64, AdamW, clipping):
each copy got its optimizer state, found under any name of the tie. A
checkpoint lacking a parameter's optimizer entries is refused on every rank,
unchanged. Sharded data parallel (FSDP2) with the tie whole on one rank
(``zb-v``) or split (``1f1b``) trains as the plain model does.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed import tied_worker as w
from tests.distributed.launch import launch

WORKER = Path(w.__file__)


@functools.cache
def _plain(clip: float = w.CLIP) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The plain model trained on each window's whole batch for TOTAL steps: its parameters,
    under every name of the tie, and each window's gradient norm (before the clip)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = w.model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        norms = []
        for window in range(w.TOTAL // w.STEPS):
            batches = [w.batch(s) for s in range(window * w.STEPS, (window + 1) * w.STEPS)]
            x, y = (torch.cat(t) for t in zip(*batches, strict=True))
            nn.functional.mse_loss(model(x), y).backward()
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
            assert (norms[-1] > clip) == (clip == w.CLIP)  # the clip acts, or clips nothing
            optimizer.step()
            optimizer.zero_grad()
        params = model.named_parameters(remove_duplicate=False)
        return {n: p.detach().clone() for n, p in params}, norms
    finally:
        torch.set_default_dtype(previous)


def _assert_plain(got: dict[str, torch.Tensor], where: str, clip: float = w.CLIP) -> None:
    plain, _ = _plain(clip)
    assert got, f"{where}: no parameters"
    for name, value in got.items():
        torch.testing.assert_close(
            value, plain[name], rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{where}: {n}: {m}"
        )


def _launch(scenario: str, world: int, out: Path) -> list[dict]:
    exits = launch(scenario, world, out, timeout=150, worker=WORKER)
    for e in exits:
        assert e.code == 0, f"{scenario}: rank {e.rank} exited {e.code}:\n{e.output[-4000:]}"
    return [torch.load(out / f"{scenario}-rank{r}.pt") for r in range(world)]


def _in_process(scenario: str, out: Path) -> dict:
    previous = torch.get_default_dtype()
    try:
        w.main(scenario, out)
    finally:
        torch.set_default_dtype(previous)
    return torch.load(out / f"{scenario}-rank0.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tied")
    _in_process("save", out)  # ck-local
    _launch("save", 2, out)  # ck-1f1b, ck-zb-v, ck-old, ck-subset
    _launch("save", 4, out)  # ck-zb-v-dp2
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_tied_weight_resumes_at_every_layout_as_the_plain_model(saved, world):
    records = [_in_process("resume", saved)] if world == 1 else _launch("resume", world, saved)
    runs = {key for record in records for key in record}
    checkpoints = w.CHECKPOINTS[1 if world == 1 else 2]
    schedules = w.RESUME_SCHEDULES[world]
    assert runs == {f"{c}>{s}" for c in checkpoints for s in schedules}
    for run in sorted(runs):
        got: dict[str, torch.Tensor] = {}
        for rank, record in enumerate(records):
            params = record[run]
            for name, value in params.items():
                if name in got:  # a dp replica's: the same
                    torch.testing.assert_close(value, got[name], rtol=0, atol=0)
            got.update(params)
            assert params, f"{run}: rank {rank} holds no parameters"
        assert {"0.weight", "7.weight"} <= set(got), run
        _assert_plain(got, f"{run} on {world} process(es)")


def test_a_checkpoint_lacking_a_parameters_optimizer_state_is_refused_unchanged(saved):
    records = _launch("refuse", 2, saved)
    for rank, record in enumerate(records):
        for checkpoint, name in (("old", "7.weight"), ("subset", "5.weight")):
            error = record.get(f"{checkpoint}-error")
            assert error is not None, f"rank {rank}: ck-{checkpoint} was loaded"
            assert f"rank 1: checkpoint '{saved / f'ck-{checkpoint}'}'" in error, error
            assert f"{name!r}" in error and "no optimizer entry" in error, error
            assert "rank 0:" not in error, error
            assert record[f"{checkpoint}-unchanged"], f"rank {rank}: ck-{checkpoint}"


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch("fsdp", 4, tmp_path_factory.mktemp("tied-fsdp"))


@pytest.mark.parametrize("run", ["zb-v", "1f1b"])
def test_sharded_data_parallel_with_a_tied_weight_trains_as_the_plain_model(fsdp, run):
    """``zb-v``: the tie whole on pp rank 0 (its inf check and clip over mixed placements)."""
    clip = w.FSDP_RUNS[run][1]
    got: dict[str, torch.Tensor] = {}
    for rank, record in enumerate(fsdp):
        params = record[run]["params"]
        assert params, f"{run}: rank {rank} holds no parameters"
        _assert_plain(params, f"sharded {run} rank {rank}", clip)
        got.update(params)
    assert {"0.weight", "7.weight"} <= set(got)


def test_sharded_data_parallel_with_a_tied_weight_clips_as_the_plain_model(fsdp):
    _, norms = _plain(w.CLIP)
    for rank, record in enumerate(fsdp):
        torch.testing.assert_close(
            record["zb-v-clip"]["norms"],
            norms,
            rtol=1e-10,
            atol=0,
            msg=lambda m, r=rank: f"rank {r}: {m}",
        )
        _assert_plain(record["zb-v-clip"]["params"], f"sharded zb-v clipped, rank {rank}")
