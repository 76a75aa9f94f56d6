"""The tripwire sees every move of a watched generator, and excuses only the step seed's draw."""

from __future__ import annotations

import pytest
import torch

from pipesched.runtime.compat.random_routing import native_module
from pipesched.runtime.stage import tripwire
from pipesched.runtime.stage.draw_keys import StepSeed
from pipesched.runtime.stage.rng import prepare
from pipesched.runtime.stage.tripwire import Tripwire


@pytest.fixture(params=["C++", "Python"])
def kind(request, monkeypatch):
    """The tripwire with the C++ kernel's snapshot, and with the Python one it falls back to."""
    prepare()
    if request.param == "C++":
        if native_module() is None:
            pytest.skip("the C++ kernel is not built here (no compiler)")
    else:
        monkeypatch.setattr(tripwire, "native_module", lambda: None)
    return request.param


def _generators():
    device = torch.Generator().manual_seed(1)  # stands for a stage's device's generator
    user = torch.Generator().manual_seed(2)
    return [torch.default_generator, device, user]


def test_a_pass_that_draws_nothing_is_explained(kind):
    generators = _generators()
    wire = Tripwire(generators, devices=2)
    torch.ones(3).add_(1)
    assert wire.moved() == [] and wire.explained(StepSeed())


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_unseeded_draw_trips_it_and_names_the_generator(kind, which):
    generators = _generators()
    state = generators[which].get_state()
    wire = Tripwire(generators, devices=2)
    torch.rand(4, generator=generators[which])
    moved = wire.moved()
    assert [i for i, _, _ in moved] == [which]
    _, then, now = moved[0]
    assert torch.equal(then, state) and torch.equal(now, generators[which].get_state())
    assert not wire.explained(StepSeed())


def test_the_step_seeds_own_draws_are_explained_and_nothing_more(kind):
    generators = _generators()
    seed = StepSeed()
    wire = Tripwire(generators, devices=2)
    seed.get()  # drawn from the default generator
    seed.of(generators[2]).get()  # the user's generator's seed, drawn from it
    assert [i for i, _, _ in wire.moved()] == [0, 2]
    assert wire.explained(seed)
    torch.rand(1)  # one draw more: no longer the seed's draw alone
    assert not wire.explained(seed)
    other = StepSeed()  # a seed that was not drawn explains nothing
    wire = Tripwire(generators, devices=2)
    torch.rand(1)
    assert not wire.explained(other)


def test_both_kinds_see_the_same_moves(monkeypatch):
    prepare()
    if native_module() is None:
        pytest.skip("the C++ kernel is not built here (no compiler)")
    # The C++ kernel copies a CPU generator's engine and cached normal samples, and makes
    # the states' tensors only for one that moved: they must be get_state's, byte for byte.
    generators = _generators()
    torch.randn(1, dtype=torch.float64)  # a cached normal sample in the state "then"
    torch.randn(1, generator=generators[2])
    native = Tripwire(generators, devices=2)
    monkeypatch.setattr(tripwire, "native_module", lambda: None)
    python = Tripwire(generators, devices=2)
    torch.rand(2)
    torch.randn(3)  # and in the state "now"
    torch.rand(700, generator=generators[2])  # past one 624-word regeneration
    moves = list(zip(native.moved(), python.moved(), strict=True))
    assert [i for (i, _, _), _ in moves] == [0, 2]
    for (i, a, b), (j, c, d) in moves:
        assert i == j and torch.equal(a, c) and torch.equal(b, d)
