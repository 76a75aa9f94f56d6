"""Deferred weight gradients: B + W against one whole backward, bitwise in fp64."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from pipesched import Pipeline
from pipesched.errors import ScheduleError
from pipesched.runtime.backward import backward_full, backward_input
from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore

DTYPE = torch.float64


class Conv1D(nn.Module):
    """HF GPT-2's ``Conv1D``: ``addmm`` with an ``(in, out)`` weight."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)


class Block(nn.Module):
    """Every deferred op: layer norms (one without bias), linears (one without bias), addmm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.norm2 = nn.LayerNorm(6, bias=False)
        self.fc = nn.Linear(6, 12)
        self.proj = nn.Linear(12, 6, bias=False)
        self.conv = Conv1D(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.proj(torch.tanh(self.fc(self.norm(x))))
        return self.conv(self.norm2(h))


class TwiceAndShared(nn.Module):
    """``a`` applied twice; ``b``'s weight also used by a matmul the mode does not defer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(torch.tanh(self.b(self.a(x))))
        return h + x @ self.b.weight.t()


class TiedLM(nn.Module):
    """A first stage fed token ids, its embedding tied to its head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.norm(self.emb(ids)))


class AtenEmbedding(nn.Module):
    """A traced stage's embedding: ``aten.embedding``, padding_idx -1 meaning none."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 6))

    def forward(self, ids: Tensor) -> Tensor:
        return torch.ops.aten.embedding.default(self.weight, ids).sum(-1)


class LastRowPadding(nn.Module):
    """``F.embedding``'s padding_idx -1: the last row, no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=-1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.emb(ids).sum(-1)


class Scale(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return w * 2


class Masked(nn.Module):
    def __init__(self, *, causal: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.fc = nn.Linear(6, 6)
        self.causal = causal

    def forward(self, x: Tensor) -> Tensor:
        mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
        out = self.attn(x, x, x, attn_mask=mask, need_weights=False, is_causal=self.causal)
        return self.fc(out[0])


class Strided(nn.Module):
    """Linears on non-contiguous inputs (3-D and 4-D): ATen's ``linear`` runs ``matmul``
    then ``add_`` there, whose bias gradient sums the rows in another order than ``addmm``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        h = self.b(torch.tanh(self.a(x.transpose(0, 1))).transpose(0, 1))
        return self.c(torch.stack([h, x]).transpose(1, 2))


class WrittenInPlace(nn.Module):
    """Each deferring op's output written in place next, as ``nn.ReLU(inplace=True)`` does:
    ATen's linear of a 3-D input with a bias and an embedding of 2-D ids return views."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(10, 6), nn.LayerNorm(6)
        self.linear, self.conv = nn.Linear(6, 6), nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.norm(self.embed(ids).mul_(2)).add_(1)
        return self.conv(self.linear(h).relu_()).tanh_()


def _parametrized() -> nn.Module:
    layer = nn.Linear(6, 6)
    parametrize.register_parametrization(layer, "weight", Scale())
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 6))


def _run(
    build: Callable[[], nn.Module], x: Tensor, *, split: bool, ckpt: bool
) -> tuple[Tensor | None, dict[str, Tensor | None], int]:
    torch.manual_seed(0)
    model = build().to(DTYPE)
    leaf = x.detach().requires_grad_(x.is_floating_point())
    store = WeightStore() if split else None

    def forward(inp: Tensor) -> Tensor:
        if store is None:
            return model(inp)  # type: ignore[no-any-return]
        with DeferredWeightsMode(store):
            return model(inp)  # type: ignore[no-any-return]

    torch.manual_seed(2)  # the same dropout masks in both runs (and, preserved, recomputed)
    y = checkpoint(forward, leaf, use_reentrant=False) if ckpt else forward(leaf)
    g = torch.randn(y.shape, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    stashed = 0
    if store is None:
        (gx,) = backward_full([y], [g], [leaf])
    else:
        (gx,), w = backward_input([y], [g], [leaf], store)
        stashed = len(store)
        w.run()
        assert len(store) == 0  # W frees what B kept
    return gx, {n: p.grad for n, p in model.named_parameters()}, stashed


def _assert_bitwise(build: Callable[[], nn.Module], x: Tensor, ckpt: bool) -> int:
    gx, grads, _ = _run(build, x, split=False, ckpt=ckpt)
    gx2, grads2, stashed = _run(build, x, split=True, ckpt=ckpt)
    assert (gx is None and gx2 is None) or torch.equal(gx, gx2)  # type: ignore[arg-type]
    assert grads.keys() == grads2.keys()
    for name, grad in grads.items():
        assert grad is not None and grads2[name] is not None, name
        assert torch.equal(grad, grads2[name]), name  # type: ignore[arg-type]
    return stashed


X = torch.randn(3, 4, 6, dtype=DTYPE)
IDS = torch.tensor([[1, 0, 3, 9], [2, 2, 0, 5]])


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize(
    ("build", "x", "deferred"),
    [
        (Block, X, 5),  # every op of the block defers its parameters
        (TwiceAndShared, X, 3),  # a twice, b's bias; b's weight is shared: autograd's, in B
        (TiedLM, IDS, 3),  # the tied weight deferred twice (embedding, head), the norm
        (_parametrized, X, 2),  # the parametrized weight is not a leaf: autograd's, in B
        (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0, batch_first=True), X, 6),
        (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.5, batch_first=True), X, 6),
        (lambda: Masked(), X, 1),  # a masked attention is torch's: its projections in B
        (lambda: Masked(causal=True), X, 3),  # a causal mask with the hint: SDPA's is_causal
        (AtenEmbedding, IDS, 1),  # id 9, the last row, gets its gradient (-1 is no padding)
        (LastRowPadding, IDS, 1),  # id 9 is the padding row here: no gradient
        (Strided, torch.randn(16, 32, 6, dtype=DTYPE), 3),
        (WrittenInPlace, IDS, 4),
    ],
    ids=[
        "block",
        "twice-and-shared",
        "tied-lm",
        "parametrized",
        "encoder-layer",
        "encoder-layer-dropout",
        "masked-attention",
        "causal-attention",
        "aten-embedding",
        "last-row-padding",
        "strided-inputs",
        "written-in-place",
    ],
)
def test_b_then_w_equals_the_whole_backward_bitwise(build, x, deferred, ckpt) -> None:
    assert _assert_bitwise(build, x, ckpt) == deferred


def test_b_leaves_the_deferred_weights_untouched_and_w_runs_once() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
    store = WeightStore()
    with DeferredWeightsMode(store):
        y = model(x)
    (gx,), w = backward_input([y], [torch.ones_like(y)], [x], store)
    assert gx is not None and all(p.grad is None for p in model.parameters())
    w.run()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ScheduleError):
        w.run()


def test_an_input_that_does_not_require_grad_gets_none_and_weights_are_exact() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            return self.a(x) * self.b(mask)  # b is reached only from the input without grad

    grads = []
    for split in (False, True):
        torch.manual_seed(0)
        model = Two().to(DTYPE)
        x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
        mask = torch.randn(4, 6, dtype=DTYPE)
        store = WeightStore()
        with DeferredWeightsMode(store) if split else torch.enable_grad():
            y = model(x, mask)
        if split:
            (gx, gm), w = backward_input([y], [torch.ones_like(y)], [x, mask], store)
            w.run()
        else:
            gx, gm = backward_full([y], [torch.ones_like(y)], [x, mask])
        assert gm is None
        grads.append([gx, *(p.grad for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_weight_with_a_gradient_hook_is_left_to_autograd() -> None:
    layer = nn.Linear(6, 6).to(DTYPE)
    seen: list[Tensor] = []
    layer.weight.register_hook(lambda g: seen.append(g))
    x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
    store = WeightStore()
    with DeferredWeightsMode(store):
        y = layer(x)
    _, w = backward_input([y], [torch.ones_like(y)], [x], store)
    assert len(seen) == 1 and layer.weight.grad is not None  # in B, through its hook
    assert len(store) == 1  # the bias alone is deferred
    w.run()
    assert layer.bias.grad is not None


class ScaledInPlace(nn.Module):
    """Not a Sequential (traced into ATen ops): each linear's output scaled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x).mul_(0.5)
        return x


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(6, 6), nn.ReLU(True)))),
        ScaledInPlace,
    ],
    ids=["sequential-relu-inplace", "traced-mul-inplace"],
)
def test_outputs_of_deferring_layers_written_in_place_equal_1f1b_bitwise(build, schedule) -> None:
    """A 3-D linear with a bias returns a view, which a Function's output may not be when
    written in place (``nn.ReLU(inplace=True)``): B + W still equals 1F1B to the bit."""
    x = torch.randn(8, 3, 6, dtype=DTYPE)
    grads = []
    for name in ("1f1b", schedule):
        torch.manual_seed(0)
        model = build().to(DTYPE)
        pipe = Pipeline(model, 4, devices=["cpu", "cpu"], schedule=name)
        pipe.step(x, loss_fn=lambda out: out.square().mean())
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint_mode", ["never", "always"])
def test_zero_bubble_step_equals_1f1b_bitwise(checkpoint_mode) -> None:
    """Deferred W accumulates what 1F1B's whole backward does, micro-batch by micro-batch."""
    x, y = torch.randn(8, 4, 6, dtype=DTYPE), torch.randn(8, 4, 6, dtype=DTYPE)
    grads = []
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), nn.Linear(6, 6), Block(), nn.Linear(6, 6)).to(DTYPE)
        pipe = Pipeline(
            model, 4, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule,
            checkpoint=checkpoint_mode,
        )  # fmt: skip
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint_mode", ["never", "always"])
def test_back_to_back_pairs_run_whole_and_equal_the_split_bitwise(
    checkpoint_mode, monkeypatch
) -> None:
    """zb-v's pairs that Schedule.whole_backwards names run one whole backward (their
    forward deferring nothing), the others B then W; the gradients are the all-split run's."""
    from pipesched.runtime import passes

    x, y = torch.randn(8, 4, 6, dtype=DTYPE), torch.randn(8, 4, 6, dtype=DTYPE)
    split_calls: list[int] = []
    backward_input = passes.backward_input

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        split_calls.append(1)
        return backward_input(*args, **kwargs)

    monkeypatch.setattr(passes, "backward_input", counted)
    grads, splits = [], []
    for whole in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), nn.Linear(6, 6), Block(), nn.Linear(6, 6)).to(DTYPE)
        pipe = Pipeline(
            model, 4, balance=[1, 1, 1, 1], devices=["cpu", "cpu"], schedule="zb-v",
            checkpoint=checkpoint_mode,
        )  # fmt: skip
        pipe.engine.runtime.passes.whole_backward = whole
        split_calls.clear()
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        splits.append(len(split_calls))
        grads.append([p.grad for p in model.parameters()])
    schedule = pipe.schedule_for(4)
    assert splits == [4 * 4 - len(schedule.whole_backwards), 4 * 4]
    assert len(schedule.whole_backwards) == 7  # stages 0 and 2, but the last pair of stage 2
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_the_mode_changes_no_forward_value() -> None:
    """The mode changes no forward value: outputs equal the plain forward's bitwise."""
    torch.manual_seed(0)
    model = Block().to(DTYPE)
    plain = copy.deepcopy(model)
    with DeferredWeightsMode(WeightStore()):
        out = model(X)
    assert torch.equal(out, plain(X))


class ConvNet(nn.Module):
    """Convolutions: strided, grouped, bias-free, 1-d; one with padding="same" stays torch's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=False)
        self.c = nn.Conv1d(4, 2, 2)
        self.same = nn.Conv2d(4, 4, 3, padding="same")

    def forward(self, x: Tensor) -> Tensor:
        h = self.b(self.same(torch.relu(self.a(x))))
        return self.c(h.flatten(2))


@pytest.mark.parametrize("ckpt", [False, True])
def test_convolutions_b_then_w_equal_the_whole_backward_bitwise(ckpt) -> None:
    assert _assert_bitwise(ConvNet, torch.randn(2, 3, 8, 8, dtype=DTYPE), ckpt) == 3
