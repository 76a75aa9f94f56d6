"""Pipeline against the plain model: outputs and gradients, every schedule (INVARIANTS 1-4)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pipesched import ConfigError, PartitionError, Pipeline
from pipesched.schedule import SCHEDULES, stages_per_worker

pytestmark = pytest.mark.usefixtures("fp64")


RTOL, ATOL = 1e-12, 1e-14


def _model(num_layers: int = 8, width: int = 6, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(num_layers):
        layers += [nn.Linear(width, width), nn.Tanh() if k % 2 else nn.ReLU()]
    return nn.Sequential(*layers[:num_layers])


def _balance(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (s < extra) for s in range(num_stages)]


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("batch", [1, 3, 9, 10, 16])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_step_gradients_equal_the_plain_model(schedule, workers, chunks, batch):
    num_stages = workers * stages_per_worker(schedule)
    layers = max(8, num_stages)
    plain, piped = _model(layers), _model(layers)
    pipe = Pipeline(
        piped,
        chunks,
        balance=_balance(layers, num_stages),
        devices=["cpu"] * workers,
        schedule=schedule,
    )
    x, y = torch.randn(batch, 6), torch.randn(batch, 6)
    loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    _assert_close(_grads(pipe), _grads(plain))
    assert all(torch.isfinite(g).all() for g in _grads(pipe).values())
    timeline = pipe.last_timeline
    assert timeline is not None
    assert len(timeline.events) == sum(
        len(r) for r in pipe.schedule_for(min(chunks, batch)).actions
    )


@pytest.mark.parametrize("chunks", [8, 12])
@pytest.mark.parametrize("schedule", ["zb-h2", "dualpipev", "v-half", "v-min"])
def test_frontier_schedules_train_like_the_plain_model(schedule, chunks):
    # 4 workers, m = 2p and 3p: the full orders (dualpipev's overlapped pairs, zb-h2's deferred
    # Ws, the V schedules' squeezed blocks), two steps of SGD against the plain model.
    workers = 4
    num_stages = workers * stages_per_worker(schedule)
    plain, piped = _model(num_stages), _model(num_stages)
    pipe = Pipeline(
        piped,
        chunks,
        balance=[1] * num_stages,
        devices=["cpu"] * workers,
        schedule=schedule,
    )
    sgd_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1)
    sgd_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        x, y = torch.randn(chunks * 2, 6), torch.randn(chunks * 2, 6)
        for optimizer in (sgd_pipe, sgd_plain):
            optimizer.zero_grad()
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        nn.functional.mse_loss(plain(x), y).backward()
        _assert_close(_grads(pipe), _grads(plain))
        sgd_pipe.step()
        sgd_plain.step()
    assert pipe.schedule_for(chunks).name == schedule


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("batch", [3, 10])
def test_forward_is_autograd_transparent(schedule, batch):
    v = stages_per_worker(schedule)
    plain, piped = _model(8), _model(8)
    pipe = Pipeline(piped, 4, balance=_balance(8, 2 * v), devices=["cpu", "cpu"], schedule=schedule)
    x, y = torch.randn(batch, 6), torch.randn(batch, 6)
    out = pipe(x)
    # Micro-batched matmuls may round differently from the whole batch's: not bitwise.
    torch.testing.assert_close(out, plain(x), rtol=RTOL, atol=ATOL)
    nn.functional.mse_loss(out, y).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    _assert_close(_grads(pipe), _grads(plain))


def test_no_grad_streams_forward_only():
    pipe = Pipeline(_model(4), 2, balance=[2, 2], devices=["cpu", "cpu"])
    with torch.no_grad():
        out = pipe(torch.randn(5, 6))
    assert not out.requires_grad
    assert {e.action.kind for e in pipe.last_timeline.events} == {"F"}


def test_token_loss_with_padding_equals_one_batch_token_mean():
    # INVARIANT 3: a sum over tokens divided once by the batch's token count.
    torch.manual_seed(1)
    vocab, width = 11, 8
    plain = nn.Sequential(
        nn.Embedding(vocab, width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, vocab)
    )
    piped = nn.Sequential(
        nn.Embedding(vocab, width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, vocab)
    )
    piped.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, vocab, (6, 5))
    labels = torch.randint(0, vocab, (6, 5))
    labels[0, 1:] = -100  # micro-batches end up with very different token counts
    labels[1, 2:] = -100
    labels[4, 4:] = -100
    count = int((labels != -100).sum())

    def token_sum(logits, target):
        return nn.functional.cross_entropy(
            logits.reshape(-1, vocab), target.reshape(-1), ignore_index=-100, reduction="sum"
        )

    pipe = Pipeline(piped, 3, balance=[2, 2], devices=["cpu", "cpu"], schedule="1f1b")
    loss = pipe.step(tokens, labels, loss_fn=token_sum, num_items=count)
    expected = nn.functional.cross_entropy(
        plain(tokens).reshape(-1, vocab), labels.reshape(-1), ignore_index=-100
    )
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    _assert_close(_grads(pipe), _grads(plain))

    # The common recipe, the mean of per-micro-batch token means, is not this loss.
    means = [
        nn.functional.cross_entropy(plain(t).reshape(-1, vocab), y.reshape(-1), ignore_index=-100)
        for t, y in zip(tokens.split(2), labels.split(2), strict=True)
    ]
    assert abs(float(sum(means).detach() / 3) - float(expected.detach())) > 1e-3


def test_gradients_accumulate_across_steps_like_two_batches():
    # INVARIANT 4: only parameter gradients accumulate; each micro-batch's activation
    # gradient is its own (two steps = the sum of two plain batches).
    plain, piped = _model(6), _model(6)
    pipe = Pipeline(piped, 3, balance=[3, 3], devices=["cpu", "cpu"], schedule="zb-h1")
    data = [(torch.randn(7, 6), torch.randn(7, 6)) for _ in range(2)]
    for x, y in data:
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        nn.functional.mse_loss(plain(x), y).backward()
    _assert_close(_grads(pipe), _grads(plain))


def test_names_and_state_dict_are_the_plain_models():
    plain = _model(4)
    pipe = Pipeline(_model(4, seed=3), 2, balance=[1, 3], devices=["cpu", "cpu"])
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
    pipe.load_state_dict(plain.state_dict())
    assert pipe.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 6)
    torch.testing.assert_close(pipe(x), plain(x), rtol=RTOL, atol=ATOL)


def test_interleaved_runs_several_stages_per_device():
    pipe = Pipeline(
        _model(9), 4, balance=[2, 2, 2, 3], devices=["cpu", "cpu"], schedule="interleaved-1f1b"
    )
    assert pipe.placement == (0, 1, 0, 1)
    assert pipe.num_stages == 4


class Boom(nn.Module):
    """Raises on a micro-batch of exactly two rows."""

    def forward(self, x):
        if x.shape[0] == 2:
            raise ValueError("boom")
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_failing_stage_stops_every_worker_and_the_next_call_works(schedule):
    import threading

    pipe = Pipeline(
        nn.Sequential(nn.Linear(6, 6), Boom(), nn.Linear(6, 6)),
        2,
        balance=[1, 1, 1],
        devices=["cpu"] * 3,
        schedule=schedule,
    )
    with pytest.raises(ValueError, match="boom") as info:
        pipe.step(torch.randn(5, 6), torch.randn(5, 6), loss_fn=nn.functional.mse_loss)
    assert "raised by stage 1 on micro-batch 1 (action 1F1 on worker 1)" in info.value.__notes__[0]
    assert not [t for t in threading.enumerate() if t.name.startswith("pipesched-worker")]
    loss = pipe.step(torch.randn(6, 6), torch.randn(6, 6), loss_fn=nn.functional.mse_loss)
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"chunks": 0}, ConfigError, "chunks must be a positive integer, got 0"),
        ({"balance": [2, 1]}, PartitionError, "sum of balance: 3"),
        ({"balance": [2, 0, 2]}, PartitionError, r"entries \[0\]"),
        ({"checkpoint": "sometimes"}, ConfigError, "sometimes"),
        ({"schedule": "pipedream"}, ConfigError, "unknown schedule 'pipedream'"),
        (
            {"balance": [1, 1, 1, 1], "devices": ["cpu", "cpu"]},
            ConfigError,
            "4 stages need 4 devices, but devices has 2",
        ),
        (
            {"balance": [1, 1, 2], "devices": ["cpu"], "schedule": "interleaved-1f1b"},
            ConfigError,
            "runs 2 stages per worker",
        ),
    ],
)
def test_bad_arguments(kwargs, error, message):
    kwargs = {"chunks": 2, **kwargs}
    with pytest.raises(error, match=message):
        Pipeline(_model(4), **kwargs)


def test_moving_a_pipeline_is_denied():
    pipe = Pipeline(_model(4), 2, balance=[2, 2], devices=["cpu", "cpu"])
    for move in (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu")):
        with pytest.raises(ConfigError, match="Move the model before wrapping it"):
            move()
    assert pipe.to(torch.float32) is pipe


def test_batch_sizes_must_agree_and_loss_must_be_scalar():
    pipe = Pipeline(_model(4), 2, balance=[2, 2], devices=["cpu", "cpu"])
    with pytest.raises(ConfigError, match="target has 5 rows"):
        pipe.step(torch.randn(4, 6), torch.randn(5, 6), loss_fn=nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="loss_fn must return a scalar tensor"):
        pipe.step(
            torch.randn(4, 6),
            torch.randn(4, 6),
            loss_fn=lambda o, t: nn.functional.mse_loss(o, t, reduction="none"),
        )
    with pytest.raises(ConfigError, match="num_items must be > 0, got 0"):
        pipe.step(torch.randn(4, 6), torch.randn(4, 6), loss_fn=nn.functional.mse_loss, num_items=0)


@pytest.mark.parametrize("model", ["none", "frozen"])
def test_a_step_with_nothing_to_train_raises(model):
    """Issue 25 item 8: a model with no parameters trained nothing, silently."""
    if model == "none":
        module = nn.Sequential(nn.Tanh(), nn.ReLU())
    else:
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).requires_grad_(False)
    pipe = Pipeline(module, 2, balance=[1, 1], devices=["cpu", "cpu"])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ConfigError, match="nothing to train: no parameter .* requires grad"):
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), module(x))  # evaluation still runs


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_pipeline_refuses_to_be_copied_and_says_how_to_copy_its_weights(how: str) -> None:
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = Pipeline(model, chunks=2, num_stages=2)
    copier = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*load_state_dict"):
        copier(pipe)
    # The fix it names works: the twin has the pipeline's weights.
    twin = copy.deepcopy(model)
    twin.load_state_dict(pipe.state_dict())
    for a, b in zip(twin.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b) and a is not b


def test_eval_and_train_switch_the_model_itself() -> None:
    """The model's root is not registered in the Pipeline: its own flag stayed True."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    pipe = Pipeline(model, chunks=2, num_stages=2)
    assert pipe.eval() is pipe
    assert not model.training and not any(m.training for m in model.modules())
    pipe.train()
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize(
    ("balance", "schedule", "fix"),
    [
        ([1] * 6, "zb-v", "interleaved-1f1b', 6, chunks, virtual_stages=3"),
        ([2, 1, 1, 1, 1], "interleaved-1f1b", "a balance of 4 stages"),
        ([2, 2, 2], "zb-v", "not a multiple of 2"),
        ([1] * 6, "1f1b", "6 devices for 6 stages"),
    ],
)
def test_stages_that_do_not_fit_the_workers_name_fixes_that_work(balance, schedule, fix):
    """Before: "5 stages need 2.5 devices", and 'interleaved-1f1b' offered for itself."""
    from pipesched.schedule import get_schedule

    with pytest.raises(ConfigError, match=re.escape(fix)) as raised:
        Pipeline(_model(6), 2, balance=balance, devices=["cpu"] * 2, schedule=schedule)
    message = str(raised.value)
    assert ".5 devices" not in message
    if "virtual_stages=3" in message:  # the interleaved fix it names runs
        table = get_schedule("interleaved-1f1b", 6, 2, virtual_stages=3)
        pipe = Pipeline(_model(6), 2, balance=[1] * 6, devices=["cpu"] * 2, schedule=table)
        assert torch.isfinite(pipe.step(torch.randn(4, 6), loss_fn=lambda o: o.square().mean()))
