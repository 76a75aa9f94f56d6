"""Fused weight-gradient accumulation of linear layers, against plain autograd."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from pipesched import Pipeline
from pipesched.runtime import fused_linear
from pipesched.runtime.backward import backward_full, backward_input
from pipesched.runtime.deferred_ops import _Linear as _DeferredLinear
from pipesched.runtime.fused_linear import (
    MIN_FUSED_BYTES,
    FusedLinearMode,
    _FusedLinear,
    accumulate,
    unshared_parameters,
    worth_fusing,
)

EXACT = {"rtol": 1e-12, "atol": 1e-12}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _model(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 8, bias=bias), nn.Linear(8, 5)
    ).double()


def _fused(model: nn.Module) -> Callable[[Tensor], Tensor]:
    allowed = unshared_parameters([model])[0]

    def run(x: Tensor) -> Tensor:
        with FusedLinearMode(allowed):
            return model(x)

    return run


def _grads(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same(actual: list[Tensor | None], expected: list[Tensor | None]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, **EXACT)


@pytest.mark.parametrize("shape", [(7, 6), (3, 4, 6), (6,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_gradients_equal_autograd_over_several_backwards(shape, bias) -> None:
    plain, fused = _model(bias), _model(bias)
    run = _fused(fused)
    for step in range(3):  # the first sets .grad, the next ones accumulate into it
        torch.manual_seed(step)
        x = torch.randn(*shape, dtype=torch.float64)
        xp, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(xp).pow(2).sum().backward()
        out = run(xf)
        assert type(out.grad_fn).__name__ == "_FusedLinearBackward"
        out.pow(2).sum().backward()
        torch.testing.assert_close(xf.grad, xp.grad, **EXACT)
    _assert_same(_grads(fused), _grads(plain))


@pytest.mark.parametrize("shape", [(16, 32, 6), (4, 16, 8, 6)], ids=["3d", "4d"])
def test_a_bias_gradient_is_autograds_bitwise_on_a_non_contiguous_input(shape) -> None:
    # There ATen's linear runs matmul then add_, whose bias gradient is sum_to over the
    # leading dimensions of the output's gradient as it comes (here not contiguous):
    # the rows summed in another order than addmm's sum over rows.
    torch.manual_seed(0)
    plain = nn.Linear(6, 5).double()
    fused = copy.deepcopy(plain)
    x = torch.randn(*shape, dtype=torch.float64).transpose(0, 1)
    w = torch.randn(*shape[:-1], 5, dtype=torch.float64).transpose(0, 1)
    (plain(x) * w).sum().backward()
    (_fused(fused)(x) * w).sum().backward()
    assert torch.equal(fused.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("shape", [(3, 4, 6), (2, 3, 4, 6)], ids=["3d", "4d"])
def test_an_output_written_in_place_gets_autograds_gradients(shape) -> None:
    # ATen's linear of a contiguous N-D input with a bias returns a view of its 2-D addmm;
    # autograd forbids writing in place into a view made inside a Function's forward.
    plain = _model()
    fused = copy.deepcopy(plain)
    x = torch.randn(*shape, dtype=torch.float64)
    plain[0](x).relu_().sum().backward()
    _fused(fused[0])(x).relu_().sum().backward()
    _assert_same(_grads(fused), _grads(plain))


def test_fused_backward_adds_in_the_gemm_instead_of_after_it() -> None:
    model = _model()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(4, 6, dtype=torch.float64)
    with _CountOps() as plain:
        model(x).sum().backward()
    with _CountOps() as fused:
        backward_full([_fused(model)(x).sum()], None, [])  # a backward pipesched declares
    # Plain autograd: mm for each weight gradient, then an add_ into .grad.
    # Fused: one addmm_ per weight, no add_ for weights (biases still add_).
    assert fused.counts["aten.addmm_.default"] == 3
    assert fused.counts["aten.add_.Tensor"] == plain.counts["aten.add_.Tensor"] - 3


def test_a_backward_pipesched_does_not_run_gets_the_gradients_returned() -> None:
    """Whether it accumulates or captures a weight is not known: autograd is given it (exact)."""
    plain, fused = _model(), _model()
    for p in (*plain.parameters(), *fused.parameters()):
        p.grad = torch.ones_like(p)
    x = torch.randn(4, 6, dtype=torch.float64)
    plain(x).sum().backward()
    with _CountOps() as ops:
        _fused(fused)(x).sum().backward()
    assert ops.counts["aten.addmm_.default"] == 0
    _assert_same(_grads(fused), _grads(plain))


def test_split_backward_b_leaves_grads_alone_and_w_fuses() -> None:
    full, split = _model(), _model()
    x, g = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    (gx_full,) = backward_full([_fused(full)(xf)], [g], [xf])
    with _CountOps() as b:
        (gx_split,), w = backward_input([_fused(split)(xs)], [g], [xs])
    assert all(p.grad is None for p in split.parameters())
    assert b.counts["aten.addmm_.default"] == 0  # no weight work in B
    with _CountOps() as w_ops:
        w.run()
    # W computes no input gradient: only the weight GEMMs (the first sets .grad).
    assert w_ops.counts["aten.mm.default"] == 3
    torch.testing.assert_close(gx_split, gx_full, **EXACT)
    _assert_same(_grads(split), _grads(full))


def test_first_stage_without_input_gradient_fuses_everything_in_w() -> None:
    plain, split = _model(), _model()
    x, g = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    plain(x).backward(g)
    (none,), w = backward_input([_fused(split)(x)], [g], [x])
    assert none is None and all(p.grad is None for p in split.parameters())
    w.run()
    _assert_same(_grads(split), _grads(plain))


def test_checkpointed_fused_linear_accumulates_into_the_parameters() -> None:
    plain, fused = _model(), _model()
    x = torch.randn(4, 6, dtype=torch.float64)
    plain(x).sum().backward()
    checkpoint(_fused(fused), x, use_reentrant=False).sum().backward()
    _assert_same(_grads(fused), _grads(plain))


def _linear_calls(run: Callable[[], Any]) -> int:
    """How many fused linears ``run`` builds (in a split backward: deferred linears whose
    weight W accumulates inside the GEMM)."""
    count = 0
    original = _FusedLinear.forward
    original_deferred = _DeferredLinear.forward

    def counting(ctx: Any, *args: Any) -> Tensor:
        nonlocal count
        count += 1
        return original(ctx, *args)

    def counting_deferred(ctx: Any, *args: Any) -> Tensor:
        nonlocal count
        weight, store = args[1], args[4]
        count += id(weight) in store.fused
        return original_deferred(ctx, *args)

    _FusedLinear.forward = staticmethod(counting)  # type: ignore[method-assign]
    _DeferredLinear.forward = staticmethod(counting_deferred)  # type: ignore[method-assign]
    try:
        run()
    finally:
        _FusedLinear.forward = staticmethod(original)  # type: ignore[method-assign]
        _DeferredLinear.forward = staticmethod(original_deferred)  # type: ignore[method-assign]
    return count


def test_ineligible_calls_take_the_ordinary_path() -> None:
    model = _model()
    x = torch.randn(4, 6, dtype=torch.float64)
    assert _linear_calls(lambda: _fused(model)(x)) == 3
    with pytest.raises(RuntimeError, match="dtype"):  # dtype differs: torch's own error
        _linear_calls(lambda: _fused(model)(x.float()))
    with torch.no_grad():
        assert _linear_calls(lambda: _fused(model)(x)) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _linear_calls(lambda: _fused(model)(x)) == 0
    with FusedLinearMode(frozenset()):  # shared parameters are never allowed
        assert _linear_calls(lambda: model(x)) == 0
    seen: list[Tensor] = []
    model[0].weight.register_hook(lambda g: seen.append(g))
    assert _linear_calls(lambda: _fused(model)(x).sum().backward()) == 2  # hooked layer: plain
    assert len(seen) == 1


def test_unshared_parameters_leave_out_what_two_stages_hold() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    first, second = unshared_parameters([a, b, None])[:2]
    assert first == {id(a.bias)} and second == {id(b.bias)}


# ---------------------------------------------------------------- in a Pipeline


@pytest.fixture
def fuse_every_size(monkeypatch):
    """The fusion's mechanics on small models: every weight is worth fusing."""
    monkeypatch.setattr(fused_linear, "MIN_FUSED_BYTES", 0)


@pytest.mark.parametrize(
    ("schedule", "balance"),
    [("gpipe", [2, 2]), ("1f1b", [2, 2]), ("zb-h1", [2, 2]), ("zb-v", [1, 1, 1, 1])],
)
@pytest.mark.parametrize("checkpoint_mode", ["never", "except_last"])
def test_pipeline_step_fused_equals_unfused(
    fp64, fuse_every_size, schedule, balance, checkpoint_mode
) -> None:
    x, y = torch.randn(10, 6), torch.randn(10, 5)
    grads = []
    for fuse in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 5))
        pipe = Pipeline(
            model,
            4,
            balance=balance,
            devices=["cpu", "cpu"],
            schedule=schedule,
            checkpoint=checkpoint_mode,
            fuse_weight_grads=fuse,
        )
        calls = _linear_calls(lambda pipe=pipe: pipe.step(x, y, loss_fn=nn.functional.mse_loss))
        # 3 linears x 4 micro-batches, and again in each checkpoint recomputation.
        assert calls >= 12 if fuse else calls == 0
        grads.append(_grads(model))
    _assert_same(grads[1], grads[0])


def test_pipeline_forward_for_the_callers_backward_is_not_fused(fp64, fuse_every_size) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    pipe = Pipeline(model, 2, balance=[2, 1], devices=["cpu", "cpu"])
    assert _linear_calls(lambda: pipe(torch.randn(4, 6))) == 0


def test_weight_tied_across_stages_is_accumulated_by_autograd(fp64, fuse_every_size) -> None:
    """Two worker threads would race on a fused ``.grad``: a tied weight stays plain."""
    torch.manual_seed(0)
    first, last = nn.Linear(5, 5), nn.Linear(5, 5)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), last)
    reference = nn.Sequential(*(m for m in model))  # the same parameters, run plainly
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    nn.functional.mse_loss(reference(x), y).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    pipe = Pipeline(model, 4, balance=[2, 1], devices=["cpu", "cpu"], schedule="1f1b")
    calls = _linear_calls(lambda: pipe.step(x, y, loss_fn=nn.functional.mse_loss))
    assert calls == 0  # both linears' weights are shared; their biases alone do not fuse
    _assert_same(_grads(model), expected)


def test_a_linear_applied_twice_in_one_stage_splits_exactly() -> None:
    """W re-runs the input-gradient chain between two uses of a weight; nothing counts twice."""
    torch.manual_seed(0)
    a, b = nn.Linear(5, 5).double(), nn.Linear(5, 5).double()

    def forward(x: Tensor) -> Tensor:
        return a(torch.tanh(b(a(x))))

    allowed = unshared_parameters([nn.ModuleList([a, b])])[0]
    x, g = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    xp = x.clone().requires_grad_()
    forward(xp).backward(g)
    expected = [p.grad.clone() for p in (a.weight, a.bias, b.weight, b.bias)]
    for p in (a.weight, a.bias, b.weight, b.bias):
        p.grad = None
    xs = x.clone().requires_grad_()
    with FusedLinearMode(allowed):
        out = forward(xs)
    (gx,), w = backward_input([out], [g], [xs])
    w.run()
    torch.testing.assert_close(gx, xp.grad, **EXACT)
    _assert_same([p.grad for p in (a.weight, a.bias, b.weight, b.bias)], expected)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.fc2(torch.tanh(self.fc1(x)))) + x)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_traced_stages_fuse_their_aten_linears(fp64, fuse_every_size, schedule) -> None:
    x, y = torch.randn(8, 6), torch.randn(8, 5)
    grads, calls = [], []
    for fuse in (False, True):
        torch.manual_seed(0)
        model = _Residual()
        pipe = Pipeline(
            model,
            4,
            example_inputs=(x[:2],),
            num_stages=2,
            devices=["cpu", "cpu"],
            schedule=schedule,
            fuse_weight_grads=fuse,
        )
        calls.append(
            _linear_calls(lambda pipe=pipe: pipe.step(x, y, loss_fn=nn.functional.mse_loss))
        )
        grads.append(_grads(model))
    assert calls[0] == 0 and calls[1] >= 3 * 4
    _assert_same(grads[1], grads[0])


class _Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: ``bias + x @ weight`` with a ``(in, out)`` weight, via addmm."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], -1)


def test_gpt2_conv1d_addmm_is_fused_full_and_split() -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(_Conv1D(6, 8), nn.Tanh(), _Conv1D(8, 5)).double()

    plain, full, split = build(), build(), build()
    x, g = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    xp, xf, xs = (x.clone().requires_grad_() for _ in range(3))
    plain(xp).backward(g)
    returned: list[Any] = []
    assert _linear_calls(lambda: returned.extend(backward_full([_fused(full)(xf)], [g], [xf]))) == 2
    (gx,), w = backward_input([_fused(split)(xs)], [g], [xs])
    assert all(p.grad is None for p in split.parameters())
    w.run()
    for model, grad_x in ((full, returned[0]), (split, gx)):
        torch.testing.assert_close(grad_x, xp.grad, **EXACT)
        _assert_same(_grads(model), _grads(plain))
    with FusedLinearMode(unshared_parameters([plain])[0]):  # only beta = alpha = 1 is fused
        assert _linear_calls(lambda: torch.addmm(plain[0].bias, x[0], plain[0].weight, beta=2)) == 0


def test_a_checkpoint_inside_the_stage_runs_the_ordinary_linear() -> None:
    """Its recomputation runs without the mode, so its region must not fuse (found in review)."""
    torch.manual_seed(0)
    plain, fused = _model(), _model()  # Linear(6, 8): not square, a mix-up would also raise
    x = torch.randn(4, 6, dtype=torch.float64)
    plain(x).sum().backward()
    inner = lambda m, t: checkpoint(m, t, use_reentrant=False)  # noqa: E731
    allowed = unshared_parameters([fused])[0]
    with FusedLinearMode(allowed):
        calls = _linear_calls(lambda: inner(fused, x).sum().backward())
    assert calls == 0
    _assert_same(_grads(fused), _grads(plain))


def test_autograd_grad_of_a_weight_inside_the_stage_gets_it_returned() -> None:
    model = _model()
    x = torch.randn(4, 6, dtype=torch.float64)
    expected = torch.autograd.grad(model(x).sum(), model[0].weight)[0]
    with FusedLinearMode(unshared_parameters([model])[0]):
        out = model(x)
    (got,) = torch.autograd.grad(out.sum(), model[0].weight)
    torch.testing.assert_close(got, expected, **EXACT)
    assert all(p.grad is None for p in model.parameters())  # nothing accumulated


def test_odd_biases_complex_inputs_and_sparse_grads() -> None:
    weight = nn.Parameter(torch.randn(5, 6, dtype=torch.float64))
    one = nn.Parameter(torch.randn(1, dtype=torch.float64))  # broadcasts: autograd's job
    x = torch.randn(3, 6, dtype=torch.float64)
    with FusedLinearMode(frozenset({id(weight), id(one)})):
        assert _linear_calls(lambda: nn.functional.linear(x, weight, one)) == 0
    cw = nn.Parameter(torch.randn(5, 6, dtype=torch.complex128))
    with FusedLinearMode(frozenset({id(cw)})):  # complex gradients need conj()
        assert _linear_calls(lambda: nn.functional.linear(x.to(cw.dtype), cw)) == 0
    # A weight tied to a sparse embedding already holding a sparse .grad.
    emb = nn.Embedding(5, 6, sparse=True).double()
    idx = torch.tensor([1, 3])
    emb(idx).sum().backward()
    assert emb.weight.grad.is_sparse
    expected = (
        emb.weight.grad.to_dense()
        + torch.autograd.grad(nn.functional.linear(x, emb.weight).sum(), emb.weight)[0]
    )
    with FusedLinearMode(frozenset({id(emb.weight)})):
        out = nn.functional.linear(x, emb.weight)
    out.sum().backward()
    torch.testing.assert_close(emb.weight.grad.to_dense(), expected, **EXACT)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_w_of_a_fused_linear_skips_the_engine_unless_checkpointed(
    monkeypatch, checkpointed
) -> None:
    """Each engine call costs ~0.25 ms; a checkpointed node's recomputation needs the engine."""
    plain, split = _model(), _model()
    x, g = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    plain(x.clone().requires_grad_()).backward(g)
    xs = x.clone().requires_grad_()
    run = _fused(split)  # the mode inside the checkpointed function, as pipesched's stages
    if checkpointed:
        assert _linear_calls(lambda: checkpoint(run, xs, use_reentrant=False)) == 3
    out = checkpoint(run, xs, use_reentrant=False) if checkpointed else run(xs)
    _, w = backward_input([out], [g], [xs])
    calls = []
    engine = torch.autograd.backward
    monkeypatch.setattr(
        torch.autograd, "backward", lambda *a, **k: calls.append(1) or engine(*a, **k)
    )
    w.run()
    assert (len(calls) > 0) == checkpointed
    _assert_same(_grads(split), _grads(plain))


# ---------------------------------------------------------------- which weights are fused


def test_weights_from_min_fused_bytes_on_are_worth_fusing_with_their_biases() -> None:
    elements = MIN_FUSED_BYTES // 8  # fp64
    big = nn.Linear(elements // 4, 4).double()  # exactly MIN_FUSED_BYTES
    small = nn.Linear(elements // 4 - 1, 4).double()  # 32 bytes fewer
    half = nn.Linear(elements // 4, 4)  # the same shape in fp32: half the bytes
    both = nn.Sequential(small, big)
    stages = [both, nn.Sequential(small), nn.Sequential(half), None]
    worth = worth_fusing(stages, unshared_parameters(stages))
    # small is held by two stages: never allowed; big and its bias are worth it.
    assert worth == [{id(big.weight), id(big.bias)}, set(), set(), set()]
    assert worth == worth_fusing(stages, unshared_parameters(stages))  # shapes decide, alone
    lone = [nn.Sequential(small, big)]
    assert worth_fusing(lone, unshared_parameters(lone)) == [
        {id(big.weight), id(big.bias), id(small.bias)}  # small's weight: not worth it
    ]


def _one_small_one_big() -> nn.Sequential:
    """Linear(6, 8), Linear(8, n) of exactly MIN_FUSED_BYTES in fp64, Linear(n, 3) under it."""
    torch.manual_seed(0)
    wide = MIN_FUSED_BYTES // 8 // 8
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, wide), nn.Linear(wide, 3))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_fuses_the_big_layers_only_and_equals_the_plain_model(fp64, schedule) -> None:
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    reference = _one_small_one_big()
    nn.functional.mse_loss(reference(x), y).backward()
    model = _one_small_one_big()
    pipe = Pipeline(
        model, 4, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule, checkpoint="never"
    )
    fused: list[Tensor] = []
    original = _FusedLinear.forward
    original_deferred = _DeferredLinear.forward

    def recording(ctx: Any, x: Tensor, weight: Tensor, *args: Any) -> Tensor:
        fused.append(weight)
        return original(ctx, x, weight, *args)

    def recording_deferred(ctx: Any, x: Tensor, weight: Tensor, *args: Any) -> Tensor:
        if id(weight) in args[2].fused:  # zb-h1: W accumulates it inside the GEMM
            fused.append(weight)
        return original_deferred(ctx, x, weight, *args)

    _FusedLinear.forward = staticmethod(recording)  # type: ignore[method-assign]
    _DeferredLinear.forward = staticmethod(recording_deferred)  # type: ignore[method-assign]
    try:
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    finally:
        _FusedLinear.forward = staticmethod(original)  # type: ignore[method-assign]
        _DeferredLinear.forward = staticmethod(original_deferred)  # type: ignore[method-assign]
    assert [w is model[2].weight for w in fused] == [True] * 4  # once per micro-batch
    _assert_same(_grads(model), _grads(reference))


def test_a_stage_of_small_layers_runs_without_the_mode_bitwise_as_unfused(
    fp64, monkeypatch
) -> None:
    entered = []
    original = FusedLinearMode.__enter__

    def counting(self: FusedLinearMode) -> FusedLinearMode:
        entered.append(1)
        return original(self)

    monkeypatch.setattr(FusedLinearMode, "__enter__", counting)
    x, y = torch.randn(12, 6), torch.randn(12, 5)
    reference = _model()
    nn.functional.mse_loss(reference(x), y).backward()
    grads = []
    for fuse in (True, False):
        model = _model()
        pipe = Pipeline(model, 4, balance=[2, 2], devices=["cpu", "cpu"], fuse_weight_grads=fuse)
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        grads.append(_grads(model))
    assert entered == []  # not even the per-operation interception
    for fused, unfused in zip(*grads, strict=True):
        assert torch.equal(fused, unfused)
    _assert_same(grads[0], _grads(reference))


def _dense(shape: tuple[int, ...]) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _sparse(shape: tuple[int, ...]) -> Tensor:
    return _dense(shape).relu().to_sparse()


@pytest.mark.parametrize("held", [None, "dense", "sparse"])
@pytest.mark.parametrize("new", ["dense", "sparse"])
def test_accumulate_is_accumulate_grads_rule(held: str | None, new: str) -> None:
    """``accumulate`` leaves ``.grad`` as autograd's AccumulateGrad does: value, layout and,
    where autograd adds in place, the same tensor."""
    torch.manual_seed(0)
    make = {"dense": _dense, "sparse": _sparse}
    start = None if held is None else make[held]((4, 3))
    g = make[new]((4, 3))
    ours, theirs = (nn.Parameter(torch.zeros(4, 3, dtype=torch.float64)) for _ in range(2))
    ours.grad = None if start is None else start.clone()
    theirs.grad = None if start is None else start.clone()
    before = ours.grad
    accumulate(ours, g.clone())
    torch.autograd.backward([theirs], [g.clone()])  # the leaf's AccumulateGrad adds ``g``
    assert ours.grad.layout == theirs.grad.layout
    assert torch.equal(ours.grad.to_dense(), theirs.grad.to_dense())
    if held == "dense":
        assert ours.grad is before  # in place, as autograd


def test_a_strided_1d_inputs_bias_gradient_keeps_a_negative_zero() -> None:
    # ATen runs matmul then add_: the output's gradient is the bias's, unsummed (-0.0 kept).
    torch.manual_seed(0)
    plain = nn.Linear(6, 5).double()
    fused = copy.deepcopy(plain)
    x = torch.randn(12, dtype=torch.float64)[::2]
    w = torch.full((5,), -0.0, dtype=torch.float64)
    (plain(x) * w).sum().backward()
    (_fused(fused)(x) * w).sum().backward()
    assert torch.equal(fused.bias.grad.signbit(), plain.bias.grad.signbit())
    assert plain.bias.grad.signbit().all()


class _Reused(nn.Module):
    """``a`` applied twice, and its weight also read by a matmul: reached three times."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(torch.tanh(self.a(x))) + x @ self.a.weight.t()


@pytest.mark.parametrize("checkpoint_mode", ["never", "always"])
def test_a_fused_weight_reached_several_times_sums_as_a_split_w_in_every_schedule(
    fp64, fuse_every_size, checkpoint_mode
) -> None:
    """A whole backward leaves such a weight's parts to autograd (summed, then one add), as a
    split W does: 1F1B, zb-v's whole pairs and zb-v all split give the same bits."""
    x, y = torch.randn(8, 3, 6), torch.randn(8, 3, 6)
    grads = []
    for schedule, devices, whole in (("1f1b", 4, True), ("zb-v", 2, True), ("zb-v", 2, False)):
        torch.manual_seed(0)
        model = nn.Sequential(_Reused(), nn.Linear(6, 6), _Reused(), nn.Linear(6, 6))
        pipe = Pipeline(
            model, 4, balance=[1, 1, 1, 1], devices=["cpu"] * devices, schedule=schedule,
            checkpoint=checkpoint_mode,
        )  # fmt: skip
        pipe.engine.runtime.passes.whole_backward = whole
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        grads.append([p.grad for p in model.parameters()])
    for a, b, c in zip(*grads, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
