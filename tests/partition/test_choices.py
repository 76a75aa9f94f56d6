"""Traced models: explicit cuts, clear errors, train/eval modes, dropout, BatchNorm."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipesched import ConfigError, DeferredBatchNorm, PartitionError, Pipeline
from pipesched.errors import RetraceWarning
from tests.partition.models import UNet

X = torch.randn(2, 3, 16, 16)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:  # a Python branch on a tensor's value
            return y * 2
        return y


class DynamicCache:
    """Like transformers' key-value cache: an object holding tensors, not a pytree."""

    def __init__(self, x: torch.Tensor) -> None:
        self.keys = [x]


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_cache: bool = False):
        y = self.b(self.a(x).tanh())
        return (y, DynamicCache(y)) if use_cache else (y,)


def test_a_model_returning_a_key_value_cache_is_told_to_call_without_it():
    pipe = Pipeline(Cached(), 2, devices=["cpu", "cpu"])
    with pytest.raises(PartitionError, match=r"returns a key-value cache.*use_cache=False"):
        pipe(torch.randn(4, 4), use_cache=True)
    assert pipe(torch.randn(4, 4))[0].shape == (4, 4)


def _unet(**kwargs) -> Pipeline:
    torch.manual_seed(0)
    options = {"chunks": 2, "example_inputs": (X,), "devices": ["cpu", "cpu"]} | kwargs
    return Pipeline(UNet(), **options)


def test_untraceable_model_names_the_line_and_the_fixes():
    with pytest.raises(PartitionError) as error:
        Pipeline(DataDependent(), 2, example_inputs=(torch.randn(2, 4),), devices=["cpu", "cpu"])
    message = str(error.value)
    assert "could not trace DataDependent" in message
    assert "test_choices.py" in message and "if y.sum() > 0:" in message
    assert "nn.Sequential" in message and "wrap" in message and "split_points" in message
    assert isinstance(error.value, ValueError)


def test_a_non_sequential_is_cut_on_its_first_call_a_timed_sequential_needs_an_example():
    lazy = Pipeline(UNet(), 2, devices=["cpu", "cpu"])
    with pytest.raises(ConfigError, match=r"traced and cut on the pipeline's first call"):
        lazy.partition  # noqa: B018 - the property raises
    lazy(X)
    assert lazy.partition.balance == "time" and len(lazy.balance) == 2
    sequential = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ConfigError, match=r"balance='time' measures .* example_inputs"):
        Pipeline(sequential, 2, devices=["cpu", "cpu"], balance="time")


def test_split_points_choose_the_cuts():
    pipe = _unet(split_points=["down.2"])
    assert pipe.partition.balance == "split_points"
    assert pipe.partition.stages[1].layers[0] == "down.2"
    assert pipe.balance == [3, 5]
    inside = _unet(split_points=["up.0.conv"])  # a cut inside a layer splits the layer
    assert inside.partition.stages[1].layers[0].startswith("up.0")
    assert inside.partition.stages[0].layers[-1] == "up.0"


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (["nothing.here"], r"split point 'nothing.here' names no module .* include \["),
        (["up.0", "down.1"], r"in the order they run"),
        (["stem"], r"after the first"),
    ],
)
def test_bad_split_points(points, message):
    with pytest.raises(PartitionError, match=message):
        _unet(split_points=points, devices=["cpu"] * (len(points) + 1))


def test_balance_list_counts_layers_of_the_stage_graph():
    assert _unet(balance=[6, 2]).partition.stages[1].layers == ("up.2", "head")
    with pytest.raises(PartitionError, match=r"adding up to the 8 layers"):
        _unet(balance=[6, 3])
    with pytest.raises(ConfigError, match=r"balance or split_points, not both"):
        _unet(balance=[6, 2], split_points=["up.2"])
    with pytest.raises(ConfigError, match=r"'fastest' is not a balancing mode"):
        _unet(balance="fastest")


def test_more_stages_than_layers_names_both_numbers():
    with pytest.raises(PartitionError, match=r"cannot cut 8 layers into 9 stages: .* 7 cut points"):
        _unet(devices=["cpu"] * 9)


def test_batch_norm_layers_follow_the_mode_and_keep_their_statistics():
    torch.manual_seed(0)
    plain, piped = UNet(norm=nn.BatchNorm2d), UNet(norm=nn.BatchNorm2d)
    piped.load_state_dict(plain.state_dict())
    pipe = Pipeline(piped, 1, example_inputs=(X,), devices=["cpu", "cpu"])
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(pipe(x), plain(x))  # one micro-batch: BatchNorm as in the model
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(dict(pipe.named_buffers())[name], buffer, msg=name)
    pipe.eval()
    plain.eval()
    torch.testing.assert_close(pipe(x), plain(x))  # eval: the running statistics
    assert int(piped.down[0].norm.num_batches_tracked) == 1


@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
def test_recomputation_does_not_repeat_batch_norm_updates():
    torch.manual_seed(0)
    model = UNet(norm=nn.BatchNorm2d)
    pipe = Pipeline(model, 2, example_inputs=(X,), devices=["cpu", "cpu"], checkpoint="always")
    x = torch.randn(4, 3, 16, 16)
    pipe.step(x, torch.randn(4, 2, 16, 16), loss_fn=nn.functional.mse_loss)
    tracked = {int(m.num_batches_tracked) for m in model.modules() if hasattr(m, "momentum")}
    assert tracked == {2}  # once per micro-batch, not again in recomputation


def test_deferred_batch_norm_on_a_traced_model():
    torch.manual_seed(0)
    plain, piped = UNet(norm=nn.BatchNorm2d), UNet(norm=nn.BatchNorm2d)
    piped.load_state_dict(plain.state_dict())
    pipe = Pipeline(piped, 4, example_inputs=(X,), devices=["cpu", "cpu"], deferred_batch_norm=True)
    assert isinstance(piped.down[0].norm, DeferredBatchNorm)
    x = torch.randn(8, 3, 16, 16)
    pipe(x)
    plain(x)
    # The first BatchNorm sees the plain model's input: its statistics are the whole
    # batch's. (Later ones see micro-batch-normalized inputs, GPipe's semantics.)
    for name in ("running_mean", "running_var"):
        got, expected = getattr(piped.down[0].norm, name), getattr(plain.down[0].norm, name)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    tracked = {int(m.num_batches_tracked) for m in piped.modules() if hasattr(m, "commit")}
    assert tracked == {1}  # one update per mini-batch, not one per micro-batch


def test_dropout_masks_are_reproduced_in_recomputation():
    pytest.importorskip("transformers")
    from tests.partition.models import GPT2Logits

    ids, labels = torch.randint(0, 100, (4, 12)), torch.randint(0, 100, (4, 12))
    torch.manual_seed(0)
    pipe = Pipeline(
        GPT2Logits(dropout=0.2),
        2,
        example_inputs=(ids[:2],),
        devices=["cpu", "cpu"],
        balance="params",
    )
    kinds = {type(m).__name__ for stage in pipe.stages for m in stage.modules()}
    assert {"Dropout", "RandomOp"} <= kinds  # layers called as layers, attention dropout wrapped

    def grads(mode: str) -> dict[str, torch.Tensor]:
        pipe.checkpoint = mode
        pipe.zero_grad()
        torch.manual_seed(1)  # the same call seed: the same masks
        pipe.step(
            ids,
            labels,
            loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        )
        return {n: p.grad.clone() for n, p in pipe.named_parameters()}

    always, never = grads("always"), grads("never")
    assert always.keys() == never.keys()
    tied = "gpt2.transformer.wte.weight"  # also the LM head: stages 0 and 1 add to its .grad
    for name in always:
        if name == tied:  # in whichever order the two worker threads finish: rounding differs
            torch.testing.assert_close(always[name], never[name], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(always[name], never[name]), name


def test_eval_mode_turns_traced_dropout_off():
    pytest.importorskip("transformers")
    from tests.partition.models import GPT2Logits

    ids = torch.randint(0, 100, (4, 12))
    torch.manual_seed(0)
    plain = GPT2Logits(dropout=0.3)
    torch.manual_seed(0)
    pipe = Pipeline(
        GPT2Logits(dropout=0.3),
        2,
        example_inputs=(ids[:2],),
        devices=["cpu", "cpu"],
        balance="params",
    )
    with torch.no_grad():
        assert not torch.allclose(pipe(ids), plain.eval()(ids))  # training: dropout on
        pipe.eval()
        torch.testing.assert_close(pipe(ids), plain(ids))  # attention dropout off too


def test_model_traced_in_eval_mode_is_traced_again_to_train_with_dropout():
    pytest.importorskip("transformers")
    from tests.partition.models import GPT2Logits

    ids = torch.randint(0, 100, (2, 12))
    model = GPT2Logits(dropout=0.1).eval()  # as from_pretrained returns it
    pipe = Pipeline(model, 2, example_inputs=(ids,), devices=["cpu", "cpu"], balance="params")
    with torch.no_grad():
        pipe(ids)
    with torch.no_grad():
        evaluated = pipe(ids)
    pipe.train()  # the eval trace fixed attention's dropout at 0: training has a cut of its own
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)  # routine: no warning
        trained = pipe(ids)
    assert not torch.equal(trained, evaluated)  # dropout is on
    pipe.eval()
    with torch.no_grad():
        assert torch.equal(pipe(ids), evaluated)  # the eval cut again, no third trace
    assert pipe.num_cuts == 2
