"""How a call's arguments become one value a pipeline can cut, and what a trace depends on."""

from __future__ import annotations

import torch
from torch import nn

from pipesched.partition.call import Call, as_call, call_key, describe_change, with_cache_off
from pipesched.runtime.stage.microbatch import scatter

X, M = torch.randn(6, 3), torch.ones(6, 3)


class Two(nn.Module):
    def forward(self, x, mask=None):
        return x if mask is None else x * mask


class Pair(nn.Module):
    def forward(self, pair):
        return pair[0] * pair[1]


class Batch(nn.Module):
    def forward(self, batch):
        return batch["x"]


class Cached(nn.Module):
    def forward(self, x, use_cache=None):
        return x


def test_a_batch_is_read_as_the_forward_takes_it():
    assert as_call(Two(), {"x": X, "mask": M}) == Call((), {"x": X, "mask": M})  # keywords
    assert as_call(Two(), (X, M)) == Call((X, M), {})  # positional arguments
    assert as_call(Pair(), (X, M)) == Call(((X, M),), {})  # the one argument it takes
    assert as_call(Batch(), {"x": X}) == Call(({"x": X},), {})  # a dict it takes whole
    assert as_call(Two(), X) == Call((X,), {})
    given = Call((X,), {"mask": M})
    assert as_call(Two(), given) is given


def test_a_call_is_cut_into_micro_batches_like_any_nesting():
    parts = scatter(Call((X,), {"mask": M, "flag": True}), 3)
    assert [type(p) for p in parts] == [Call] * 3
    assert [p.args[0].shape[0] for p in parts] == [2, 2, 2]
    assert all(p.kwargs["flag"] is True for p in parts)


def test_the_key_ignores_sizes_and_keyword_order_but_not_what_the_trace_fixes():
    key = call_key(Call((X,), {"mask": M, "flag": True}))
    assert call_key(Call((X[:2],), {"flag": True, "mask": M[:2]})) == key  # sizes, order
    for other, said in [
        (Call((X,), {"mask": M, "flag": False}), "changed from True to False"),
        (Call((X,), {"mask": M.long(), "flag": True}), "torch.int64"),
        (Call((X,), {"mask": M[None], "flag": True}), "3-dim"),
        (Call((X,), {"flag": True}), "keywords ['flag']"),
    ]:
        assert call_key(other) != key
        assert said in describe_change(key, call_key(other))


def test_caching_is_off_unless_asked_for():
    assert with_cache_off(Cached(), Call((X,), {})).kwargs == {"use_cache": False}
    assert with_cache_off(Cached(), Call((X,), {"use_cache": True})).kwargs == {"use_cache": True}
    assert with_cache_off(Two(), Call((X,), {})).kwargs == {}
