"""Models built on the meta device, on 2 gloo processes (INVARIANT 31)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.launch import launch

META_WORKER = Path(__file__).with_name("meta_worker.py")


def _run(scenario: str, tmp_path: Path, timeout: float = 60) -> list[dict]:
    exits = launch(scenario, 2, tmp_path, timeout=timeout, worker=META_WORKER)
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("scenario", ["seq", "gpt"])
def test_a_meta_built_model_trains_like_the_same_model_built_normally(scenario, tmp_path):
    results = _run(scenario, tmp_path)
    seen: set[str] = set()
    for rank, result in enumerate(results):
        (meta_losses, meta_params), (losses, params) = result["meta"], result["normal"]
        assert meta_losses == pytest.approx(losses, rel=1e-12)
        # This rank holds its stages' parameters only (and a tied one, on both ranks).
        assert meta_params.keys() == params.keys()
        assert len(meta_params) > 0
        for name, value in meta_params.items():
            torch.testing.assert_close(
                value, params[name], rtol=1e-12, atol=1e-14, msg=f"rank {rank}: {name}"
            )
        seen |= set(meta_params)
    assert len(seen) > max(len(r["meta"][1]) for r in results)  # the ranks split the model
    assert results[0]["balance"] == results[1]["balance"]
    if scenario == "gpt":  # balanced by estimated time: nothing of the meta model could run
        assert all(r["estimated"] for r in results)
        assert "ESTIMATED" in results[0]["table"]


def test_a_rank_grows_by_its_own_stages_not_the_model(tmp_path):
    results = _run("rss", tmp_path, timeout=90)
    for rank, r in enumerate(results):
        mb = 2**20
        print(
            f"rank {rank}: model {r['param_bytes'] / mb:.0f} MiB of parameters, own stages "
            f"{r['own_bytes'] / mb:.0f} MiB; RSS growth at construction: meta build "
            f"{r['meta_growth'] / mb:.0f} MiB; whole-model build (today's): "
            f"{r['normal_built'] / mb:.0f} MiB once built, {r['normal_growth'] / mb:.0f} MiB "
            "after the Pipeline freed the other stages"
        )
        assert r["own_bytes"] < 0.6 * r["param_bytes"]
        assert r["meta_growth"] <= 0.6 * r["param_bytes"]
        assert r["normal_built"] > 0.9 * r["param_bytes"]  # today's build, for comparison
