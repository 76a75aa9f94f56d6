"""Random operations routed to Python through their own dispatch key: only they, seeded alike.

The routed path (pipesched.runtime.compat.internals.route_random_ops) must draw exactly
what the TorchDispatchMode it replaced draws, see every random operation once (none
inside another: native_dropout's bernoulli_), no other operation, and nothing in a
thread that does not seed.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.compat import random_routing
from pipesched.runtime.stage import rng
from pipesched.runtime.stage.draw_keys import StepSeed, module_names
from pipesched.runtime.stage.seeding import StageSeeding
from tests.runtime.stage.random_kinds import KINDS, model_of

pytestmark = pytest.mark.usefixtures("fp64")

ROWS = 10


class Mixed(nn.Module):
    """Every way a user's forward draws: functional dropout, SDPA's dropout_p, noise, a
    generator of its own, and native_dropout as a traced graph calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.g = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.norm(self.linear(x)), 0.3, self.training)
        t = h.reshape(-1, 2, 2, 2)
        h = F.scaled_dot_product_attention(t, t, t, dropout_p=0.4).reshape(-1, 8)
        h = h + 0.1 * torch.randn_like(h) + torch.rand(h.shape, generator=self.g)
        return torch.ops.aten.native_dropout.default(h, 0.2, True)[0]


RANDOM_OPS_IN_MIXED = 5  # bernoulli_, bernoulli_ (SDPA), normal_, uniform_, native_dropout


@pytest.fixture
def unrouted(monkeypatch):
    """Seeding as where torch lacks the dispatch key: the dispatch mode, and module hooks."""
    monkeypatch.setattr(rng, "route_random_ops", lambda *args, **kwargs: False)
    monkeypatch.setitem(rng._routing, "on", False)


def _seeding(model: nn.Module) -> StageSeeding:
    names = module_names(model)
    return StageSeeding(names, model, torch.device("cpu"), adaptive=False)


def _drawn(model: nn.Module, x: torch.Tensor, seeding: StageSeeding, seed: int = 3):
    """The pass's output and the random operations that were seeded: in Python (by name) or
    by the C++ kernel ("seeded in C++")."""
    ops: list[str] = []
    draw = rng.SeededRandomness.draw

    def counted(self, func, args, kwargs, run):
        ops.append(str(func))
        return draw(self, func, args, kwargs, run)

    rng.SeededRandomness.draw = counted  # type: ignore[method-assign]
    for m in model.modules():  # a generator of the model's own: each pass from its seed
        if isinstance(getattr(m, "g", None), torch.Generator):
            m.g.manual_seed(7)
    before = random_routing.native_draws()
    try:
        with seeding.forward(StepSeed(seed), 0):
            out = model(x)
    finally:
        rng.SeededRandomness.draw = draw  # type: ignore[method-assign]
    if before is not None:  # draws the C++ kernel keyed itself, without Python
        ops += ["seeded in C++"] * (random_routing.native_draws()[0] - before[0])
    return out, ops


def test_only_random_operations_reach_python_each_once():
    assert rng.prepare(), "routing is off in this torch"
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(ROWS, 8)
    seeding = _seeding(model)
    out, ops = _drawn(model, x, seeding)
    assert len(ops) == RANDOM_OPS_IN_MIXED, ops
    again, _ = _drawn(model, x, seeding)
    assert torch.equal(out, again)  # a second pass with the step's seeds draws the same
    plain = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    out, ops = _drawn(plain, x, _seeding(plain))
    assert ops == [] and torch.equal(out, plain(x))


def test_routed_draws_equal_the_dispatch_modes(request):
    # The fallback (a TorchDispatchMode on every operation) and routing key alike.
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(ROWS, 8)
    seeding = _seeding(model)
    routed, _ = _drawn(model, x, seeding)
    request.getfixturevalue("unrouted")
    by_mode, ops = _drawn(model, x, seeding)
    assert len(ops) >= RANDOM_OPS_IN_MIXED  # the mode sees rand's own op, not uniform_
    assert torch.equal(routed, by_mode)


class Noisy(nn.Module):
    def noise(self, x: torch.Tensor) -> torch.Tensor:  # called by its parent, not __call__
        return torch.rand_like(x)


class NoisyParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Noisy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.child.noise(x) + 2 * torch.rand_like(x)


def test_a_draw_is_keyed_by_the_method_that_makes_it_routed_or_not(request):
    # Routed, the walk up the stack skips pipesched's own frames, never the operation's
    # caller: a method of the child called directly keys the child's draw.
    model, x = NoisyParent(), torch.zeros(ROWS, 8)
    seeding = _seeding(model)
    with seeding.forward(StepSeed(3), 0):  # (not _drawn: its wrapper is a frame more)
        routed = model(x)
    request.getfixturevalue("unrouted")
    with seeding.forward(StepSeed(3), 0):
        by_mode = model(x)
    assert torch.equal(routed, by_mode)


@pytest.mark.parametrize("kind", ["F.dropout", "SDPA dropout", "TransformerEncoderLayer"])
def test_steps_draw_alike_routed_or_not(kind, request):
    # Three steps: the first seeds throughout and learns, the next seed only the modules
    # seen drawing (found on the call stack when routed, by module hooks when not).
    def steps():
        pipe = Pipeline(model_of(kind), 4, balance=[2, 3], devices=["cpu"] * 2, checkpoint="always")
        torch.manual_seed(1)
        losses = [
            pipe.step(torch.randn(ROWS, 8), torch.randn(ROWS, 8), loss_fn=F.mse_loss)
            for _ in range(3)
        ]
        return [*losses, *(p.grad for p in pipe.parameters())], pipe.engine.seedings

    routed, seedings = steps()
    assert all(s.routed for s in seedings) and any(s.hooked for s in seedings)
    assert not any(any(s.hooked.values()) for s in seedings)  # no module hooks
    request.getfixturevalue("unrouted")
    by_mode, seedings = steps()
    assert not any(s.routed for s in seedings)
    assert any(any(s.hooked.values()) for s in seedings)  # module hooks, as before routing
    for a, b in zip(routed, by_mode, strict=True):
        assert torch.equal(a, b)


class OwnGenerator(nn.Module):
    """A mask from a generator the module holds."""

    def __init__(self) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=self.g) > 0.5)


@pytest.mark.parametrize("kind", ["F.dropout", "SDPA dropout", "own generator"])
def test_one_thread_and_two_stage_threads_draw_alike(kind):
    # One stage (one thread, the whole model) against two stage threads drawing at once.
    def model():
        if kind != "own generator":
            return model_of(kind)
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), OwnGenerator(), nn.Linear(8, 8), OwnGenerator())

    def step(balance):
        net = model()
        pipe = Pipeline(net, 4, balance=balance, devices=["cpu"] * len(balance))
        torch.manual_seed(1)
        loss = pipe.step(torch.randn(ROWS, 8), torch.randn(ROWS, 8), loss_fn=F.mse_loss)
        return [loss, *(p.grad for p in pipe.parameters())]

    n = len(model())
    for a, b in zip(step([n]), step([n // 2, n - n // 2]), strict=True):
        assert torch.equal(a, b)


class Traced(nn.Module):
    """Not a Sequential: the pipeline traces it, functional dropout and SDPA's become ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), 0.5, self.training)
        t = self.b(h).reshape(-1, 2, 2, 2)
        h = F.scaled_dot_product_attention(t, t, t, dropout_p=0.5 if self.training else 0.0)
        return self.c(h.reshape(-1, 8))


def test_a_traced_stage_recomputes_its_masks_and_repeats():
    def step(mode):
        torch.manual_seed(0)
        pipe = Pipeline(Traced(), 2, devices=["cpu"] * 2, checkpoint=mode)
        torch.manual_seed(1)
        loss = pipe.step(torch.randn(ROWS, 8), torch.randn(ROWS, 8), loss_fn=F.mse_loss)
        return [loss, *(p.grad for p in pipe.parameters())]

    never = step("never")
    for got in (step("always"), step("never")):
        for a, b in zip(never, got, strict=True):
            assert torch.equal(a, b)


def test_a_thread_that_does_not_seed_draws_as_torch_does():
    # Routing is per thread: another thread's draws meanwhile run unrouted, unseeded.
    seeding = _seeding(Mixed())
    seen: list[torch.Tensor] = []
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait()
        torch.manual_seed(11)
        seen.append(torch.rand(4))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with seeding.forward(StepSeed(3), 0):
        inside.set()
        done.wait()
    thread.join()
    torch.manual_seed(11)
    assert torch.equal(seen[0], torch.rand(4))


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("F.dropout", "SDPA dropout")])
def test_every_kind_draws_alike_routed_or_not(kind, request):
    torch.manual_seed(0)
    model, x = model_of(kind), torch.randn(ROWS, 8)
    seeding = _seeding(model)
    routed, _ = _drawn(model, x, seeding)
    request.getfixturevalue("unrouted")
    by_mode, _ = _drawn(model, x, seeding)
    assert torch.equal(routed, by_mode)
