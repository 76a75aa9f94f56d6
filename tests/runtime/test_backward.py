"""Split backward (B, then W later) against one full backward and against plain autograd."""

from __future__ import annotations

import copy
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from pipesched.errors import ConfigError, ScheduleError
from pipesched.runtime.backward import WeightGradients, backward_full, backward_input

DTYPE = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-12}

# Zero-bubble-like order of one stage: W of a micro-batch after other micro-batches' F and B.
ZB_ORDER = "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3"


# ---------------------------------------------------------------- stage modules


class Mlp(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 6))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return (super().forward(x),)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return (x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))),)


class Tied(nn.Module):
    """One Linear applied twice, with another layer between the uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return (self.a(torch.tanh(self.b(torch.tanh(self.a(x))))),)


class Embed(nn.Module):
    """A first stage: integer token ids in, so no input gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, tokens: Tensor) -> tuple[Tensor, ...]:
        return (torch.tanh(self.fc(self.emb(tokens))),)


class Unused(nn.Module):
    """``never`` is never used; ``sometimes`` only by micro-batches whose flag is set."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.sometimes = nn.Parameter(torch.randn(6))

    def forward(self, x: Tensor, use: bool) -> tuple[Tensor, ...]:
        h = self.used(x)
        return (h * self.sometimes if use else h,)


class Checkpointed(nn.Module):
    """An MLP with dropout under non-reentrant checkpointing; counts runs of the region."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else Mlp()
        self.drop = nn.Dropout(0.25)
        self.runs = 0

    def region(self, x: Tensor) -> Tensor:
        self.runs += 1
        return self.drop(self.inner(x)[0])

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        out = checkpoint(self.region, x, use_reentrant=False)
        assert isinstance(out, Tensor)
        return (out,)


class MultiOutput(nn.Module):
    """Outputs: computed, the input passed through, parameters only, and a bool mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        y = self.fc(x)
        return (y, x, self.scale * 2.0, y > 0)


class Last(nn.Module):
    """A last stage: the output is a scalar loss, the target an input without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: Tensor, target: Tensor) -> tuple[Tensor, ...]:
        return ((self.fc(x) - target).pow(2).sum(),)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[Any, ...]]
    """The forward's inputs for micro-batch i (before floats are made leaves that require grad)."""
    is_last: bool = False


def _floats(i: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(i), dtype=DTYPE)


CASES = [
    Case("mlp", Mlp, lambda i: (_floats(i, 4, 6),)),
    Case("residual", Residual, lambda i: (_floats(i, 2, 3, 6),)),
    Case("tied", Tied, lambda i: (_floats(i, 4, 6),)),
    Case(
        "embedding",
        Embed,
        lambda i: (torch.randint(10, (4, 5), generator=torch.Generator().manual_seed(i)),),
    ),
    Case("unused", Unused, lambda i: (_floats(i, 4, 6), i % 2 == 1)),
    Case("checkpointed", Checkpointed, lambda i: (_floats(i, 4, 6),)),
    Case("checkpointed-tied", lambda: Checkpointed(Tied()), lambda i: (_floats(i, 4, 6),)),
    Case("multi-output", MultiOutput, lambda i: (_floats(i, 4, 6),)),
    Case("last", Last, lambda i: (_floats(i, 4, 6), _floats(100 + i, 4, 3)), is_last=True),
]
CASE = {case.name: case for case in CASES}


# ---------------------------------------------------------------- running a stage


def _leaves(inputs: Sequence[Any]) -> list[Any]:
    return [
        x.detach().requires_grad_() if isinstance(x, Tensor) and x.is_floating_point() else x
        for x in inputs
    ]


def _forward(module: nn.Module, i: int, inputs: Sequence[Any]) -> tuple[Tensor, ...]:
    torch.manual_seed(1000 + i)  # the same dropout mask in every run of micro-batch i
    outputs = module(*inputs)
    assert isinstance(outputs, tuple)
    return outputs


def _grad_outputs(case: Case, i: int, outputs: Sequence[Tensor]) -> list[Tensor | None] | None:
    if case.is_last:
        return None
    return [
        _floats(10 * i + k, *out.shape) if out.requires_grad else None
        for k, out in enumerate(outputs)
    ]


def _build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.build().to(DTYPE)


def run_full(
    case: Case, module: nn.Module, num_microbatches: int
) -> list[tuple[Tensor | None, ...]]:
    grads = []
    for i in range(num_microbatches):
        inputs = _leaves(case.inputs(i))
        outputs = _forward(module, i, inputs)
        grads.append(backward_full(outputs, _grad_outputs(case, i, outputs), inputs))
    return grads


def run_split(
    case: Case, module: nn.Module, order: Sequence[str]
) -> list[tuple[Tensor | None, ...]]:
    """Runs actions like ``"F0"``, ``"B0"``, ``"W0"`` in ``order`` on one stage."""
    forwarded: dict[int, tuple[list[Any], tuple[Tensor, ...]]] = {}
    pending: dict[int, WeightGradients] = {}
    grads: dict[int, tuple[Tensor | None, ...]] = {}
    for action in order:
        kind, i = action[0], int(action[1:])
        if kind == "F":
            inputs = _leaves(case.inputs(i))
            forwarded[i] = (inputs, _forward(module, i, inputs))
        elif kind == "B":
            inputs, outputs = forwarded.pop(i)
            torch.manual_seed(2000 + i)  # recomputation must not depend on the ambient RNG
            grads[i], pending[i] = backward_input(outputs, _grad_outputs(case, i, outputs), inputs)
        else:
            torch.manual_seed(3000 + i)
            pending.pop(i).run()
    assert not forwarded
    assert not pending
    return [grads[i] for i in sorted(grads)]


def run_plain(
    case: Case, module: nn.Module, num_microbatches: int
) -> list[tuple[Tensor | None, ...]]:
    """One ``loss.backward()`` through the unsplit module over all micro-batches."""
    all_inputs, total = [], torch.zeros((), dtype=DTYPE)
    for i in range(num_microbatches):
        inputs = _leaves(case.inputs(i))
        outputs = _forward(module, i, inputs)
        grad_outputs = _grad_outputs(case, i, outputs)
        if grad_outputs is None:
            total = total + outputs[0]
        else:
            for out, g in zip(outputs, grad_outputs, strict=True):
                if g is not None:
                    total = total + (out * g).sum()
        all_inputs.append(inputs)
    total.backward()
    return [
        tuple(x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs)
        for inputs in all_inputs
    ]


def assert_grads(
    expected: Sequence[Tensor | None], actual: Sequence[Tensor | None], *, exact: bool
) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert (e is None) == (a is None)
        if e is not None and a is not None:
            if exact:
                assert torch.equal(e, a)
            else:
                torch.testing.assert_close(a, e, **EXACT)


def param_grads(module: nn.Module) -> list[Tensor | None]:
    return [p.grad for p in module.parameters()]


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_split_equals_full_and_plain(case: Case) -> None:
    order = ZB_ORDER.split()
    full, split, plain = _build(case), _build(case), _build(case)
    full_grads = run_full(case, full, 4)
    split_grads = run_split(case, split, order)
    plain_grads = run_plain(case, plain, 4)
    # The same operations in the same order as backward_full: bit-for-bit equal.
    assert_grads(param_grads(full), param_grads(split), exact=True)
    for f, s in zip(full_grads, split_grads, strict=True):
        assert_grads(f, s, exact=True)
    # One backward through everything: equal up to the order of summation.
    assert_grads(param_grads(plain), param_grads(split), exact=False)
    for p, s in zip(plain_grads, split_grads, strict=True):
        assert_grads(p, s, exact=False)


def test_the_cases_exercise_what_they_are_named_after() -> None:
    unused = _build(CASE["unused"])
    run_split(CASE["unused"], unused, ZB_ORDER.split())
    assert isinstance(unused, Unused)
    assert unused.never.weight.grad is None
    assert unused.sometimes.grad is not None
    grads = run_split(CASE["embedding"], _build(CASE["embedding"]), ZB_ORDER.split())
    assert all(g == (None,) for g in grads)
    grads = run_split(CASE["multi-output"], _build(CASE["multi-output"]), ZB_ORDER.split())
    assert all(g[0] is not None for g in grads)


def test_weight_unused_by_the_microbatch_keeps_grad_none() -> None:
    module = Unused().to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
    (dx, _), w = backward_input(module(x, False), [torch.ones(4, 6, dtype=DTYPE)], [x, False])
    assert dx is not None
    w.run()
    assert module.used.weight.grad is not None
    assert module.sometimes.grad is None
    assert module.never.weight.grad is None


@settings(max_examples=15, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("name", ["mlp", "tied", "checkpointed", "multi-output"])
def test_any_order_of_f_b_w_gives_the_same_gradients(name: str, data: st.DataObject) -> None:
    case = CASE[name]
    # Each micro-batch's k-th action is F, B, W in turn; micro-batches interleave freely.
    slots = data.draw(st.permutations([i for i in range(3) for _ in range(3)]))
    seen: Counter[int] = Counter()
    order = []
    for i in slots:
        order.append("FBW"[seen[i]] + str(i))
        seen[i] += 1
    full, split = _build(case), _build(case)
    full_grads = run_full(case, full, 3)
    split_grads = run_split(case, split, order)
    assert_grads(param_grads(full), param_grads(split), exact=False)
    for f, s in zip(full_grads, split_grads, strict=True):
        assert_grads(f, s, exact=False)


# ---------------------------------------------------------------- a whole pipeline

# ZB-H1 for 3 stages and 4 micro-batches, one worker per stage (stage s delays its Ws by s).
ZB_H1 = """
    0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
    1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3
    2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3
"""


class Chain(nn.Module):
    """Stage modules one after the other, each taking the previous one's outputs."""

    def __init__(self, *stages: nn.Module) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *inputs: Any) -> tuple[Tensor, ...]:
        for stage in self.stages:
            inputs = stage(*inputs)
        return inputs


def test_pipeline_of_stages_equals_plain_backward_of_the_whole_model() -> None:
    torch.manual_seed(0)
    stages = [Embed().to(DTYPE), Chain(Residual(), Tied()).to(DTYPE), Last().to(DTYPE)]
    plain = copy.deepcopy(stages)
    last = len(stages) - 1
    tokens = [
        torch.randint(10, (4, 5), generator=torch.Generator().manual_seed(i)) for i in range(4)
    ]
    targets = [_floats(50 + i, 4, 5, 3) for i in range(4)]

    queues = [line.split() for line in ZB_H1.strip().splitlines()]
    saved: dict[tuple[int, int], tuple[list[Any], tuple[Tensor, ...]]] = {}
    sent: dict[tuple[int, int], Tensor] = {}  # activations, forward
    returned: dict[tuple[int, int], Tensor | None] = {}  # input gradients, backward
    pending: dict[tuple[int, int], WeightGradients] = {}

    def ready(s: int, kind: str, i: int) -> bool:
        if kind == "F":
            return s == 0 or (s - 1, i) in sent
        if kind == "B":
            return s == last or (s + 1, i) in returned
        return (s, i) in pending

    while any(queues):
        runnable = [q for q in queues if q and ready(int(q[0][0]), q[0][1], int(q[0][2:]))]
        assert runnable, "the order deadlocks"
        for queue in runnable:
            action = queue.pop(0)
            s, kind, i = int(action[0]), action[1], int(action[2:])
            if kind == "F":
                inputs: list[Any] = [tokens[i] if s == 0 else _leaves([sent[(s - 1, i)]])[0]]
                inputs += [targets[i]] if s == last else []
                outputs = stages[s](*inputs)
                saved[(s, i)] = (inputs, outputs)
                sent[(s, i)] = outputs[0]
            elif kind == "B":
                inputs, outputs = saved.pop((s, i))
                grad_outputs = None if s == last else [returned[(s + 1, i)]]
                grads, pending[(s, i)] = backward_input(outputs, grad_outputs, inputs)
                returned[(s, i)] = grads[0]
            else:
                pending.pop((s, i)).run()

    total = sum(plain[2](*plain[1](*plain[0](tokens[i])), targets[i])[0] for i in range(4))
    assert isinstance(total, Tensor)
    total.backward()
    for piped, unpiped in zip(stages, plain, strict=True):
        assert_grads(param_grads(unpiped), param_grads(piped), exact=False)
    assert all(returned[(0, i)] is None for i in range(4))  # token ids: nothing to send back


# ---------------------------------------------------------------- W's contract


def _mlp_microbatch() -> tuple[nn.Module, Tensor, tuple[Tensor, ...], Tensor]:
    torch.manual_seed(0)
    module = Mlp().to(DTYPE)
    x = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)
    return module, x, module(x), torch.randn(4, 6, dtype=DTYPE)


def test_b_leaves_weights_alone_and_w_accumulates() -> None:
    module, x, outputs, g = _mlp_microbatch()
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    _, w = backward_input(outputs, [g], [x])
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in module.parameters())
    assert x.grad is None
    assert not w.done
    w.run()
    assert w.done
    reference = copy.deepcopy(module)
    reference.zero_grad(set_to_none=True)
    xr = x.detach().requires_grad_()
    backward_full(reference(xr), [g], [xr])
    for p, r in zip(module.parameters(), reference.parameters(), strict=True):
        assert r.grad is not None
        assert torch.equal(p.grad, r.grad + 1)


def test_running_w_twice_is_an_error() -> None:
    module, x, outputs, g = _mlp_microbatch()
    _, w = backward_input(outputs, [g], [x])
    w.run()
    grads = [p.grad.clone() for p in module.parameters()]
    with pytest.raises(ScheduleError, match="already"):
        w.run()
    assert all(torch.equal(p.grad, q) for p, q in zip(module.parameters(), grads, strict=True))


def test_w_frees_every_saved_tensor() -> None:
    boxes: list[weakref.ref[Any]] = []

    class Box:
        def __init__(self, tensor: Tensor) -> None:
            self.tensor = tensor

    def pack(tensor: Tensor) -> Box:
        box = Box(tensor.detach())  # a saved output would otherwise keep its own node alive
        boxes.append(weakref.ref(box))
        return box

    module, x, _, g = _mlp_microbatch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        outputs = module(x)
    assert boxes
    _, w = backward_input(outputs, [g], [x])
    del outputs  # the caller drops its outputs after B, as after any backward
    assert any(box() is not None for box in boxes)  # kept for W
    w.run()
    assert all(box() is None for box in boxes)


def test_graph_cannot_be_reused_after_w() -> None:
    _, x, outputs, g = _mlp_microbatch()
    _, w = backward_input(outputs, [g], [x])
    w.run()
    with pytest.raises(RuntimeError, match="second time"):
        outputs[0].backward(g)


class _CountOps(TorchDispatchMode):
    METADATA = frozenset({"detach", "t", "view", "_unsafe_view", "expand", "alias", "transpose"})

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.METADATA:
            mask = args[-1] if args and isinstance(args[-1], list) else None
            if mask and all(isinstance(m, bool) for m in mask):
                # A fused backward (layer norm) asked for some of its gradients: count those.
                self.counts[str(func)] += sum(mask)
            else:
                self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("build", [Mlp, Residual], ids=["mlp", "residual"])
def test_b_and_w_together_run_the_ops_of_one_full_backward(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    module = build().to(DTYPE)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    x, g = torch.randn(4, 6, dtype=DTYPE), torch.randn(4, 6, dtype=DTYPE)

    xf = x.clone().requires_grad_()
    outputs = module(xf)
    with _CountOps() as full:
        backward_full(outputs, [g], [xf])

    xs = x.clone().requires_grad_()
    outputs = module(xs)
    with _CountOps() as b:
        _, w = backward_input(outputs, [g], [xs])
    with _CountOps() as w_ops:
        w.run()
    assert b.counts + w_ops.counts == full.counts
    assert b.counts["aten.mm.default"] > 0
    assert w_ops.counts["aten.mm.default"] > 0


def test_first_stage_b_computes_nothing_and_w_everything() -> None:
    module = _build(CASE["embedding"])
    tokens = CASE["embedding"].inputs(0)
    g = _floats(0, 4, 5, 6)
    outputs = module(*tokens)
    with _CountOps() as full:
        backward_full(outputs, [g], tokens)
    module.zero_grad(set_to_none=True)
    outputs = module(*tokens)
    with _CountOps() as b:
        grads, w = backward_input(outputs, [g], tokens)
    with _CountOps() as w_ops:
        w.run()
    assert grads == (None,)
    assert not b.counts
    assert w_ops.counts == full.counts


def test_checkpointed_region_is_recomputed_once_by_b_and_once_by_w() -> None:
    case = CASE["checkpointed"]
    full, split = _build(case), _build(case)
    assert isinstance(full, Checkpointed)
    assert isinstance(split, Checkpointed)
    run_full(case, full, 4)
    run_split(case, split, ZB_ORDER.split())
    assert full.runs == 4 + 4  # forward, recomputation
    assert split.runs == 4 + 4 + 4  # forward, recomputation in B, recomputation in W


# ---------------------------------------------------------------- edges and errors


def test_outputs_without_grad_leave_nothing_to_do() -> None:
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    mask = x.detach() > 0
    assert backward_full([mask], [None], [x]) == (None,)
    grads, w = backward_input([mask], [None], [x, 7])
    assert grads == (None, None)
    w.run()
    assert w.done


def test_input_not_reaching_outputs_gets_none() -> None:
    layer = nn.Linear(3, 3).to(DTYPE)
    x = torch.randn(2, 3, dtype=DTYPE, requires_grad=True)
    unused = torch.randn(2, 3, dtype=DTYPE, requires_grad=True)
    g = torch.ones(2, 3, dtype=DTYPE)
    (dx, dunused), w = backward_input([layer(x)], [g], [x, unused])
    assert dx is not None
    assert dunused is None
    w.run()
    assert backward_full([layer(x)], [g], [x, unused])[1] is None


def test_grad_outputs_must_match_outputs() -> None:
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    with pytest.raises(ConfigError, match="2 gradients for 1 outputs"):
        backward_input([x * 2], [None, None], [x])
    with pytest.raises(ConfigError, match="only a scalar loss"):
        backward_full([x * 2], None, [x])


def test_inputs_must_be_leaves() -> None:
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    h = x * 2
    with pytest.raises(ConfigError, match=r"input 0 is not a leaf.*detach"):
        backward_input([h * 3], [torch.ones(3, dtype=DTYPE)], [h])


def test_b_frees_the_graph_when_there_is_no_weight() -> None:
    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    y = torch.tanh(x)
    g = torch.ones(3, dtype=DTYPE)
    (dx,), w = backward_input([y], [g], [x])
    torch.testing.assert_close(dx, 1 - torch.tanh(x.detach()) ** 2, **EXACT)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(g)
    w.run()
