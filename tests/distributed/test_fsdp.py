"""pp=2 x dp=2 with every stage sharded over its replicas (FSDP2), against the plain model.

One job of 4 gloo ranks trains each configuration (an MLP under every schedule
family, with and without recomputation; a traced LM whose head is tied to its
embedding across the two pipeline ranks) for 3 accumulation windows with
AdamW, clipping and a scheduler. The reference is the plain model trained on
the full batch in this process (fp64). Also measured: each rank's parameter +
gradient + optimizer-state bytes against the replicated run's, and one
reduce-scatter per stage per window.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched.train import export_model
from tests.distributed import fsdp_worker as f
from tests.distributed import sharded_worker as w
from tests.distributed.launch import launch

MLP = [
    f"mlp:{s}:{c}"
    for s in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
    for c in ("never", "always")
]
GPT2 = [m.replace("mlp", "gpt2", 1) for m in MLP]
CONFIGS = [
    *MLP, *GPT2, "traced:1f1b:never", "traced:zb-h1:always",
    "mlp:1f1b:never:whole", "mlp32:zb-h1:never", "ckpt:zb-h1:always",
    "meta:zb-v:never", "early:1f1b:never", "hsdp:1f1b:always",
    "failstep:zb-v:never", "mlp:zb-h1:always:disk", "inf:zb-h1:never",
    "branch:1f1b:never", "frozen:zb-h1:always",
    "drop:zb-v:always", "drop:zb-v:always:whole", "drop:zb-v:always:disk",
    "drop:zb-v:always:whole:disk",
    "mlp:1f1b:always:action", "mlp:zb-v:never:action", "traced:zb-h1:always:action",
    "drop:zb-v:always:action",
]  # fmt: skip


@functools.cache
def _plain(name: str, windows: int = f.WINDOWS) -> dict[str, torch.Tensor]:
    """The plain model trained on each window's whole batch: the full-batch gradient.

    "inf": the window holding step ``f.INF_AT`` is skipped (no optimizer or scheduler step).
    """
    torch.set_default_dtype(torch.float32 if name == "mlp32" else torch.float64)
    try:
        builds = {"traced": w.tied_lm, "gpt2": f.gpt2, "branch": f.branch_mlp}
        model = {**builds, "frozen": f.frozen_mlp}.get(name, lambda: w.mlp(0.0))()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        for window in range(windows):
            steps = range(window * w.STEPS, (window + 1) * w.STEPS)
            if name == "inf" and f.INF_AT in steps:
                continue
            if name == "gpt2":
                ids = torch.cat([f.gpt2_batch(s) for s in steps])
                loss = f.gpt2_loss(model(ids), ids)
            elif name == "branch":
                x, y = (torch.cat(t) for t in zip(*map(f.branch_batch, steps), strict=True))
                loss = nn.functional.mse_loss(model(x), y)
            elif name == "traced":
                batches = [w.tokens(s) for s in steps]
                items = sum(int((y != -100).sum()) for _, y in batches)
                loss = sum(w.token_sum(model(x), y) for x, y in batches) / items
            else:
                batches = [w.batch(s) for s in steps]
                x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        return {n: p.detach() for n, p in model.named_parameters()}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def ranks(out: Path) -> list[dict]:
    exits = launch(",".join(CONFIGS), 4, out, timeout=240, worker=Path(f.__file__))
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-4000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.startswith("drop")])
def test_sharded_training_equals_the_plain_model(ranks, config):
    plain = _plain(config.split(":")[0])
    for rank, results in enumerate(ranks):
        got = results[config]["params"]
        assert got, f"rank {rank} holds no parameters"
        fp32 = config.startswith("mlp32")
        for name, value in got.items():
            torch.testing.assert_close(
                value, plain[name], rtol=1e-5 if fp32 else 1e-10, atol=1e-6 if fp32 else 1e-12,
                msg=f"{config} rank {rank}: {name}",
            )  # fmt: skip


def test_a_step_put_back_and_rerun_changes_nothing_but_its_own_result(ranks):
    # Dropout's first draw spoils step 1 on every rank: put back (the sharded stages' gathered
    # gradients too) and rerun seeded. Equal to the replicated run, where the same happens.
    # With grad_backup="disk" the step added into the gathered gradients in place: read back.
    for rank, results in enumerate(ranks):
        whole = results["drop:zb-v:always:whole"]
        # whole:disk: the replicas' all-reduce ran in the spoiled step; read back regardless.
        for config in (
            "drop:zb-v:always", "drop:zb-v:always:disk", "drop:zb-v:always:whole:disk",
            "drop:zb-v:always:action",
        ):  # fmt: skip
            sharded = results[config]
            assert sharded["reruns"] == whole["reruns"] == 1
            for name, value in sharded["params"].items():
                torch.testing.assert_close(
                    value, whole["params"][name], rtol=1e-10, atol=1e-12,
                    msg=f"{config} rank {rank}: {name}",
                )  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        c
        for c in CONFIGS
        if "whole" not in c.split(":") and not c.startswith(("ckpt", "meta", "early", "failstep"))
    ],
)
def test_one_reduce_scatter_per_param_group_per_window(ranks, config):
    # A param group: a Sequential's stage, or each module owning a traced stage's parameters.
    stages = 2 if config.split(":")[1] in ("interleaved-1f1b", "zb-v") else 1
    for results in ranks:
        got = results[config]
        groups = len(got["sharded"])
        if config.startswith("mlp"):
            assert got["sharded"] == ["FSDPSequential"] * stages
        assert groups >= stages
        assert got["reduce_scatters"] == groups * f.WINDOWS
        # No all-reduce over replicas; the tied weight: once per window over its pp ranks.
        # (zb-v keeps the first and last stages, and so GPT-2's tied weight, on one rank)
        tied = config.startswith(("traced", "gpt2")) and ":zb-v:" not in config
        assert got["all_reduces"] == (f.WINDOWS if tied else 0)


def test_each_rank_holds_about_half_the_bytes_of_a_replicated_run(ranks):
    for rank, results in enumerate(ranks):
        sharded = results["mlp:1f1b:never"]["bytes"]
        whole = results["mlp:1f1b:never:whole"]["bytes"]
        assert sharded <= 0.55 * whole, f"rank {rank}: {sharded} of {whole} bytes"


def test_a_per_rank_state_dict_of_sharded_stages_is_refused_naming_the_fix(ranks):
    for results in ranks:
        assert "acc.save(directory)" in results["mlp:1f1b:never"]["refused"]
        assert results["mlp:1f1b:never:whole"]["refused"] is None


def _assert_plain(got: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], where: str):
    assert got, f"{where}: no parameters"
    for name, value in got.items():
        torch.testing.assert_close(
            value, plain[name], rtol=1e-10, atol=1e-12, msg=f"{where}: {name}"
        )


def test_a_sharded_checkpoint_resumes_sharded_and_refuses_a_mid_window_save(ranks):
    # "ckpt" saved at a window's end, loaded by a new sharded pipeline: equal to the plain run
    # (test_sharded_training_equals_the_plain_model); a mid-window save wrote nothing.
    for results in ranks:
        assert "mid-window" in results["ckpt:zb-h1:always"]["mid_window"]


def test_a_sharded_checkpoint_resumes_in_one_process(ranks, out, fp64):
    torch.manual_seed(1)
    acc = w.accumulator(w.pipeline(w.mlp(0.0), 1, None))
    acc.load(str(out / "ckpt"))
    assert acc.steps == f.SAVE_AT
    w.train(acc, range(f.SAVE_AT, f.WINDOWS * w.STEPS), 0, 1)
    _assert_plain(w.own_parameters(acc.pipe), _plain("mlp"), "pp=1, one process")


def test_a_sharded_checkpoint_resumes_unsharded_at_pp2_dp1(ranks, out):
    exits = launch("resume:1f1b:never", 2, out, timeout=120, worker=Path(f.__file__))
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-4000:]}"
    plain = _plain("mlp")
    for r in range(2):
        got = torch.load(out / f"resume-rank{r}.pt", weights_only=False)["resume:1f1b:never"]
        assert got["sharded"] == []
        _assert_plain(got["params"], plain, f"pp=2 x dp=1 rank {r}")


def test_a_sharded_checkpoint_exports_to_the_plain_model(ranks, out, tmp_path):
    export_model(str(out / "ckpt"), str(tmp_path / "plain.pt"))
    torch.set_default_dtype(torch.float64)
    try:
        model = w.mlp(0.0)
    finally:
        torch.set_default_dtype(torch.float32)
    model.load_state_dict(torch.load(tmp_path / "plain.pt"), strict=True)
    _assert_plain(dict(model.named_parameters()), _plain("mlp", windows=2), "exported")


def test_a_forward_only_call_equals_the_replicated_pipelines(ranks):
    outputs = [
        (r["mlp:1f1b:never"]["evaluated"], r["mlp:1f1b:never:whole"]["evaluated"]) for r in ranks
    ]
    last = [(got, want) for got, want in outputs if want is not None]
    assert len(last) == 2  # the last stage's rank of each replica
    for got, want in last:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_window_end_failing_inside_optimizer_step_is_put_back_on_every_rank(ranks):
    # Rank 1's shards moved before its optimizer raised: every rank puts its window end back
    # (the shards and their gradients), flush() runs it again, and training ends equal to the
    # plain model (test_sharded_training_equals_the_plain_model[failstep:...]).
    for rank, results in enumerate(ranks):
        got = results["failstep:zb-v:never"]["failures"]
        assert got["error"] == ("RuntimeError" if rank == 1 else "RemoteError")
        if rank != 1:  # the others are told which rank failed
            assert got["rank"] == 1, got
        assert got["pending"] and got["put_back"]


def test_resharded_per_action_a_rank_holds_one_stage_whole_at_a_time(ranks):
    # zb-v: two stages per rank. Gathered per step, both are whole through the step;
    # per action, only the one running (measured at each forward of a sharded group).
    for rank, results in enumerate(ranks):
        step, action = results["mlp:zb-v:never"], results["mlp:zb-v:never:action"]
        groups = step["group_bytes"]
        assert len(groups) == 2 and step["whole_peak"] == sum(groups), (rank, groups)
        assert action["whole_peak"] == max(groups), (rank, action["whole_peak"], groups)
