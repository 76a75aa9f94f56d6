"""Pipeline with checkpointing, dropout, BatchNorm and autocast (INVARIANTS 12-19)."""

from __future__ import annotations

import contextlib
import copy
import hashlib

import pytest
import torch
from torch import nn

from pipesched import DeferredBatchNorm, Pipeline, is_recomputing
from pipesched.runtime.stage.seeding import StageSeeding
from pipesched.schedule import SCHEDULES, stages_per_worker

MODES = ["always", "except_last", "never"]


pytestmark = pytest.mark.usefixtures("fp64")


class MaskProbe(nn.Module):
    """Records a hash of which inputs are zero (the dropout mask), in forward and recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, str]] = []

    def forward(self, x):
        digest = hashlib.sha1((x == 0).numpy().tobytes()).hexdigest()
        self.seen.append((is_recomputing(), digest))
        return x


def _dropout_model(probe: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [
        nn.Linear(6, 6),
        nn.Dropout(0.5),
        nn.ReLU(),
        nn.Linear(6, 6),
        nn.Dropout(0.3),
        nn.Tanh(),
        nn.Linear(6, 6),
        probe or nn.Identity(),
    ]
    return nn.Sequential(*layers)


def _pipe(model, workers, schedule, **kwargs):
    v = stages_per_worker(schedule)
    stages = workers * v
    n = len(model)
    balance = [n // stages + (s < n % stages) for s in range(stages)]
    return Pipeline(
        model,
        kwargs.pop("chunks", 4),
        balance=balance,
        devices=["cpu"] * workers,
        schedule=schedule,
        **kwargs,
    )


ALL = [(schedule, workers) for schedule in SCHEDULES for workers in (2, 4)]


def _tail_pipe(head: list[nn.Module], width: int, schedule: str, workers: int, **kwargs):
    """``head`` as stage 0, then one Linear(width, width) per further stage."""
    stages = workers * stages_per_worker(schedule)
    layers = [*head, *(nn.Linear(width, width) for _ in range(stages - 1))]
    return Pipeline(
        nn.Sequential(*layers),
        kwargs.pop("chunks", 3),
        balance=[len(head)] + [1] * (stages - 1),
        devices=["cpu"] * workers,
        schedule=schedule,
        **kwargs,
    )


def _step(pipe, seed=7, batch=10):
    torch.manual_seed(seed)
    x, y = torch.randn(batch, 6), torch.randn(batch, 6)
    loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_checkpoint_modes_are_bitwise_equal_with_dropout(schedule, workers):
    # INVARIANT 12.
    results = [_step(_pipe(_dropout_model(), workers, schedule, checkpoint=m)) for m in MODES]
    (loss0, grads0), *rest = results
    for loss, grads in rest:
        assert torch.equal(loss, loss0)
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), name


@pytest.mark.parametrize(("schedule", "workers"), ALL)
def test_recomputed_dropout_masks_equal_the_forward_masks(schedule, workers):
    # INVARIANT 13: a probe after the dropout layers sees the same mask twice.
    probe = MaskProbe()
    # The probe feeds a Linear of its own stage, which saves its input: recomputation
    # runs through the probe.
    torch.manual_seed(0)
    head = [nn.Linear(6, 6), nn.Dropout(0.5), probe, nn.Linear(6, 6)]
    pipe = _tail_pipe(head, 6, schedule, workers, checkpoint="always")
    _step(pipe, batch=9)
    forward = [h for recomputing, h in probe.seen if not recomputing]
    recompute = [h for recomputing, h in probe.seen if recomputing]
    assert len(forward) == 3
    assert sorted(recompute) == sorted(forward)


def test_without_seeding_recomputed_masks_differ(monkeypatch):
    # INVARIANT 13, negative control: switch our seeding off and torch's RNG replay
    # is off too (the runtime relies on seeding), so recomputation draws new masks.
    probe = MaskProbe()
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), probe, nn.Linear(6, 6), nn.Linear(6, 6))
    pipe = Pipeline(model, 3, balance=[4, 1], devices=["cpu", "cpu"], checkpoint="always")
    monkeypatch.setattr(StageSeeding, "forward", lambda *args: contextlib.nullcontext())
    _step(pipe, batch=9)
    forward = {h for recomputing, h in probe.seen if not recomputing}
    recompute = {h for recomputing, h in probe.seen if recomputing}
    assert forward != recompute


@pytest.mark.parametrize(("schedule", "workers"), ALL)
@pytest.mark.parametrize("mode", MODES)
def test_first_stage_parameters_get_gradients_from_token_ids(schedule, workers, mode):
    # INVARIANT 14: the input (token ids) does not require grad.
    pipe = _tail_pipe(
        [nn.Embedding(9, 6), nn.Linear(6, 6), nn.ReLU()], 6, schedule, workers, checkpoint=mode
    )
    plain = nn.Sequential(*[m for stage in pipe.stages for m in stage])
    plain = copy.deepcopy(plain)
    tokens, labels = torch.randint(0, 9, (6,)), torch.randn(6, 6)
    pipe.step(tokens, labels, loss_fn=nn.functional.mse_loss)
    nn.functional.mse_loss(plain(tokens), labels).backward()
    assert pipe.get_parameter("0.weight").grad is not None
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize(("schedule", "workers"), ALL)
@pytest.mark.parametrize("mode", ["always", "except_last"])
@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
def test_checkpointing_does_not_repeat_batch_norm_updates(schedule, workers, mode):
    # INVARIANT 15.
    def run(checkpoint):
        torch.manual_seed(0)
        head = [nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 5)]
        pipe = _tail_pipe(head, 5, schedule, workers, checkpoint=checkpoint)
        torch.manual_seed(3)
        for _ in range(2):
            pipe.step(torch.randn(9, 4), torch.randn(9, 5), loss_fn=nn.functional.mse_loss)
        return {k: v.clone() for k, v in pipe.state_dict().items() if "running" in k or "num" in k}

    expected, got = run("never"), run(mode)
    assert expected["1.num_batches_tracked"] == 6  # 2 steps x 3 micro-batches
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize(("schedule", "workers"), ALL)
def test_autocast_reaches_every_stage(schedule, workers):
    # INVARIANT 16: CPU bf16 autocast inside the stage threads.
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    pipe = _tail_pipe([nn.Linear(8, 8), nn.ReLU()], 8, schedule, workers, chunks=2)
    dtypes = []
    for stage in pipe.stages:
        stage[-1].register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    x, y = torch.randn(6, 8), torch.randn(6, 8)

    def grads(mode):
        pipe.checkpoint = mode
        for p in pipe.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pipe(x)
            pipe.step(x, y, loss_fn=lambda o, t: nn.functional.mse_loss(o.float(), t))
        assert out.dtype == torch.bfloat16
        return [p.grad.clone() for p in pipe.parameters()]

    never = grads("never")
    assert set(dtypes) == {torch.bfloat16}
    assert len(dtypes) >= 2 * len(pipe.stages)
    always = grads("always")
    for a, b in zip(never, always, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("balance", "schedule", "workers"),
    [
        ([4, 4], "gpipe", 2),
        ([2, 6], "1f1b", 2),
        ([2, 2, 2, 2], "1f1b", 4),
        ([2, 2, 2, 2], "interleaved-1f1b", 2),
        ([1, 3, 3, 1], "zb-v", 2),
        ([5, 3], "zb-h1", 2),
    ],
)
def test_dropout_gradients_do_not_depend_on_balance_or_schedule(balance, schedule, workers):
    # INVARIANT 17: masks are seeded per (call, micro-batch, layer).
    reference = _step(Pipeline(_dropout_model(), 4, balance=[8], devices=["cpu"]))
    pipe = Pipeline(
        _dropout_model(),
        4,
        balance=balance,
        devices=["cpu"] * workers,
        schedule=schedule,
        checkpoint="except_last",
    )
    loss, grads = _step(pipe)
    torch.testing.assert_close(loss, reference[0], rtol=1e-12, atol=1e-14)
    for name, g in reference[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-14, msg=name)


class _Block(nn.Module):
    """A Linear and a Dropout the model shares with another block."""

    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(6, 6), drop

    def forward(self, x):
        return self.drop(self.lin(x)).tanh()


def _shared_dropout_model(probes: list[MaskProbe]) -> nn.Sequential:
    """One Dropout at two positions, another inside two blocks; a probe after each use."""
    torch.manual_seed(0)
    top, inner = nn.Dropout(0.5), nn.Dropout(0.4)
    a, b = _Block(inner), _Block(inner)
    return nn.Sequential(
        nn.Linear(6, 6), top, probes[0], a, probes[1], nn.Linear(6, 6), top, probes[2], b, probes[3]
    )


class _Reused(nn.Module):
    """A traced model calling one Dropout after each of its layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(layer(x))
        return x


@pytest.mark.parametrize(
    ("balance", "schedule", "workers", "mode"),
    [
        ([4, 6], "1f1b", 2, "never"),
        ([2, 8], "gpipe", 2, "always"),
        ([7, 3], "zb-h1", 2, "except_last"),
        ([2, 2, 3, 3], "1f1b", 4, "never"),
        ([3, 3, 2, 2], "zb-v", 2, "always"),
    ],
)
def test_a_module_used_in_two_places_draws_alike_whatever_the_cut(balance, schedule, workers, mode):
    """A draw's place is where the module is used, not the module: before, a shared
    Dropout's n-th draw within a stage, so its masks moved with the cut."""

    def run(**kwargs):
        probes = [MaskProbe() for _ in range(4)]
        step = _step(Pipeline(_shared_dropout_model(probes), 4, **kwargs))
        return step, [[h for recomputed, h in p.seen if not recomputed] for p in probes]

    (loss0, grads0), masks0 = run(balance=[10], devices=["cpu"])
    assert masks0[0] != masks0[2] and masks0[1] != masks0[3]  # each use draws its own
    (loss, grads), masks = run(
        balance=balance, devices=["cpu"] * workers, schedule=schedule, checkpoint=mode
    )
    assert [sorted(m) for m in masks] == [sorted(m) for m in masks0]
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("split", ["layers.1", "layers.2", "layers.3"])
def test_a_traced_models_dropout_called_after_each_layer_draws_alike_whatever_the_cut(split):
    x = torch.randn(8, 6)

    def run(**kwargs):
        model = _Reused()
        pipe = Pipeline(model, 2, example_inputs=(x[:4],), schedule="1f1b", **kwargs)
        return _step(pipe, batch=8)

    loss0, grads0 = run(num_stages=1)
    loss, grads = run(devices=["cpu"] * 2, split_points=[split], checkpoint="always")
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("schedule", "workers"), ALL)
@pytest.mark.parametrize("batch", [10, 16, 3])
def test_deferred_batch_norm_equals_batch_norm_on_the_whole_batch(schedule, workers, batch):
    # INVARIANTS 18-19: exact running statistics (mean 3000, uneven splits); a batch of 3
    # yields 3 micro-batches for chunks=4 and still commits.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))

    plain = model()
    stages = workers * stages_per_worker(schedule)
    piped = nn.Sequential(*model(), *(nn.Identity() for _ in range(stages - 2)))
    pipe = Pipeline(
        piped,
        4,
        balance=[2, 2] + [1] * (stages - 2),
        devices=["cpu"] * workers,
        schedule=schedule,
        deferred_batch_norm=True,
    )
    assert isinstance(pipe.get_submodule("1"), DeferredBatchNorm)
    for k in range(3):
        x = 3000 + torch.randn(batch, 2, 2, 2)
        pipe.step(x, torch.randn(batch, 2), loss_fn=nn.functional.mse_loss)
        plain(x)
        bn, ref = pipe.get_submodule("1"), plain[1]
        torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-12, atol=0)
        torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-12, atol=0)
        assert int(bn.num_batches_tracked) == k + 1
