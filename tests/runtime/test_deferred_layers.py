"""Layers that defer their own weights: bitwise the whole backward, shared weights read in B."""

from __future__ import annotations

import copy
import pickle
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from pipesched import Pipeline
from pipesched.runtime.backward import backward_full, backward_input
from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore
from pipesched.runtime.deferred_layers import deferring, install_deferred_layers
from tests.runtime.test_deferred import Block, ConvNet, Masked, Scale, TiedLM, TwiceAndShared

DTYPE = torch.float64


def _context(how: str, store: WeightStore) -> AbstractContextManager[Any]:
    if how == "mode":
        return DeferredWeightsMode(store)
    return deferring(store) if how == "layers" else torch.enable_grad()


def _grads(model: nn.Module, x: Tensor, how: str) -> tuple[list[Tensor | None], int]:
    """Input and parameter gradients of one backward (``whole``), or of B then W under the
    mode or the layers' own deferral; and how many products B stashed."""
    model.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(x.is_floating_point())
    store = WeightStore()
    with _context(how, store):
        y = model(leaf)
    g = torch.randn(y.shape, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    if how == "whole":
        (gx,) = backward_full([y], [g], [leaf])
        return [gx, *(p.grad for p in model.parameters())], 0
    (gx,), w = backward_input([y], [g], [leaf], store)
    stashed = len(store)
    w.run()
    return [gx, *(p.grad for p in model.parameters())], stashed


def _parametrized_block() -> nn.Module:
    layer = nn.Linear(6, 6)
    parametrize.register_parametrization(layer, "weight", Scale())
    return nn.Sequential(layer, nn.Tanh(), Block())


X = torch.randn(3, 4, 6, dtype=DTYPE)
IDS = torch.tensor([[1, 0, 3, 9], [2, 2, 0, 5]])


@pytest.mark.parametrize(
    ("build", "x"),
    [
        (Block, X),
        (TwiceAndShared, X),
        (TiedLM, IDS),
        (_parametrized_block, X),
        (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0, batch_first=True), X),
        (lambda: Masked(causal=True), X),
        (ConvNet, torch.randn(2, 3, 8, 8, dtype=DTYPE)),
        (
            lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="circular"),
            torch.randn(2, 3, 8, 8, dtype=DTYPE),
        ),
    ],
    ids=[
        "block",
        "twice-and-shared",
        "tied-lm",
        "parametrized",
        "encoder",
        "causal",
        "conv",
        "circular-conv",
    ],
)
def test_layers_defer_what_the_mode_defers_bitwise(build, x) -> None:
    torch.manual_seed(0)
    model = build().to(DTYPE)
    assert install_deferred_layers(model) > 0
    whole, _ = _grads(model, x, "whole")
    mode, by_mode = _grads(model, x, "mode")
    layers, by_layers = _grads(model, x, "layers")
    assert by_layers == by_mode > 0
    assert whole[0] is None or torch.equal(whole[0], layers[0])  # type: ignore[arg-type]
    for a, b, c in zip(whole[1:], mode[1:], layers[1:], strict=True):
        assert a is not None and b is not None and c is not None
        assert torch.equal(a, b) and torch.equal(a, c)


def test_outside_a_split_backward_a_layer_runs_its_own_forward() -> None:
    layer = nn.Linear(6, 6)
    install_deferred_layers(layer)
    assert type(layer(torch.randn(2, 6)).grad_fn).__name__ == "AddmmBackward0"
    store = WeightStore()
    with deferring(store), torch.no_grad():
        assert layer(torch.randn(2, 6)).grad_fn is None
    assert install_deferred_layers(layer) == 1  # idempotent


def test_a_model_with_deferring_layers_copies_and_pickles() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
    install_deferred_layers(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        store = WeightStore()
        with deferring(store):
            y = twin(torch.randn(2, 6, requires_grad=True))
        _, w = backward_input([y], [torch.ones_like(y)], [], store)
        assert len(store) == 2  # the twin's own layers deferred into the store
        w.run()
        assert all(p.grad is not None for p in twin.parameters())
        assert all(p.grad is None for p in model.parameters())


class Sometimes(nn.Module):
    """``fc.weight`` also used directly, where the data (or a switch) says so."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(6, 6), nn.Linear(6, 6)
        self.direct: bool | None = None  # None: where the micro-batch's sum is positive
        self.taken: set[bool] = set()

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        direct = bool(x.sum() > 0) if self.direct is None else self.direct
        self.taken.add(direct)
        if direct:
            h = h + torch.tanh(x) @ self.fc.weight.t()
        return self.out(torch.tanh(h))


def _pipeline_grads(schedule: str, switches: list[bool | None], x: Tensor, y: Tensor) -> list:
    """Per step (``switches``: whether it uses ``fc.weight`` directly), the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Sometimes(), Sometimes(), nn.Linear(6, 6))
    model = model.to(DTYPE)
    pipe = Pipeline(model, 4, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule)
    grads = []
    for direct in switches:
        model[1].direct = model[2].direct = direct
        model.zero_grad(set_to_none=True)
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        grads.append([p.grad for p in model.parameters()])
    assert model[2].taken == {True, False}
    return grads


def test_a_weight_used_directly_in_some_steps_only_stays_bitwise() -> None:
    """The graph read in each B sees the direct use where and only where it happened."""
    x, y = torch.randn(8, 6, dtype=DTYPE), torch.randn(8, 6, dtype=DTYPE)
    switches: list[bool | None] = [False, True, False, True]
    reference = _pipeline_grads("1f1b", switches, x, y)
    for a, b in zip(reference, _pipeline_grads("zb-h1", switches, x, y), strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_a_weight_used_directly_by_some_micro_batches_only_stays_bitwise() -> None:
    """Where a micro-batch's B takes ``fc.weight``'s gradient, earlier ones' W of it run
    first: ``.grad`` sums the micro-batches in order, as 1F1B's does."""
    generator = torch.Generator().manual_seed(3)  # branches taken: unordered sums differ
    x = torch.randn(8, 6, dtype=DTYPE, generator=generator)
    y = torch.randn(8, 6, dtype=DTYPE, generator=generator)
    reference = _pipeline_grads("1f1b", [None], x, y)
    for a, b in zip(reference, _pipeline_grads("zb-h1", [None], x, y), strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_a_loss_using_a_weight_flags_it() -> None:
    """The loss function's ops are in the graph B reads, not under any deferral."""
    x, y = torch.randn(8, 6, dtype=DTYPE), torch.randn(8, 6, dtype=DTYPE)
    grads = []
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(DTYPE)
        last = model[2]

        def loss_fn(out: Tensor, target: Tensor, last: nn.Module = last) -> Tensor:
            return nn.functional.mse_loss(out, target) + last.weight.square().sum()

        pipe = Pipeline(model, 4, balance=[2, 1], devices=["cpu", "cpu"], schedule=schedule)
        pipe.step(x, y, loss_fn=loss_fn)
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*grads, strict=True))


def _gpt2_block() -> nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(n_embd=6, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    config._attn_implementation = "eager"

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = GPT2Block(config, layer_idx=0)

        def forward(self, x: Tensor) -> Tensor:
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out

    return Block()


@pytest.mark.parametrize(
    ("build", "deferred"),
    [
        (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.5, batch_first=True), 6),
        (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0, batch_first=False), 6),
        (_gpt2_block, 6),  # two norms, four Conv1D
    ],
    ids=["encoder-dropout", "encoder-sequence-first", "gpt2-block"],
)
def test_attention_and_gpt2_conv1d_defer_without_the_mode(build, deferred, monkeypatch) -> None:
    """Their calls go to the deferring Functions directly, never through the mode."""
    torch.manual_seed(0)
    model = build().to(DTYPE)
    install_deferred_layers(model)
    modes: list[str] = []
    entered = DeferredWeightsMode.__enter__

    def enter(mode: DeferredWeightsMode) -> DeferredWeightsMode:
        modes.append("entered")
        return entered(mode)

    monkeypatch.setattr(DeferredWeightsMode, "__enter__", enter)
    torch.manual_seed(2)
    whole, _ = _grads(model, X, "whole")
    torch.manual_seed(2)
    layers, by_layers = _grads(model, X, "layers")
    assert not modes and by_layers == deferred
    for a, b in zip(whole, layers, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


def test_a_layer_returning_none_runs_once() -> None:
    class Probe(nn.Module):  # owns a parameter; its forward has a side effect, returns None
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.calls = 0

        def forward(self, x: Tensor) -> None:
            self.calls += 1

    probe = Probe()
    install_deferred_layers(probe)
    with deferring(WeightStore()):
        assert probe(torch.randn(2, 6, requires_grad=True)) is None
    assert probe.calls == 1


class _PerSample(nn.Module):
    """A layer applying its Linear per sample under ``torch.func.vmap``, then one directly."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.outer = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(torch.func.vmap(self.inner)(x).tanh())


@pytest.mark.parametrize("how", ["layers", "mode"])
def test_a_layer_under_a_functorch_transform_runs_as_its_own(how) -> None:
    """Inside ``vmap`` its operands are functorch's wrappers: torch's own op runs there
    (the Functions have no vmap rule), the layer outside the transform still defers."""
    torch.manual_seed(0)
    model = _PerSample().to(DTYPE)
    install_deferred_layers(model)
    whole, _ = _grads(model, X, "whole")
    split, stashed = _grads(model, X, how)
    assert stashed == 1  # the outer Linear's; the inner one's gradients come from autograd in B
    for a, b in zip(whole, split, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


class _UnderVmap(nn.Module):
    """A Linear called inside ``vmap`` on a tensor vmap does not map (a constant's)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        basis = torch.eye(6, dtype=x.dtype)
        return torch.func.vmap(lambda row: self.inner(basis) @ row)(x.reshape(-1, 6)).view_as(x)


def test_a_layer_inside_a_transform_on_a_plain_operand_runs_as_its_own() -> None:
    torch.manual_seed(0)
    model = _UnderVmap().to(DTYPE)
    install_deferred_layers(model)
    whole, _ = _grads(model, X, "whole")
    split, stashed = _grads(model, X, "layers")
    assert stashed == 0
    for a, b in zip(whole, split, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


def test_a_compiled_layer_is_not_deferred_and_trains_exactly_in_every_schedule():
    # Dynamo would compile a deferring forward without a guard on the thread's deferral;
    # a pipeline run after another (another schedule) then recomputed a different graph.
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        compiled = torch.compile(nn.Linear(16, 16))
        layers = [nn.Linear(16, 16), compiled, nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)]
        return nn.Sequential(*layers).double()

    reference = build()
    nn.functional.mse_loss(reference(x), y).backward()
    for schedule in ("zb-v", "zb-h2", "zb-h1"):
        model = build()
        pipe = Pipeline(model, 4, devices=["cpu", "cpu"], schedule=schedule)
        assert install_deferred_layers(model[1]) == 0
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)
