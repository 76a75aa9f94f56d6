"""The message format between ranks: layouts, identities and payloads round-trip."""

from __future__ import annotations

import pytest
import torch

from pipesched.errors import ConfigError
from pipesched.runtime.wire import (
    CROSSES,
    DATA,
    NOTICE,
    layout_of,
    message_bytes,
    pack,
    read_header,
    unpack,
)
from pipesched.schedule import Message

CPU = torch.device("cpu")


def _round_trip(value):
    layout, tensors = layout_of(value)
    name = Message("B", 3, 7)
    message = pack(DATA, name, layout, tensors, CPU)
    assert message.numel() == message_bytes(layout)
    # The receiver finds the code, the value's identity and the layout in the header.
    assert read_header(message) == (DATA, name, layout)
    return unpack(layout, message)


def test_a_notice_is_a_header_padded_to_the_size_the_receiver_expects() -> None:
    layout, _ = layout_of(torch.ones(5, 3))
    notice = pack(NOTICE, Message("F", 1, 0), layout, [], CPU, size=1000)
    assert notice.numel() == 1000
    assert read_header(notice) == (NOTICE, Message("F", 1, 0), layout)


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(3, 4),
        (torch.arange(5), None, torch.ones(2, 2, dtype=torch.bool)),
        [torch.randn(2, 3, dtype=torch.float64).t(), torch.zeros(0, 7)],  # strided, empty
        (torch.randn(4, 1, 2).expand(4, 3, 2), 4, -17, 2.5e-300, True, False, None),
        # Lazy views whose memory is not their values: a conjugate, a negation, an offset.
        (torch.randn(3, 2, dtype=torch.complex64).conj(), torch.randn(10)[3:7]),
        (torch.randn(2, 2, dtype=torch.complex128).conj().imag,),
    ],
    ids=[
        "tensor",
        "tuple-with-none",
        "list-strided-empty",
        "traced-boundary-with-scalars",
        "conjugate-and-offset",
        "negated-view",
    ],
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


def test_a_new_scalar_is_a_newlayout_of() -> None:
    """A changed size between stages must be announced like a changed shape."""
    assert layout_of((torch.ones(2), 3))[0] != layout_of((torch.ones(2), 4))[0]


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
        layout_of(value, "stage 0")
    message = str(raised.value)
    assert message.startswith(seen + ", which cannot cross to another rank"), message
    # One rule, said the same way for every refusal: never "None is allowed" then a refusal.
    assert CROSSES in message and "a bare None, int, float or bool" in message
    assert "Fix: " in message
