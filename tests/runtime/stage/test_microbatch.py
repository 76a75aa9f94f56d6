"""Scatter and gather of micro-batches: sizes, round trips, views, autograd, errors."""

from __future__ import annotations

import math
import types
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.errors import ConfigError
from pipesched.runtime.stage.microbatch import batch_size, gather, microbatch_sizes, scatter

BATCHES = [1, 3, 9, 10, 16]
CHUNKS = [1, 2, 4]


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


def _equal(a: Any, b: Any) -> bool:
    """Exact structural equality: same container types, torch.equal on tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("n", BATCHES)
def test_sizes_follow_tensor_split_and_are_never_zero(n, chunks):
    x = torch.arange(n)
    expected = [len(p) for p in torch.tensor_split(x, chunks) if len(p)]
    assert microbatch_sizes(n, chunks) == expected
    assert min(expected) >= 1
    assert len(expected) == min(n, chunks)
    parts = scatter(x, chunks)
    assert [len(p) for p in parts] == expected
    assert all(p.float().mean().isfinite() for p in parts)
    for part, piece in zip(parts, torch.tensor_split(x, chunks), strict=False):
        assert torch.equal(part, piece)


def test_uneven_sizes_are_larger_first_not_torch_chunk():
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert [len(c) for c in torch.arange(10).chunk(4)] == [3, 3, 3, 1]


X = torch.arange(40.0).reshape(10, 4)
Y = torch.arange(10)
ROUND_TRIPS = {
    "tensor": X,
    "tuple": (X, Y, "tag", None),
    "list": [X, 3, Y],
    "dict": {"x": X, "mask": Y > 4, "name": "batch", "scale": 0.5},
    "nested": (X, [{"a": Y, "b": (X, "leaf")}, []], {"deep": {"deeper": [Y]}}, ()),
    "namedtuple": Pair(X, "label"),
    "namedtuple nested": {"pairs": [Pair(X, "a"), Pair(X * 2, "b")]},
}


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("inputs", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_scatter_then_gather_round_trips(inputs, chunks):
    parts = scatter(inputs, chunks)
    assert len(parts) == chunks
    assert all(type(p) is type(inputs) for p in parts)
    assert _equal(gather(parts), inputs)


def test_structure_types_and_shared_leaves():
    tag = object()
    scale = torch.tensor(2.0)
    inputs = (Pair(X, "l"), [Y], types.MappingProxyType({"x": X, "tag": tag, "s": scale}))
    for part in scatter(inputs, 3):
        assert type(part) is tuple
        assert type(part[0]) is Pair
        assert type(part[1]) is list
        assert type(part[2]) is dict
        assert part[2]["tag"] is tag
        assert part[2]["s"] is scale
        assert part[0].label == "l"
    parts = scatter(OrderedDict(x=X), 2)  # a Mapping built from keywords keeps its type
    assert all(type(p) is OrderedDict for p in parts)


def test_pieces_are_views_sharing_storage():
    x = torch.zeros(10, 3)
    parts = scatter({"x": x}, 4)
    storage = x.untyped_storage().data_ptr()
    for part in parts:
        assert part["x"].untyped_storage().data_ptr() == storage
    parts[2]["x"].fill_(7.0)
    assert torch.equal(x[6:8], torch.full((2, 3), 7.0))
    assert x[:6].eq(0).all() and x[8:].eq(0).all()


def test_autograd_flows_back_through_scatter_and_gather():
    x = torch.randn(10, 3, requires_grad=True)
    w = torch.randn(10, requires_grad=True)
    parts = scatter((x, {"w": w, "ids": torch.arange(10)}), 4)
    outputs = [(p[0] * 1.0, {"w": p[1]["w"] + 0.0}) for p in parts]
    y = gather(outputs)
    (y[0].sum() + y[1]["w"].sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert torch.equal(w.grad, torch.ones_like(w))


def test_zero_dim_outputs_are_stacked_and_zero_dim_inputs_shared():
    parts = scatter((X, torch.tensor(3.0)), 4)
    assert all(p[1] is parts[0][1] for p in parts)
    losses = [p[0].sum() for p in parts]
    stacked = gather(losses)
    assert stacked.shape == (4,)
    assert torch.equal(stacked, torch.stack(losses))


def test_gather_non_tensor_leaves():
    assert gather([(Y, "same"), (Y, "same")])[1] == "same"
    assert gather([(Y, 1), (Y, 2), (Y, 1)])[1] == [1, 2, 1]


def test_batch_size():
    assert batch_size({"a": [X, 3], "b": torch.tensor(1.0)}) == 10


def test_batch_size_mismatch_names_both_paths():
    inputs = (torch.zeros(10, 2), {"mask": torch.zeros(9), "s": torch.tensor(1)})
    with pytest.raises(ConfigError) as info:
        scatter(inputs, 2)
    message = str(info.value)
    assert "inputs[1]['mask'] has batch size 9 but inputs[0] has 10" in message
    with pytest.raises(ConfigError, match=r"inputs\[1\]\.label has batch size 3 but inputs\[0\]"):
        batch_size((X, Pair(X, Y[:3])))


@pytest.mark.parametrize("chunks", [0, -1, 2.5, True, "2", None])
def test_bad_chunks_rejected(chunks):
    with pytest.raises(ConfigError, match=r"chunks must be an int >= 1, got") as info:
        scatter(X, chunks)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match="chunks"):
        microbatch_sizes(10, chunks)


@pytest.mark.parametrize(
    "inputs", [torch.tensor(1.0), ("a", 3, None), {"s": torch.tensor(2)}, [], {}]
)
def test_no_batched_leaf_rejected(inputs):
    with pytest.raises(ConfigError, match="no tensor with a batch dimension was found"):
        scatter(inputs, 2)


def test_empty_batch_rejected():
    """Named as the batch, not as a batch_size argument the caller never passed."""
    with pytest.raises(ConfigError, match=r"the batch is empty \(0 rows.*skip empty batches"):
        scatter(torch.zeros(0, 3), 2)


@pytest.mark.parametrize(
    ("outputs", "where"),
    [
        ([{"a": Y}, {"a": Y}, {"b": Y}], "outputs[2]"),
        ([[Y, Y], [Y, Y], [Y]], "outputs[2]"),
        ([(Y, [Y]), (Y, [Y]), (Y, Y)], "outputs[2][1]"),
        ([{"a": X}, {"a": X}, {"a": X[:, :2]}], "outputs[2]['a']"),
        ([Pair(Y, "a"), Pair(Y, "a"), (Y, "a")], "outputs[2]"),
        ([torch.tensor(1.0), torch.tensor(1.0), Y], "outputs[2]"),
    ],
)
def test_gather_mismatch_names_microbatch_and_path(outputs, where):
    with pytest.raises(ConfigError) as info:
        gather(outputs)
    message = str(info.value)
    assert "micro-batch 2" in message
    assert f"{where} is" in message


@pytest.mark.parametrize("outputs", [[], (), X, "ab"])
def test_gather_needs_outputs(outputs):
    with pytest.raises(ConfigError, match="outputs"):
        gather(outputs)


def _tree(rows: int) -> st.SearchStrategy[Any]:
    batched = st.lists(st.integers(1, 3), max_size=2).map(
        lambda dims: torch.arange(rows * math.prod(dims), dtype=torch.float64).reshape(rows, *dims)
    )
    plain = st.one_of(st.none(), st.integers(), st.text(max_size=3))
    return st.recursive(
        st.one_of(batched, plain),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=2), children, max_size=3),
            st.tuples(children, st.text(max_size=2)).map(lambda t: Pair(*t)),
        ),
        max_leaves=8,
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 17), chunks=st.integers(1, 6))
def test_property_round_trip_sizes_and_views(data, rows, chunks):
    inputs = (torch.randn(rows, 2), data.draw(_tree(rows)))
    parts = scatter(inputs, chunks)
    sizes = microbatch_sizes(rows, chunks)
    assert [len(p[0]) for p in parts] == sizes
    assert sum(sizes) == rows and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert all(type(p) is tuple for p in parts)
    assert _equal(gather(parts), inputs)
    offset = 0
    for part, size in zip(parts, sizes, strict=True):
        assert part[0].data_ptr() == inputs[0][offset].data_ptr()
        offset += size
