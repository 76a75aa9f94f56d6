"""The p2p message format: layouts and payloads round-trip, without a process group."""

from __future__ import annotations

import pytest
import torch

from pipesched.errors import ConfigError
from pipesched.runtime.p2p import (
    _HEADER_BYTES,
    CROSSES,
    _layout,
    _pack,
    _payload_bytes,
    _trim,
    _unpack,
)

CPU = torch.device("cpu")


def _round_trip(value):
    layout, tensors = _layout(value)
    message = _pack(layout, tensors, CPU)
    assert message.numel() == _HEADER_BYTES + _payload_bytes(layout)
    header = message[:_HEADER_BYTES].view(torch.int64).tolist()
    assert _trim(header[1:]) == layout  # the receiver finds the layout in a padded header
    return _unpack(layout, message)


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(3, 4),
        (torch.arange(5), None, torch.ones(2, 2, dtype=torch.bool)),
        [torch.randn(2, 3, dtype=torch.float64).t(), torch.zeros(0, 7)],  # strided, empty
        (torch.randn(4, 1, 2).expand(4, 3, 2), 4, -17, 2.5e-300, True, False, None),
    ],
    ids=["tensor", "tuple-with-none", "list-strided-empty", "traced-boundary-with-scalars"],
)
def test_values_round_trip_exactly(value) -> None:
    back = _round_trip(value)
    assert type(back) is type(value)
    items = [value] if isinstance(value, torch.Tensor) else value
    got = [back] if isinstance(back, torch.Tensor) else back
    for a, b in zip(items, got, strict=True):
        if isinstance(a, torch.Tensor):
            assert b.dtype == a.dtype and torch.equal(b, a)
        else:
            assert type(b) is type(a) and b == a


def test_a_new_scalar_is_a_new_layout() -> None:
    """A changed size between stages must be announced like a changed shape."""
    assert _layout((torch.ones(2), 3))[0] != _layout((torch.ones(2), 4))[0]


@pytest.mark.parametrize(
    ("value", "seen"),
    [
        ({"a": torch.ones(1)}, "stage 0 returned a bare dict"),
        (("text",), "stage 0 returned a tuple holding str"),
        (3, "stage 0 returned a bare int"),
        (None, "stage 0 returned None"),
    ],
)
def test_other_values_are_refused_with_what_was_seen(value, seen) -> None:
    with pytest.raises(ConfigError) as raised:
        _layout(value, "stage 0")
    message = str(raised.value)
    assert message.startswith(seen + ", which cannot cross to another rank"), message
    # One rule, said the same way for every refusal: never "None is allowed" then a refusal.
    assert CROSSES in message and "a bare None, int, float or bool" in message
    assert "Fix: " in message
