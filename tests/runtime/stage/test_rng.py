"""Every random draw in a stage is a pure function of (step seed, micro-batch, place): INVARIANT 25.

Each kind of random call users' models make (tests/runtime/stage/random_kinds.py) runs on two
CPU stage threads. Bitwise equality with checkpoint="never" (no recomputation:
autograd uses the forward's own draws) proves the recomputed draws equal the
forward's, i.e. the gradients belong to the output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched import Pipeline
from tests.runtime.stage.random_kinds import KINDS, model_of

pytestmark = pytest.mark.usefixtures("fp64")

ROWS, CHUNKS = 10, 4  # uneven micro-batches: 3, 3, 2, 2


def _run(kind, checkpoint, *, balance=(2, 3), schedule="1f1b", seed=1):
    pipe = Pipeline(
        model_of(kind),
        CHUNKS,
        balance=list(balance),
        devices=["cpu", "cpu"],
        checkpoint=checkpoint,
        schedule=schedule,
    )
    torch.manual_seed(seed)
    x, y = torch.randn(ROWS, 8), torch.randn(ROWS, 8)
    loss = pipe.step(x, y, loss_fn=F.mse_loss)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    return loss, grads


def _assert_bitwise(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recomputation_draws_what_the_forward_drew(kind, mode):
    _assert_bitwise(_run(kind, mode), _run(kind, "never"))


@pytest.mark.parametrize("kind", KINDS)
def test_two_runs_with_one_seed_are_bitwise_equal(kind):
    first = _run(kind, "always")
    _assert_bitwise(first, _run(kind, "always"))
    other_seed = _run(kind, "always", seed=2)
    assert not torch.equal(first[0], other_seed[0]), "the draws ignore torch.manual_seed"


@pytest.mark.parametrize("kind", KINDS)
def test_draws_do_not_depend_on_balance_or_schedule(kind):
    # INVARIANT 17: a draw's place is the model's module path, not the stage it landed in.
    reference = _run(kind, "except_last")
    _assert_bitwise(reference, _run(kind, "always", balance=(4, 1), schedule="gpipe"))
    _assert_bitwise(reference, _run(kind, "never", balance=(1, 4), schedule="zb-h1"))


def test_torchgpipe_parallel_randoms():
    # torchgpipe's tests/test_gpipe.py::test_parallel_randoms, on pipesched.
    class Dropouts(nn.Module):
        def forward(self, x):
            for _ in range(100):
                x = F.dropout(x, p=0.001)
            return x

    model = nn.Sequential(Dropouts(), Dropouts())
    x = torch.rand(10, 10, requires_grad=True)
    pipe = Pipeline(model, chunks=10, balance=[1, 1], devices=["cpu", "cpu"], checkpoint="always")
    y = pipe(x)
    y.norm().backward()
    assert y.to(torch.bool).tolist() == x.grad.to(torch.bool).tolist()


def test_micro_batches_and_places_draw_differently():
    # One row per micro-batch, and one Dropout module called in two stages: no two
    # (micro-batch, call) pairs may share a mask.
    dropout = nn.Dropout(0.5)
    pipe = Pipeline(
        nn.Sequential(nn.Identity(), dropout, dropout), 2, balance=[2, 1], devices=["cpu"] * 2
    )
    torch.manual_seed(0)
    y = pipe(torch.ones(2, 4000))
    assert not torch.equal(y[0] == 0, y[1] == 0)
    for row in y:  # two independent masks of p = 0.5 zero 75% (one mask twice: 50%)
        assert 0.72 < float((row == 0).double().mean()) < 0.78


def test_a_model_without_random_operations_leaves_the_generator_alone():
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), 2, devices=["cpu"] * 2)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    torch.manual_seed(5)
    pipe.step(x, y, loss_fn=F.mse_loss)
    after_step = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_step, torch.rand(3))


def test_a_random_loss_function_is_seeded_too():
    # The loss runs on the last stage's thread; a random loss (label noise) repeats.
    def noisy_mse(output, target):
        return F.mse_loss(output, target + 0.1 * torch.randn_like(target))

    def run(mode):
        model = model_of("Dropout")
        pipe = Pipeline(model, 4, balance=[2, 3], devices=["cpu"] * 2, checkpoint=mode)
        torch.manual_seed(1)
        return pipe.step(torch.randn(ROWS, 8), torch.randn(ROWS, 8), loss_fn=noisy_mse)

    assert torch.equal(run("always"), run("never"))


def test_a_mesh_draws_what_one_process_draws(tmp_path):
    # Two gloo processes (pp=2), every kind, against the two-thread run in this process.
    from tests.distributed import random_worker
    from tests.distributed.launch import launch

    exits = launch("random", 2, tmp_path, timeout=120, worker=Path(random_worker.__file__))
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for kind in KINDS:
        loss, grads = _run(kind, "always", balance=random_worker.BALANCE)
        mesh_grads = {**ranks[0][kind][1], **ranks[1][kind][1]}
        _assert_bitwise((loss, grads), (ranks[0][kind][0], mesh_grads))
        assert torch.equal(ranks[1][kind][0], loss), kind


def _seeded_throughout(pipe):
    for seeding in pipe.engine.seedings:
        seeding.permanent, seeding.full = True, {True: True, False: True}
    return pipe


class LateNoise(nn.Module):
    """Draws only once switched on: a place the first steps never saw drawing."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x):
        return x + torch.randn_like(x) if self.on else x


@pytest.mark.parametrize("kind", ["TransformerEncoderLayer", "drop-path bernoulli_", "F.dropout"])
def test_seeding_only_where_draws_were_seen_changes_no_number(kind):
    # After its first step a stage seeds only the modules seen drawing; the numbers
    # must be those of seeding every operation, step after step.
    def steps(pipe):
        torch.manual_seed(3)
        out = []
        for _ in range(3):
            x, y = torch.randn(ROWS, 8), torch.randn(ROWS, 8)
            out.append(pipe.step(x, y, loss_fn=F.mse_loss))
        return out, {n: p.grad.clone() for n, p in pipe.named_parameters()}

    def pipe():
        return Pipeline(model_of(kind), CHUNKS, balance=[2, 3], devices=["cpu"] * 2)

    adaptive = pipe()
    learned, throughout = steps(adaptive), steps(_seeded_throughout(pipe()))
    assert all(torch.equal(a, b) for a, b in zip(learned[0], throughout[0], strict=True))
    _assert_bitwise((learned[0][0], learned[1]), (throughout[0][0], throughout[1]))
    assert any(s.hooked for s in adaptive.engine.seedings)  # only the drawing modules are seeded
    stages = adaptive.engine.seedings[:-1]  # the last one seeds the loss: F.mse_loss, never run
    assert not any(s.full[True] for s in stages)


@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
def test_a_draw_in_a_new_place_reruns_the_step_and_changes_nothing_else():
    # A module starts drawing in step 2: the tripwire sees it, the step is put back
    # (gradients, BatchNorm statistics, generators) and rerun seeded throughout.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 8), nn.BatchNorm1d(8), LateNoise(), nn.Linear(8, 8), nn.Dropout(0.3)
        )

    def run(pipe):
        torch.manual_seed(4)
        losses = []
        for step in range(3):
            pipe.get_submodule("2").on = step >= 1
            x, y = torch.randn(ROWS, 8), torch.randn(ROWS, 8)
            losses.append(pipe.step(x, y, loss_fn=F.mse_loss))
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        return losses, grads, {n: b.clone() for n, b in pipe.named_buffers()}

    def pipe():
        return Pipeline(model(), CHUNKS, balance=[3, 2], devices=["cpu"] * 2)

    adaptive = pipe()
    rerun, reference = run(adaptive), run(_seeded_throughout(pipe()))
    assert [s.strikes for s in adaptive.engine.seedings] == [1, 0, 0]  # stage 0 tripped, once
    assert all(torch.equal(a, b) for a, b in zip(rerun[0], reference[0], strict=True))
    for got, want in zip(rerun[1:], reference[1:], strict=True):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in got), "grads or BatchNorm stats differ"


def test_evaluation_first_then_training_learns_each_mode_apart():
    pipe = Pipeline(model_of("F.dropout"), CHUNKS, balance=[2, 3], devices=["cpu"] * 2)
    reference = _seeded_throughout(
        Pipeline(model_of("F.dropout"), CHUNKS, balance=[2, 3], devices=["cpu"] * 2)
    )
    results = []
    for p in (pipe, reference):
        torch.manual_seed(2)
        x, y = torch.randn(ROWS, 8), torch.randn(ROWS, 8)
        p.eval()
        with torch.no_grad():
            evaluated = p(x)
        p.train()
        results.append(
            (evaluated, p.step(x, y, loss_fn=F.mse_loss), p.step(x, y, loss_fn=F.mse_loss))
        )
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
