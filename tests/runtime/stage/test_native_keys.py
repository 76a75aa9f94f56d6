"""The C++ kernel's keys draw what the Python keys draw, and their probe catches a difference."""

from __future__ import annotations

import pytest
import torch

from pipesched.runtime.compat import random_routing
from pipesched.runtime.stage import draw_keys, native_keys, rng
from pipesched.runtime.stage.draw_keys import StepSeed, module_names
from pipesched.runtime.stage.seeding import StageSeeding
from tests.runtime.stage.random_kinds import KINDS, model_of


@pytest.fixture
def native():
    if not rng.prepare() or random_routing.native_module() is None:
        pytest.skip("the C++ kernel does not route here (no compiler, or PIPESCHED_NATIVE_RNG=0)")
    return random_routing.native_module()


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_draws_alike_keyed_in_cpp_or_in_python(kind, native):
    model, x = model_of(kind), torch.randn(16, 8)
    outs = {}
    for keyed in ("cpp", "python"):
        seeding = StageSeeding(module_names(model), model, torch.device("cpu"), adaptive=False)
        assert seeding.table is not None
        if keyed == "python":
            seeding.table = None
        before = random_routing.native_draws()
        with seeding.forward(StepSeed(3), 0):
            first = model(x)
        with seeding.forward(StepSeed(3), 1):
            second = model(x)
        outs[keyed] = (first, second, random_routing.native_draws()[0] - before[0])
    cpp, python = outs["cpp"], outs["python"]
    assert torch.equal(cpp[0], python[0]) and torch.equal(cpp[1], python[1])
    assert python[2] == 0  # (no keys: the C++ kernel seeded nothing)


def test_the_cpp_keys_seed_the_cpu_draws_of_a_dropout_themselves(native):
    model, x = model_of("Dropout"), torch.randn(16, 8)
    seeding = StageSeeding(module_names(model), model, torch.device("cpu"), adaptive=False)
    before = random_routing.native_draws()
    with seeding.forward(StepSeed(3), 0):
        model(x)
    seeded_in_cpp, via_python = (
        a - b for a, b in zip(random_routing.native_draws(), before, strict=True)
    )
    assert (seeded_in_cpp, via_python) == (2, 0)  # both of the model's dropouts


def test_the_walks_probe_fails_where_the_cpp_keys_differ(native, monkeypatch):
    assert native_keys._walks_agree(native)
    monkeypatch.setattr(draw_keys, "_mix", lambda z: z)  # the Python keys only
    assert not native_keys._walks_agree(native)
