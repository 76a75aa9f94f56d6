"""The micro-batch BatchNorm warning: once per pipeline, true when shown, silent otherwise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pipesched
from pipesched import GradientAccumulator, MicroBatchNormWarning, Pipeline
from pipesched.pipeline.checks.micro_batch_norm import micro_batch_norms

CPUS = ["cpu", "cpu"]


def bn_model(norm=nn.BatchNorm1d, seed=0):
    """Linear -> norm -> ReLU | Linear -> norm: the norms at '1' and '4'."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 4), norm(4), nn.ReLU(), nn.Linear(4, 4), norm(4), nn.Linear(4, 2)
    )


def conv_model(seed=0):
    """A BatchNorm2d with 2x2 pixels per row: micro-batches of one row still normalize."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))


def mse(output, target):
    return nn.functional.mse_loss(output, target)


def recorded(call):
    """The MicroBatchNormWarnings ``call()`` issues, under the 'always' filter."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if issubclass(w.category, MicroBatchNormWarning)]


def data(rows, features=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=generator), torch.randn(
        rows, 2, generator=generator
    )


ENTRY_POINTS = {
    "step": lambda pipe, x, y: pipe.step(x, y, loss_fn=mse),
    "accumulate": lambda pipe, x, y: pipe.accumulate(x, y, loss_fn=mse),
    "accumulator": lambda pipe, x, y: GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2
    ).step(x, y, loss_fn=mse),
    "forward with grad": lambda pipe, x, y: mse(pipe(x), y).backward(),
    "forward under no_grad": lambda pipe, x, y: torch.no_grad()(pipe)(x),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_first_training_step_warns_once_with_names_and_rows(entry):
    pipe = Pipeline(bn_model(), 4, balance=[3, 3], devices=CPUS)
    x, y = data(16)
    caught = recorded(lambda: [ENTRY_POINTS[entry](pipe, x, y) for _ in range(3)])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "BatchNorm 2 layers (1, 4) normalize over micro-batches of 4 rows" in message
    assert "(batch 16 / chunks 4)" in message
    for option in ("deferred_batch_norm=True", "GroupNorm or LayerNorm", "fewer chunks"):
        assert option in message
    assert caught[0].filename == __file__  # the user's line, not pipesched's or torch's


def test_uneven_and_short_batches_are_described():
    pipe = Pipeline(bn_model(), 4, balance=[3, 3], devices=CPUS)
    (caught,) = recorded(lambda: pipe.step(*data(10), loss_fn=mse))
    assert "micro-batches of 2 to 3 rows (batch 10 / chunks 4)" in str(caught.message)
    pipe = Pipeline(conv_model(), 4, balance=[2, 2], devices=CPUS)
    x, y = torch.randn(3, 2, 2, 2), torch.randn(3, 2)
    (caught,) = recorded(lambda: pipe.step(x, y, loss_fn=mse))
    message = str(caught.message)
    assert "BatchNorm layer (1) normalizes over micro-batches of 1 row " in message
    assert "(batch 3 / chunks 4: 3 micro-batches)" in message


def test_many_layers_are_named_first_then_counted():
    layers = [m for _ in range(8) for m in (nn.Linear(3, 3), nn.BatchNorm1d(3))]
    pipe = Pipeline(nn.Sequential(*layers), 2, balance=[8, 8], devices=CPUS)
    (caught,) = recorded(lambda: pipe.step(torch.randn(8, 3), torch.randn(8, 3), loss_fn=mse))
    assert "BatchNorm 8 layers (1, 3, 5, 7, 9 and 3 more)" in str(caught.message)


def test_the_warning_is_true_and_the_silence_too(fp64):
    """Where it warns, pipe(x) differs from the plain model; in eval it is the plain model."""
    model = bn_model()
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, 4, balance=[3, 3], devices=CPUS)
    x, _ = data(16)
    with torch.no_grad():
        pipe.eval(), plain.eval()
        assert not recorded(lambda: torch.testing.assert_close(pipe(x), plain(x)))
        pipe.train(), plain.train()
        assert recorded(lambda: pipe(x))
        assert not torch.allclose(pipe(x), plain(x), rtol=1e-3)


def test_silent_in_eval_mode_then_warns_at_the_first_training_step():
    pipe = Pipeline(bn_model(), 4, balance=[3, 3], devices=CPUS)
    x, y = data(16)
    pipe.eval()
    assert not recorded(lambda: pipe.step(x, y, loss_fn=mse))
    pipe.train()
    assert len(recorded(lambda: pipe.step(x, y, loss_fn=mse))) == 1


def test_eval_mode_without_running_stats_still_warns(fp64):
    """track_running_stats=False normalizes with the batch's statistics in eval mode too."""
    model = bn_model(lambda c: nn.BatchNorm1d(c, track_running_stats=False)).eval()
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, 4, balance=[3, 3], devices=CPUS)
    x, _ = data(16)
    with torch.no_grad():
        assert len(recorded(lambda: pipe(x))) == 1
        assert not torch.allclose(pipe(x), plain(x), rtol=1e-3)


PER_SAMPLE = {
    "LayerNorm": lambda: (bn_model(nn.LayerNorm), torch.randn(16, 3)),
    "GroupNorm": lambda: (bn_model(lambda c: nn.GroupNorm(2, c)), torch.randn(16, 3)),
    "InstanceNorm": lambda: (
        nn.Sequential(
            nn.Conv2d(2, 3, 1),
            nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
            nn.Flatten(),
            nn.Linear(12, 2),
        ),
        torch.randn(16, 2, 2, 2),
    ),
}


@pytest.mark.parametrize("case", PER_SAMPLE)
def test_silent_for_per_sample_norms(case):
    model, x = PER_SAMPLE[case]()
    pipe = Pipeline(model, 4, devices=CPUS)
    assert not recorded(lambda: pipe.step(x, torch.randn(16, 2), loss_fn=mse))


def test_silent_with_one_microbatch():
    pipe = Pipeline(bn_model(), 1, balance=[3, 3], devices=CPUS)
    assert not recorded(lambda: pipe.step(*data(16), loss_fn=mse))
    pipe = Pipeline(conv_model(), 4, balance=[2, 2], devices=CPUS)
    x, y = torch.randn(1, 2, 2, 2), torch.randn(1, 2)
    assert not recorded(lambda: pipe.step(x, y, loss_fn=mse))  # a batch of one row


def test_silent_with_deferred_batch_norm():
    pipe = Pipeline(bn_model(), 4, balance=[3, 3], devices=CPUS, deferred_batch_norm=True)
    assert not recorded(lambda: pipe.step(*data(16), loss_fn=mse))


def test_filters_silence_it_and_each_pipeline_warns_once():
    first = Pipeline(bn_model(), 4, balance=[3, 3], devices=CPUS)
    second = Pipeline(bn_model(seed=1), 2, balance=[3, 3], devices=CPUS)
    x, y = data(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=pipesched.MicroBatchNormWarning)
        first.step(x, y, loss_fn=mse)
    assert not caught
    assert not recorded(lambda: first.step(x, y, loss_fn=mse))  # its one warning was spent
    with pytest.warns(MicroBatchNormWarning, match=r"of 8 rows \(batch 16 / chunks 2\)"):
        second.step(x, y, loss_fn=mse)
    assert issubclass(MicroBatchNormWarning, UserWarning)


def test_traced_model_layers_carry_their_dotted_names():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = nn.Linear(3, 3), nn.BatchNorm1d(3)

        def forward(self, x):
            return self.norm(self.linear(x)).relu()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.head = Block(), Block(), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.second(self.first(x)))

    x, y = data(8)
    pipe = Pipeline(Net(), 2, example_inputs=(x[:4],), devices=CPUS, balance="params")
    (caught,) = recorded(lambda: pipe.step(x, y, loss_fn=mse))
    assert "BatchNorm 2 layers (first.norm, second.norm)" in str(caught.message)


def test_which_layers_count():
    model = nn.Sequential(
        nn.BatchNorm1d(2),
        nn.BatchNorm2d(2),
        nn.BatchNorm3d(2),
        nn.LazyBatchNorm1d(),
        nn.SyncBatchNorm(2),
        nn.InstanceNorm2d(2, track_running_stats=True),
        pipesched.DeferredBatchNorm(2),
        nn.BatchNorm1d(2, affine=False),
    )
    assert micro_batch_norms(model) == ["0", "1", "2", "3", "4", "7"]
    model[7].track_running_stats = False
    model[7].running_mean = model[7].running_var = None
    model.eval()
    assert micro_batch_norms(model) == ["7"]
    assert micro_batch_norms(nn.BatchNorm1d(2)) == ["BatchNorm1d"]


class OwnBatchNorm(nn.Module):
    """Normalizes with F.batch_norm itself, beside a BatchNorm layer in a block."""

    def __init__(self):
        super().__init__()
        self.first, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        h = nn.functional.batch_norm(self.first(x), self.mean, self.var, training=self.training)
        return self.head(self.block(h))


def test_a_traced_models_own_batch_norm_call_is_told_and_true(fp64):
    """Before, silent: only BatchNorm layers were counted."""
    x, _ = data(8)
    model = OwnBatchNorm()
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, 2, devices=CPUS)
    with torch.no_grad():
        (caught,) = recorded(lambda: pipe(x))
        out = pipe(x)
        per_micro_batch = torch.cat([copy.deepcopy(plain)(x[:4]), copy.deepcopy(plain)(x[4:])])
        torch.testing.assert_close(out, per_micro_batch)  # what it tells of
        assert not torch.allclose(out, plain(x))
    message = str(caught.message)
    assert message.startswith("BatchNorm 2 layers (block.1, OwnBatchNorm)")
    assert "OwnBatchNorm calls batch_norm in training mode itself" in message
    evaluating = Pipeline(copy.deepcopy(plain).eval(), 2, devices=CPUS)
    with torch.no_grad():
        assert recorded(lambda: evaluating(x)) == []  # running statistics: per sample


class _HeldNotCalled(nn.Module):
    """Holds a BatchNorm it never calls (left from an older forward)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(3, 4), nn.Linear(4, 2), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.b(self.a(x).tanh())


def test_a_batchnorm_a_traced_model_holds_but_never_calls_is_not_told():
    """Before, a false alarm: every BatchNorm the model held was named."""
    x, y = data(8)
    pipe = Pipeline(_HeldNotCalled(), 2, devices=CPUS)
    assert recorded(lambda: pipe.step(x, y, loss_fn=mse)) == []
