"""The step shapes pipeline ranks exchange: encoding, and each mismatch named with its fix."""

from __future__ import annotations

import pytest
import torch

from pipesched.errors import RemoteError
from pipesched.runtime.agreement import StepShape, agreed_seed, batch_digest, mismatch
from pipesched.runtime.failures import Failure, is_timeout
from pipesched.schedule import get_schedule


def _shape(name="1f1b", stages=2, m=4, *, training=True, target=True, seed=0, weights=()):
    schedule = get_schedule(name, stages, m)
    return StepShape.of(schedule, training=training, has_target=target, seed=seed, weights=weights)


@pytest.mark.parametrize("seed", [0, 1, 2**62 - 1, -(2**63), 2**63 - 1])
def test_a_shape_round_trips_through_its_tensor(seed) -> None:
    shape = _shape("interleaved-1f1b", 4, 8, target=False, seed=seed, weights=[0.25] * 8)
    encoded = shape.encode()
    assert encoded.numel() == StepShape.size()
    assert StepShape.decode(encoded.tolist()) == shape


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (_shape(m=3), "pp rank 0 has 4 micro-batches, pp rank 1 has 3: give every rank"),
        (_shape(training=False), "pp rank 0 runs a training step (step/accumulate), pp rank 1"),
        (_shape("gpipe"), "pp rank 0 runs schedule '1f1b' with 2 stages, pp rank 1 runs 'gpipe'"),
        (_shape(stages=4), "pp rank 1 runs '1f1b' with 4 stages"),
        (_shape(target=False), "pp rank 0 passes a target, pp rank 1 passes no target"),
        (
            _shape(weights=[0.1, 0.2, 0.3, 0.4]),
            "pp rank 1 weighs its 4 micro-batches' losses otherwise than pp rank 0 (their row "
            "counts, or num_items, differ)",
        ),
    ],
    ids=["micro-batches", "call", "schedule", "stages", "target", "weights"],
)
def test_each_mismatch_is_named_with_its_fix(other, named) -> None:
    problem = mismatch([_shape(weights=[0.4, 0.3, 0.2, 0.1]), other])
    assert problem is not None and named in problem


def test_a_batch_digest_tells_other_contents_and_not_another_layout() -> None:
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(6, 5, generator=g), torch.randint(0, 9, (6, 7), generator=g)
    batch = [[(x[:3], ids[:3]), (x[3:], ids[3:])], [ids[:3, 0], ids[3:, 0]]]
    same = [[(x.t().contiguous().t()[:3], ids[:3].clone()), (x[3:], ids[3:])], batch[1]]
    assert batch_digest(batch) == batch_digest(same) != 0  # strides apart, the same bits
    other = [[(x[:3], ids[:3]), (x[3:], (ids[3:] + 1) % 9)], batch[1]]
    assert batch_digest(other) != batch_digest(batch)
    odd = [torch.tensor([True, False, True]), torch.zeros(3, dtype=torch.float16)]
    assert batch_digest(odd) != batch_digest([odd[0].logical_not(), odd[1]])
    problem = mismatch([_shape(), StepShape.of(get_schedule("1f1b", 2, 4), training=True,
                                               has_target=True, seed=0, contents=5)])  # fmt: skip
    assert problem is not None and "pp rank 1 was given another batch" in problem


def test_seeds_may_differ_and_the_first_drawn_one_wins() -> None:
    assert mismatch([_shape(seed=5), _shape(seed=9)]) is None
    assert agreed_seed([_shape(seed=5), _shape(seed=9)]) == 5
    assert agreed_seed([_shape(seed=0), _shape(seed=9)]) == 9  # pp rank 0 has no random layer
    assert agreed_seed([_shape(), _shape()]) == 0


def test_a_failure_becomes_a_remote_error_with_its_facts_and_back() -> None:
    failure = Failure("error", "rank 1 failed", 1, 1, 0, "1F2", "ValueError", "boom")
    error = failure.error()
    assert isinstance(error, RemoteError) and isinstance(error, RuntimeError)
    assert (error.rank, error.pp_rank, error.action, error.error_type) == (
        1,
        1,
        "1F2",
        "ValueError",
    )
    assert Failure.of(error) == failure


def test_a_wait_that_ran_out_is_a_timeout_and_a_closed_connection_is_not() -> None:
    gloo_timeout = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:48864")
    assert is_timeout(gloo_timeout, 3.0, 3.0)
    assert not is_timeout(closed, 0.2, 3.0)
    assert is_timeout(closed, 3.0, 3.0)  # whatever the backend says, the wait lasted it all
