"""Deferred BatchNorm: mini-batch running statistics, exact, whatever the split."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torchgpipe.batchnorm import DeferredBatchNorm as TorchgpipeDeferredBatchNorm

from pipesched import Pipeline
from pipesched.errors import ConfigError
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm, commit_all
from pipesched.runtime.stage.recompute import checkpoint

NORMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
TOLERANCE = {
    torch.float64: {"rtol": 1e-12, "atol": 0.0},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
}

# (batch shape, micro-batch sizes); channels are dimension 1.
SPLITS = {
    "16 values per channel": ((4, 3, 4), [2, 2]),
    "16 rows, 1d": ((16, 3), [4, 4, 4, 4]),
    "10 rows into 3,3,2,2": ((10, 3, 5), [3, 3, 2, 2]),
    "batch smaller than chunks": ((3, 2, 2, 3), [1, 1, 1]),
    "one micro-batch": ((5, 2, 2, 2, 2), [5]),
}


def make_batches(shape, dtype, count=3, mean=3000.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (mean + torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
        for _ in range(count)
    ]


def assert_same_running_stats(deferred, reference, dtype):
    assert torch.allclose(deferred.running_mean, reference.running_mean, **TOLERANCE[dtype])
    assert torch.allclose(deferred.running_var, reference.running_var, **TOLERANCE[dtype])
    assert int(deferred.num_batches_tracked) == int(reference.num_batches_tracked)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", SPLITS)
def test_commit_equals_batchnorm_on_the_whole_minibatch(case, dtype, momentum):
    shape, sizes = SPLITS[case]
    norm = NORMS[len(shape)]
    reference = norm(shape[1], momentum=momentum, dtype=dtype)
    deferred = DeferredBatchNorm(shape[1], momentum=momentum, dtype=dtype)
    batches = make_batches(shape, dtype)
    for batch in batches:
        reference(batch)
        for micro in batch.split(sizes):
            output = deferred(micro)
            # GPipe semantics: each micro-batch normalized by its own statistics.
            assert torch.equal(output, norm(shape[1], dtype=dtype)(micro))
        assert int(deferred.num_batches_tracked) == int(reference.num_batches_tracked) - 1
        deferred.commit()
        assert_same_running_stats(deferred, reference, dtype)
    assert int(deferred.num_batches_tracked) == len(batches)


def test_fp32_statistics_are_accumulated_in_fp64():
    # Inputs of mean 3000 and spread 1 in fp32: the result is as good as fp64 BatchNorm.
    (batch,) = make_batches((10, 3, 5), torch.float64, count=1)
    reference = nn.BatchNorm1d(3, momentum=1.0, dtype=torch.float64)
    reference(batch)
    deferred = DeferredBatchNorm(3, momentum=1.0)
    for micro in batch.float().tensor_split(4):
        deferred(micro)
    deferred.commit()
    # fp32 rounding of the inputs (3000 * 6e-8 = 2e-4 absolute) is all that is left.
    assert torch.allclose(deferred.running_var.double(), reference.running_var, rtol=1e-3)
    assert torch.allclose(deferred.running_mean.double(), reference.running_mean, rtol=1e-7)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=2, max_value=6), min_size=1, max_size=6),
    momentum=st.sampled_from([0.1, 0.5, None]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_split_gives_the_whole_minibatch_statistics(sizes, momentum, seed):
    (batch,) = make_batches((sum(sizes), 4), torch.float64, count=1, seed=seed)
    reference = nn.BatchNorm1d(4, momentum=momentum, dtype=torch.float64)
    reference(batch)
    deferred = DeferredBatchNorm(4, momentum=momentum, dtype=torch.float64)
    for micro in batch.split(sizes):
        deferred(micro)
    deferred.commit()
    assert_same_running_stats(deferred, reference, torch.float64)


def test_empty_microbatches_are_skipped():
    # tensor_split gives empty pieces when the batch is smaller than chunks.
    (batch,) = make_batches((3, 2, 4), torch.float64, count=1)
    reference = nn.BatchNorm1d(2, dtype=torch.float64)
    reference(batch)
    deferred = DeferredBatchNorm(2, dtype=torch.float64)
    for micro in batch.tensor_split(5):
        deferred(micro)
    deferred.commit()
    assert_same_running_stats(deferred, reference, torch.float64)


def test_commit_without_accumulation_is_a_noop():
    bn = DeferredBatchNorm(3)
    bn.commit()
    bn(torch.randn(4, 3))
    bn.commit()
    state = {name: b.clone() for name, b in bn.named_buffers()}
    bn.commit()
    bn.eval()
    bn(torch.randn(4, 3))
    bn.commit()
    for name, b in bn.named_buffers():
        assert torch.equal(b, state[name])
    assert int(bn.num_batches_tracked) == 1


# --- torchgpipe's DeferredBatchNorm as negative control --------------------------------


def test_torchgpipe_never_commits_a_short_batch():
    # chunks=4 but the batch of 3 rows yields 3 micro-batches.
    (batch,) = make_batches((3, 2, 4), torch.float64, count=1, mean=0.0)
    theirs = TorchgpipeDeferredBatchNorm(2, chunks=4).double()
    ours = DeferredBatchNorm(2, dtype=torch.float64)
    for micro in batch.tensor_split(3):
        theirs(micro)
        ours(micro)
    ours.commit()
    assert int(theirs.num_batches_tracked) == 0
    assert int(ours.num_batches_tracked) == 1


def test_torchgpipe_variance_differs_from_batchnorm():
    # Mean 0 in fp64 (no precision trouble), momentum 1: the running variance is
    # the mini-batch's. 8 values per channel: biased and unbiased differ by 1/7.
    (batch,) = make_batches((4, 2, 2), torch.float64, count=1, mean=0.0)
    reference = nn.BatchNorm1d(2, momentum=1.0, dtype=torch.float64)
    reference(batch)
    theirs = TorchgpipeDeferredBatchNorm(2, momentum=1.0, chunks=2).double()
    ours = DeferredBatchNorm(2, momentum=1.0, dtype=torch.float64)
    for micro in batch.tensor_split(2):
        theirs(micro)
        ours(micro)
    ours.commit()
    assert int(theirs.num_batches_tracked) == 1
    assert torch.allclose(theirs.running_mean, reference.running_mean, rtol=1e-12)
    assert not torch.allclose(theirs.running_var, reference.running_var, rtol=1e-3)
    assert torch.allclose(ours.running_var, reference.running_var, rtol=1e-12)


def test_torchgpipe_loses_the_fp32_variance_at_mean_3000():
    # E[x^2] - E[x]^2 in fp32: about 9e6 - 9e6, with an ulp of 1 against a variance of 1.
    (batch,) = make_batches((10, 8, 5), torch.float64, count=1)
    reference = nn.BatchNorm1d(8, momentum=1.0, dtype=torch.float64)
    reference(batch)
    theirs = TorchgpipeDeferredBatchNorm(8, momentum=1.0, chunks=2)
    ours = DeferredBatchNorm(8, momentum=1.0)
    for micro in batch.float().tensor_split(2):
        theirs(micro)
        ours(micro)
    ours.commit()
    error = ((theirs.running_var.double() - reference.running_var) / reference.running_var).abs()
    assert error.max() > 1e-2
    assert torch.allclose(ours.running_var.double(), reference.running_var, rtol=1e-3)


# --- recomputation ------------------------------------------------------------------


def deferred_model():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    return DeferredBatchNorm.convert(model.double())


def train_microbatches(model, batch, wrap):
    for micro in batch.tensor_split(3):
        wrap(model, micro).square().sum().backward()
    commit_all(model)


def test_recomputation_is_not_accumulated():
    batch = 3000 + torch.randn(10, 4, dtype=torch.float64)
    plain, checkpointed = deferred_model(), deferred_model()
    train_microbatches(plain, batch, lambda m, x: m(x))
    train_microbatches(checkpointed, batch, checkpoint)
    assert_same_running_stats(checkpointed[1], plain[1], torch.float64)
    for p, q in zip(checkpointed.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_recomputation_without_the_flag_is_accumulated_twice():
    # Negative control: torch's checkpoint alone lets the recomputation count again.
    def naive(model, x):
        return torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)

    batch = torch.randn(10, 4, dtype=torch.float64)
    plain, naive_model = deferred_model(), deferred_model()
    train_microbatches(plain, batch, lambda m, x: m(x))
    train_microbatches(naive_model, batch, naive)
    assert not torch.allclose(naive_model[1].running_var, plain[1].running_var, rtol=1e-3)


# --- eval mode, track_running_stats=False, input checks ------------------------------------


def test_eval_mode_uses_running_statistics():
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3, dtype=torch.float64)
    with torch.no_grad():
        reference.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
        reference.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
        reference.weight.copy_(torch.tensor([2.0, 1.0, -1.0]))
        reference.bias.copy_(torch.tensor([0.0, 3.0, 1.0]))
    deferred = DeferredBatchNorm.convert(reference).eval()
    reference.eval()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    shape = (1, 3, 1, 1)
    by_hand = (x - reference.running_mean.view(shape)) / torch.sqrt(
        reference.running_var.view(shape) + reference.eps
    ) * reference.weight.view(shape) + reference.bias.view(shape)
    assert torch.equal(deferred(x), reference(x))
    assert torch.allclose(deferred(x), by_hand, rtol=1e-12, atol=1e-12)
    deferred.commit()
    assert int(deferred.num_batches_tracked) == 0


def test_without_running_stats_it_is_a_plain_batchnorm():
    reference = nn.BatchNorm1d(3, track_running_stats=False)
    deferred = DeferredBatchNorm(3, track_running_stats=False)
    x = torch.randn(6, 3, 2)
    for mode in (True, False):
        reference.train(mode)
        deferred.train(mode)
        assert torch.equal(deferred(x), reference(x))
    deferred.commit()
    assert deferred.running_mean is None
    assert deferred.num_batches_tracked is None


@pytest.mark.parametrize("shape", [(4,), (2, 3, 1, 1, 1, 1)])
def test_rejects_inputs_without_a_channel_dimension(shape):
    with pytest.raises(ConfigError, match=r"2 to 5 dimensions.*got shape"):
        DeferredBatchNorm(3)(torch.randn(shape))


# --- convert and commit_all ---------------------------------------------------------------


def test_convert_replaces_nested_batchnorms_and_keeps_their_state():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4, eps=1e-3, momentum=0.3),
        nn.Sequential(nn.ReLU(), nn.BatchNorm2d(4, affine=False, momentum=None)),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.BatchNorm2d(4, bias=False),
        nn.SyncBatchNorm(4),
    ).double()
    model[:5](torch.randn(6, 3, 2, 2, dtype=torch.float64))
    model[4].eval()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    originals = {name: m for name, m in model.named_modules()}
    tensors = {name: t for name, t in model.state_dict(keep_vars=True).items()}

    converted = DeferredBatchNorm.convert(model)

    assert converted is model
    assert type(model[5]) is nn.SyncBatchNorm
    for name in ("1", "2.1", "3", "4"):
        new, old = converted.get_submodule(name), originals[name]
        assert isinstance(new, DeferredBatchNorm) and isinstance(new, type(old)), name
        assert type(new).__name__ == f"Deferred{type(old).__name__}", name
        for attribute in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(new, attribute) == getattr(old, attribute), (name, attribute)
        assert new.training == old.training
    assert converted.state_dict().keys() == before.keys()
    for name, t in converted.state_dict(keep_vars=True).items():
        assert t is tensors[name], name  # an optimizer built before convert still works
        assert torch.equal(t, before[name]), name
    assert converted[4].bias is None


def test_convert_a_single_batchnorm_and_leave_deferred_ones():
    bn = nn.BatchNorm1d(3)
    deferred = DeferredBatchNorm.convert(bn)
    assert isinstance(deferred, DeferredBatchNorm) and isinstance(deferred, nn.BatchNorm1d)
    assert deferred.weight is bn.weight
    assert DeferredBatchNorm.convert(deferred) is deferred


def test_convert_rejects_an_uninitialized_lazy_batchnorm():
    with pytest.raises(ConfigError, match="LazyBatchNorm1d.*first forward"):
        DeferredBatchNorm.convert(nn.Sequential(nn.LazyBatchNorm1d()))


def test_commit_all_commits_every_deferred_batchnorm():
    model = DeferredBatchNorm.convert(
        nn.Sequential(nn.BatchNorm1d(2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    )
    for micro in torch.randn(6, 2).tensor_split(2):
        model(micro)
    commit_all(model)
    assert [int(b) for name, b in model.named_buffers() if name.endswith("tracked")] == [1, 1]


def test_a_converted_batchnorm_is_found_by_its_class_and_pickles():
    """Before, a DeferredBatchNorm was no nn.BatchNorm1d: a loop freezing BatchNorms by
    class, or leaving them out of weight decay, silently found none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).double()
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, 2, balance=[2, 2], devices=["cpu"] * 2, deferred_batch_norm=True)
    for m in (pipe, plain):  # freeze the BatchNorms, as fine-tuning code does
        for layer in m.modules():
            if isinstance(layer, nn.BatchNorm1d):
                layer.eval()
    assert sum(isinstance(layer, nn.BatchNorm1d) for layer in pipe.modules()) == 1
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad, rtol=1e-10, atol=0)
    assert torch.equal(model[1].running_mean, plain[1].running_mean)  # frozen: unmoved
    again = pickle.loads(pickle.dumps(model[1]))
    assert type(again) is type(model[1]) and torch.equal(again.running_var, model[1].running_var)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):  # BatchNorm1d's own check
        model[1](torch.randn(2, 4, 3, 3, dtype=torch.float64))
