"""A model built on the meta device, in one process: cut unmaterialized, initialized per stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipesched
from pipesched import ConfigError, ConfigTypeError, Pipeline
from tests.distributed import meta_worker as models


def _train(pipe: Pipeline, gpt: bool) -> list[float]:
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for step in range(models.STEPS):
        x, y = models.tokens(step) if gpt else models.batch(step)
        loss = pipe.step(x, y, loss_fn=models.token_loss if gpt else nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize(
    ("scenario", "balance"), [("seq", None), ("seq", "time"), ("gpt", None), ("gpt", [3, 5])]
)
def test_a_meta_built_model_trains_like_the_normal_build(scenario, balance):
    gpt = scenario == "gpt"
    example = models.tokens(0)[0][:2] if gpt else models.batch(0)[0][:3]
    runs = {}
    for meta in (True, False):
        pipe = Pipeline(
            models.build(scenario, meta),
            models.CHUNKS,
            devices=["cpu", "cpu"],
            schedule="1f1b",
            balance=balance,
            example_inputs=(example,) if gpt or balance == "time" else None,
            init_weights=models.gpt_init if gpt else None,
        )
        assert not any(p.is_meta for p in pipe.parameters())
        runs[meta] = (_train(pipe, gpt), dict(pipe.named_parameters()), pipe)
    (meta_losses, meta_params, pipe), (losses, params, normal) = runs[True], runs[False]
    assert meta_losses == pytest.approx(losses, rel=1e-12)
    assert meta_params.keys() == params.keys()
    for name, value in meta_params.items():
        torch.testing.assert_close(value, params[name], rtol=1e-12, atol=1e-14, msg=name)
    estimated = balance == "time" or (gpt and balance is None)
    assert pipe.partition.estimated == estimated
    assert ("ESTIMATED" in str(pipe.partition)) == estimated
    assert not normal.partition.estimated
    if gpt:  # the tied head is still the embedding's Parameter
        assert pipe.head.weight is pipe.wte.weight
        assert bool(pipe.h[0].attn.mask.all()) is False  # computed again by init_weights


def test_the_weights_do_not_depend_on_the_cut():
    cuts = []
    for balance in ([1, 4], [3, 2], [4, 1]):
        pipe = Pipeline(models.build("seq", True), 2, balance=balance, devices=["cpu", "cpu"])
        cuts.append({n: p.detach() for n, p in pipe.named_parameters()})
    for other in cuts[1:]:
        assert all(torch.equal(cuts[0][n], other[n]) for n in cuts[0])


class Scaled(nn.Module):
    """A layer with a parameter and a buffer but no reset method: its values are unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.shift


def _scaled_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), Scaled(), nn.Linear(4, 2))


def test_a_module_without_a_reset_method_is_an_error_naming_it_and_the_fix():
    with pytest.raises(ConfigError, match=r"1\.gain \(Scaled parameter\).*init_weights=") as info:
        Pipeline(_scaled_model(), 2, devices=["cpu", "cpu"])
    assert "1.shift" in str(info.value)


def test_init_weights_covers_what_reset_methods_do_not():
    def init(name: str, module: nn.Module) -> None:
        if isinstance(module, Scaled):
            module.gain.fill_(2.0)
            module.shift.zero_()

    pipe = Pipeline(_scaled_model(), 2, devices=["cpu", "cpu"], init_weights=init)
    assert torch.equal(getattr(pipe, "1").gain, torch.full((4,), 2.0))


def test_a_partial_init_is_an_error():
    def init(name: str, module: nn.Module) -> None:
        if isinstance(module, Scaled):
            module.gain[:2] = 1.0  # half of it
            module.shift.zero_()

    with pytest.raises(ConfigError, match=r"1\.gain"):
        Pipeline(_scaled_model(), 2, devices=["cpu", "cpu"], init_weights=init)


def test_a_non_persistent_buffer_left_as_allocated_is_an_error():
    with pytest.raises(ConfigError, match=r"h\.0\.attn\.mask .*causal mask"):
        Pipeline(
            models.build("gpt", True),
            2,
            devices=["cpu", "cpu"],
            example_inputs=(models.tokens(0)[0][:2],),
        )


@pytest.mark.parametrize(
    ("value", "error"), [(1, ConfigTypeError), ("zeros", ConfigError), (True, ConfigTypeError)]
)
def test_a_bad_init_weights_is_refused(value, error):
    with pytest.raises(error, match="init_weights must be None, a callable"):
        Pipeline(models.build("seq", True), 2, devices=["cpu", "cpu"], init_weights=value)


def test_skip_leaves_the_weights_for_a_checkpoint_load():
    state = models.build("seq", False).state_dict()
    pipe = Pipeline(models.build("seq", True), 2, devices=["cpu", "cpu"], init_weights="skip")
    pipe.load_state_dict(state)
    assert all(torch.equal(pipe.state_dict()[n], state[n]) for n in state)


def test_skip_refuses_non_persistent_buffers_no_checkpoint_holds():
    with pytest.raises(ConfigError, match=r"non-persistent buffers \['h\.0\.attn\.mask'"):
        Pipeline(
            models.build("gpt", True),
            2,
            devices=["cpu", "cpu"],
            example_inputs=(models.tokens(0)[0][:2],),
            init_weights="skip",
        )


def test_a_traced_meta_model_needs_example_inputs():
    with pytest.raises(ConfigError, match="meta device .* example_inputs="):
        Pipeline(models.build("gpt", True), 2, devices=["cpu", "cpu"], num_stages=2)


def test_initialize_equals_itself_on_meta_and_on_a_built_model():
    torch.manual_seed(3)
    with torch.device("meta"):
        on_meta = models.GPT()
    pipesched.initialize(on_meta, models.gpt_init, seed=7)
    built = pipesched.initialize(models.GPT(), models.gpt_init, seed=7)
    for (name, a), b in zip(on_meta.state_dict().items(), built.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_skip_with_nothing_loaded_refuses_to_run_naming_the_tensors():
    """Issue 25 item 7: uninitialized memory (6.9e-310, a loss of ln 4) trained on silently."""
    pipe = Pipeline(models.build("seq", True), 2, devices=["cpu", "cpu"], init_weights="skip")
    x, y = models.batch(0)
    with pytest.raises(ConfigError, match=r"init_weights='skip'.*never written \(0\.weight"):
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    with torch.no_grad(), pytest.raises(ConfigError, match=r"pipe\(x\) ran before the weights"):
        pipe(x)
    assert all(p.grad is None for p in pipe.parameters())


def test_skip_with_part_loaded_names_only_what_is_left():
    state = models.build("seq", False).state_dict()
    pipe = Pipeline(models.build("seq", True), 2, devices=["cpu", "cpu"], init_weights="skip")
    first = next(iter(state))
    pipe.load_state_dict({k: v for k, v in state.items() if k != first}, strict=False)
    with pytest.raises(ConfigError, match=rf"1 of them were never written \({first}\)"):
        pipe.step(*models.batch(0), loss_fn=nn.functional.mse_loss)


def test_skip_then_load_trains_like_the_normal_build():
    reference = Pipeline(models.build("seq", False), 2, devices=["cpu", "cpu"])
    pipe = Pipeline(models.build("seq", True), 2, devices=["cpu", "cpu"], init_weights="skip")
    pipe.load_state_dict(reference.state_dict())
    x, y = models.batch(0)
    for p in (reference, pipe):
        p.step(x, y, loss_fn=nn.functional.mse_loss)
    for (n, a), (_, b) in zip(reference.named_parameters(), pipe.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n


def test_skip_then_an_assigning_load_counts_as_loaded():
    state = models.build("seq", False).state_dict()
    pipe = Pipeline(models.build("seq", True), 2, devices=["cpu", "cpu"], init_weights="skip")
    pipe.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    pipe.step(*models.batch(0), loss_fn=nn.functional.mse_loss)


class _NormFirst(nn.Module):
    """A traced model whose BatchNorm the stage calls as a layer (its code is torch's)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.bn(x)
        for block in self.blocks:
            x = block(x).tanh()
        return self.head(x)


@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
def test_a_traced_meta_model_with_a_layer_called_as_a_module_trains_like_the_normal_build():
    """The BatchNorm's tensors stayed on meta: torch's 'Cannot copy out of meta tensor'."""
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    runs = []
    for meta in (True, False):
        torch.manual_seed(3)
        with torch.device("meta" if meta else "cpu"):
            model = _NormFirst()
        pipe = Pipeline(model, 2, devices=["cpu"] * 2, example_inputs=(x[:4],))
        if not meta:  # the weights a meta build draws: initialize's, from the same seed
            torch.manual_seed(3)
            pipesched.initialize(model, seed=torch.initial_seed())
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        runs.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        runs[-1].update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
    meta_run, normal = runs
    for name, value in meta_run.items():
        torch.testing.assert_close(value, normal[name], rtol=1e-12, atol=1e-14, msg=name)
