"""init_mesh's arguments, checked before any process group is made."""

from __future__ import annotations

import pytest

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.mesh import init_mesh


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"pp": 2, "dp": 2, "shard": 3}, ConfigError, r"shard must divide dp.*shard=3"),
        ({"pp": 1, "dp": 6, "shard": 4}, ConfigError, r"groups of 4 of the dp=6 .*HSDP"),
        ({"pp": 2, "dp": 2, "shard": 0}, ConfigError, "shard must be a positive integer"),
        ({"pp": 2, "dp": 2, "shard": True}, ConfigTypeError, "shard must be a positive integer"),
        ({"pp": 2, "dp": 2, "reshard": "layer"}, ConfigError, r"'step'.*'action'.*'layer'"),
        ({"pp": 2, "dp": 2, "reshard": 1}, ConfigTypeError, r"reshard must be 'step' or 'action'"),
    ],
)
def test_a_bad_shard_is_refused_naming_the_value_and_the_choices(kwargs, error, message):
    with pytest.raises(error, match=message):
        init_mesh(**kwargs)
