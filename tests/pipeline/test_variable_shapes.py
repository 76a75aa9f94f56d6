"""Micro-batches of their own shapes in one step, against the plain model, one by one."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline, is_recomputing
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule import SCHEDULES, stages_per_worker
from tests.distributed.varlen_worker import micro_batches, token_mean, token_sum

pytestmark = pytest.mark.usefixtures("fp64")

VOCAB, WIDTH = 13, 8
LENGTHS = (37, 5, 129, 1, 16)  # one step's sequence lengths: none alike
ROWS = (2, 1, 3, 1, 2)  # and their row counts
MODES = ["always", "except_last", "never"]


class Block(nn.Module):
    """Causal single-head attention and an MLP: mixes along the sequence, any length."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + self.mlp(h)


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(
        WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
    )
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), encoder, Block(), nn.Linear(WIDTH, VOCAB))


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3)
    )


def token_batches(seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Micro-batches of token ids and labels (some -100: padding), and the non-padding count."""
    shapes = list(zip(ROWS, LENGTHS, strict=True))
    return micro_batches(shapes, VOCAB, torch.Generator().manual_seed(seed))


def reference(model, xs, ys, loss_fn, num_items=None) -> dict[str, torch.Tensor]:
    """sum_i w_i * loss_fn(model(x_i), y_i) on the plain model, micro-batch by micro-batch."""
    plain = copy.deepcopy(model)
    rows = sum(x.shape[0] for x in xs)
    total = sum(
        loss_fn(plain(x), y) * (1 / num_items if num_items else x.shape[0] / rows)
        for x, y in zip(xs, ys, strict=True)
    )
    total.backward()
    return {n: p.grad for n, p in plain.named_parameters()}


def pipe_of(model, schedule, workers, **kwargs) -> Pipeline:
    stages = workers * stages_per_worker(schedule)
    n = len(model)
    balance = [n // stages + (s < n % stages) for s in range(stages)]
    return Pipeline(
        model,
        kwargs.pop("chunks", 2),  # unused: the lists say how many micro-batches a step runs
        balance=balance,
        devices=["cpu"] * workers,
        schedule=schedule,
        **kwargs,
    )


def assert_grads(pipe: Pipeline, expected: dict[str, torch.Tensor]) -> None:
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-13, msg=name)


ALL = [(s, w) for s in SCHEDULES for w in ((2, 4) if stages_per_worker(s) == 1 else (2,))]


@pytest.mark.parametrize(("schedule", "workers"), ALL)
@pytest.mark.parametrize("summed", [True, False], ids=["num_items", "mean"])
def test_token_micro_batches_of_their_own_lengths_equal_the_plain_model(schedule, workers, summed):
    model = token_model()
    xs, ys, n = token_batches()
    loss_fn, num_items = (token_sum, n) if summed else (token_mean, None)
    expected = reference(model, xs, ys, loss_fn, num_items)
    pipe = pipe_of(model, schedule, workers)
    loss = pipe.step(microbatches=xs, targets=ys, loss_fn=loss_fn, num_items=num_items)
    assert_grads(pipe, expected)
    plain = copy.deepcopy(model)
    with torch.no_grad():
        rows = sum(ROWS)
        want = sum(
            loss_fn(plain(x), y) * (1 / n if summed else x.shape[0] / rows)
            for x, y in zip(xs, ys, strict=True)
        )
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    # len(microbatches) micro-batches ran, whatever chunks is.
    forwards = [e.action for e in pipe.last_timeline.events if e.action.kind == "F"]
    assert sorted({a.microbatch for a in forwards}) == list(range(len(xs)))
    assert len(forwards) == len(xs) * pipe.num_stages


@pytest.mark.parametrize(("schedule", "workers"), ALL)
def test_row_counts_of_their_own_weigh_as_one_concatenated_batch(schedule, workers):
    model = mlp()
    g = torch.Generator().manual_seed(3)
    sizes = (1, 5, 3, 7, 2)
    xs = [torch.randn(r, 6, generator=g) for r in sizes]
    ys = [torch.randn(r, 3, generator=g) for r in sizes]
    plain = copy.deepcopy(model)  # independent reference: the mean loss of the whole batch
    nn.functional.mse_loss(plain(torch.cat(xs)), torch.cat(ys)).backward()
    pipe = pipe_of(model, schedule, workers, chunks=3)
    pipe.step(microbatches=xs, targets=ys, loss_fn=nn.functional.mse_loss)
    assert_grads(pipe, {n: p.grad for n, p in plain.named_parameters()})


class Keep(nn.Module):
    """Stage 0 takes a dict: token ids and a per-token keep mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.emb(batch["ids"]) * batch["keep"].unsqueeze(-1)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_dict_micro_batches_and_no_target(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(Keep(), Block(), Block(), nn.Linear(WIDTH, 1))
    g = torch.Generator().manual_seed(4)
    xs = [
        {"ids": torch.randint(0, VOCAB, (r, n), generator=g), "keep": torch.rand(r, n, generator=g)}
        for r, n in zip(ROWS, LENGTHS, strict=True)
    ]

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    items = sum(x["ids"].numel() for x in xs)
    plain = copy.deepcopy(model)
    (sum(loss_fn(plain(x)) for x in xs) / items).backward()
    pipe = pipe_of(model, schedule, 2)
    pipe.step(microbatches=xs, loss_fn=loss_fn, num_items=items)
    assert_grads(pipe, {n: p.grad for n, p in plain.named_parameters()})


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-v"])
@pytest.mark.parametrize("mode", MODES)
def test_every_checkpoint_mode(schedule, mode):
    model = token_model()
    xs, ys, n = token_batches(seed=2)
    expected = reference(model, xs, ys, token_sum, n)
    pipe = pipe_of(model, schedule, 2, checkpoint=mode)
    pipe.step(microbatches=xs, targets=ys, loss_fn=token_sum, num_items=n)
    assert_grads(pipe, expected)


class MaskProbe(nn.Module):
    """Records a hash of where its input is zero (the dropout mask), in forward and recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        digest = hashlib.sha1((x == 0).numpy().tobytes()).hexdigest()
        self.seen.append((is_recomputing(), digest))
        return x


def dropout_model(probe: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        nn.Dropout(0.5),
        probe or nn.Identity(),
        Block(),
        nn.Dropout(0.3),
        Block(),
        nn.Linear(WIDTH, VOCAB),
    )


def _dropout_step(pipe: Pipeline) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    xs, ys, n = token_batches(seed=5)
    torch.manual_seed(7)
    loss = pipe.step(microbatches=xs, targets=ys, loss_fn=token_sum, num_items=n)
    return loss, {name: p.grad.clone() for name, p in pipe.named_parameters()}


@pytest.mark.parametrize(("schedule", "workers"), [("1f1b", 2), ("zb-h1", 4), ("zb-v", 2)])
def test_dropout_draws_do_not_depend_on_schedule_or_checkpointing(schedule, workers):
    # Draws are keyed by (step seed, micro-batch index, layer), not by shape or thread.
    one = Pipeline(dropout_model(), 2, balance=[len(dropout_model())], devices=["cpu"])
    loss0, grads0 = _dropout_step(one)
    for mode in MODES:
        loss, grads = _dropout_step(pipe_of(dropout_model(), schedule, workers, checkpoint=mode))
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0)
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-13, msg=name)
    # and the step repeats under the same torch.manual_seed, bit for bit
    again = _dropout_step(pipe_of(dropout_model(), schedule, workers))
    repeat = _dropout_step(pipe_of(dropout_model(), schedule, workers))
    assert torch.equal(again[0], repeat[0])


def test_recomputed_masks_equal_the_forward_masks_whatever_the_shapes():
    probe = MaskProbe()
    pipe = pipe_of(dropout_model(probe), "1f1b", 2, checkpoint="always")
    _dropout_step(pipe)
    forward = [h for recomputing, h in probe.seen if not recomputing]
    recompute = [h for recomputing, h in probe.seen if recomputing]
    assert len(forward) == len(LENGTHS) and len(set(forward)) == len(LENGTHS)
    assert sorted(recompute) == sorted(forward)


@pytest.mark.parametrize("summed", [True, False], ids=["num_items", "mean"])
def test_a_window_of_variable_micro_batches_equals_the_plain_model(summed):
    model = token_model()
    steps = [token_batches(seed) for seed in (11, 12, 13)]
    loss_fn = token_sum if summed else token_mean
    plain = copy.deepcopy(model)
    total_items = sum(n for _, _, n in steps) if summed else sum(sum(ROWS) for _ in steps)
    window = sum(
        loss_fn(plain(x), y) * (1 if summed else x.shape[0])
        for xs, ys, _ in steps
        for x, y in zip(xs, ys, strict=True)
    )
    (window / total_items).backward()
    pipe = pipe_of(model, "zb-h1", 2)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.0), accumulation_steps=3
    )
    grads = {}

    def keep_grads() -> None:  # the window's normalized gradients, just before the optimizer
        grads.update({n: p.grad.clone() for n, p in pipe.named_parameters()})

    acc.optimizers[0].register_step_pre_hook(lambda *_: keep_grads())
    for xs, ys, n in steps:
        result = acc.step(
            microbatches=xs, targets=ys, loss_fn=loss_fn, num_items=n if summed else None
        )
    assert result.stepped and result.effective_batch == 3 * sum(ROWS)
    assert result.window_loss == pytest.approx(float(window.detach() / total_items), rel=1e-12)
    for name, g in plain.named_parameters():
        torch.testing.assert_close(grads[name], g.grad, rtol=1e-10, atol=1e-13, msg=name)
    assert "variable micro-batches (5 in the last step) x 3 steps" in acc.log_line(result)


def _args(**overrides):
    x = torch.zeros(2, 3, dtype=torch.long)
    args = {"microbatches": [x, x[:1]], "targets": [x, x[:1]], "loss_fn": token_sum}
    return {**args, **overrides}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (_args(inputs=torch.zeros(2, 3, dtype=torch.long)), ConfigError, "both were given"),
        (_args(microbatches=None, targets=None), ConfigError, "neither was given"),
        (
            _args(target=torch.zeros(2, 3, dtype=torch.long), targets=None),
            ConfigError,
            "target= goes with inputs=",
        ),
        (
            {"inputs": torch.zeros(2, 3, dtype=torch.long), "targets": [1], "loss_fn": token_sum},
            ConfigError,
            "targets= goes with microbatches=",
        ),
        (_args(microbatches=torch.zeros(2, 3, dtype=torch.long)), ConfigTypeError, "got Tensor"),
        (_args(microbatches={"ids": torch.zeros(2, 3)}), ConfigTypeError, "must be a list"),
        (_args(microbatches=[], targets=[]), ConfigError, "empty list"),
        (
            _args(targets=[torch.zeros(2, 3, dtype=torch.long)]),
            ConfigError,
            "targets has 1 entries",
        ),
        (
            _args(microbatches=[torch.zeros(0, 3, dtype=torch.long)], targets=None),
            ConfigError,
            "microbatches[0] has 0 rows",
        ),
        (
            _args(targets=[torch.zeros(2, 3), torch.zeros(3, 3)]),
            ConfigError,
            "targets[1] has 3 rows (dim 0) but microbatches[1] has 1",
        ),
        (
            _args(microbatches=[torch.zeros(2, 3, requires_grad=True)], targets=None),
            ConfigError,
            "microbatches[0] requires grad",
        ),
        (_args(microbatches=[torch.tensor(1)], targets=None), ConfigError, "in microbatches[0]"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    pipe = pipe_of(token_model(), "1f1b", 2)
    before = {n: p.clone() for n, p in pipe.named_parameters()}
    with pytest.raises(error) as raised:
        pipe.step(**kwargs)
    assert message in str(raised.value)
    with pytest.raises(error):
        pipe.accumulate(**kwargs)
    assert all(p.grad is None for p in pipe.parameters())
    assert all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
