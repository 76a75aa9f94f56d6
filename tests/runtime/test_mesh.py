"""init_mesh's arguments, checked before any process group is made."""

from __future__ import annotations

import pytest

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.mesh import init_mesh


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"pp": 2, "dp": 2, "shard": 3}, ConfigError, r"shard must be 1 .* or dp=2 .*got 3"),
        ({"pp": 2, "dp": 4, "shard": 2}, ConfigError, "HSDP"),
        ({"pp": 2, "dp": 2, "shard": 0}, ConfigError, "shard must be a positive integer"),
        ({"pp": 2, "dp": 2, "shard": True}, ConfigTypeError, "shard must be a positive integer"),
    ],
)
def test_bad_shard_is_refused_naming_the_value_and_the_choices(kwargs, error, message):
    with pytest.raises(error, match=message):
        init_mesh(**kwargs)
