"""A Sequential's layers profiled: the bytes each holds for its backward, against closed forms
and against what malloc holds after a real forward."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from pipesched.partition.profile import NodeCost, measure_sequential
from tests.malloc_peak import AVAILABLE, malloc_bytes

CPU = torch.device("cpu")


def test_a_relu_holds_its_output_and_the_next_linear_adds_nothing():
    """Linear saves its input (the ReLU's output before it), ReLU its output: one tensor of
    rows x width per pair, counted once, at the ReLU; the first Linear's input is the stage's."""
    rows, width = 32, 64
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())])
    costs = measure_sequential(model, torch.randn(rows, width), CPU, timing=False)
    assert [c.activation_bytes for c in costs] == [0, 4 * rows * width] * 3


def test_a_layer_whose_input_the_next_saves_holds_it():
    """Tanh saves its output, the next Linear its input: the same storage, held once. A
    Linear followed by a Linear: the second saves the first's output, counted at the first."""
    rows = 8
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    costs = measure_sequential(model, torch.randn(rows, 4), CPU, timing=False)
    assert [c.activation_bytes for c in costs] == [4 * rows * 16, 0, 4 * rows * 16, 0]


def _encoders(dropout: float) -> tuple[nn.Module, torch.Tensor, list[NodeCost]]:
    """3 x TransformerEncoderLayer(64), an input of 8 x 32 tokens, and their profile."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.TransformerEncoderLayer(64, 4, 256, dropout=dropout, batch_first=True)
            for _ in range(3)
        ]
    )
    x = torch.randn(8, 32, 64)
    return model, x, measure_sequential(model, x, CPU, timing=False)


@pytest.mark.skipif(not AVAILABLE, reason="needs glibc's mallinfo2")
def test_a_transformer_layer_holds_what_its_forward_keeps_alive():
    """The profile's bytes against malloc's: a forward's graph, its output freed."""
    model, x, costs = _encoders(dropout=0.1)
    profiled = sum(c.activation_bytes for c in costs)
    assert profiled > 8 * costs[0].output_bytes  # far more than the outputs alone
    gc.collect()
    before = malloc_bytes()
    y = model(x)
    y = y.sum()  # the output itself is not held for backward
    gc.collect()
    held = malloc_bytes() - before
    del y
    assert held == pytest.approx(profiled, rel=0.1)


def test_between_b_and_w_a_linear_chain_holds_each_linear_s_input_and_output_gradient():
    """W of each Linear needs its input (the ReLU's output before it, counted there) and
    its output's gradient, with its bias's part of it summed in B (counted at the Linear);
    the stage's input is the stage's."""
    rows, width = 32, 64
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())])
    costs = measure_sequential(model, torch.randn(rows, width), CPU, timing=False)
    one, bias = 4 * rows * width, 4 * width
    assert [c.split_bytes for c in costs] == [one + bias, one] * 2 + [one + bias, 0]


@pytest.mark.skipif(not AVAILABLE, reason="needs glibc's mallinfo2")
def test_between_b_and_w_a_transformer_layer_holds_what_its_store_keeps_alive():
    """The profile's bytes against malloc's after a real split B, W not yet run."""
    from pipesched.runtime.backward import backward_input
    from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore

    model, x, costs = _encoders(dropout=0.0)
    profiled = sum(c.split_bytes or 0 for c in costs)
    assert profiled > sum(c.activation_bytes for c in costs)  # more than after the forward
    store = WeightStore()
    seed = torch.ones(8, 32, 64)
    gc.collect()
    before = malloc_bytes()
    with DeferredWeightsMode(store):
        y = model(x)
    (gx,), w = backward_input([y], [seed], [x], store)
    del y
    gc.collect()
    held = malloc_bytes() - before
    w.run()
    assert gx is None
    assert held == pytest.approx(profiled, rel=0.1)


def test_layers_that_change_their_input_in_place_are_profiled():
    """ReLU(inplace=True) on a later layer's input (a leaf in the profile) refuses to run on
    it; the probe runs on a copy. All of ReLU, Dropout and the Linear before them share one
    storage in a real run, which the copies cannot see: an upper bound, never below."""
    rows = 4
    model = nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Dropout(0.5, inplace=True), nn.Linear(8, 8)
    )
    costs = measure_sequential(model, torch.randn(rows, 8), CPU, timing=False)
    one = 4 * rows * 8  # the shared storage, and the dropout's mask
    assert 2 * one <= sum(c.activation_bytes for c in costs) <= 3 * one
    assert all(c.split_bytes is not None for c in costs)
