"""A traced model's forward that updates buffers updates them once per micro-batch, in order.

The reference is the plain model run on the micro-batches one after the other
(docs/guide.md: a forward's buffer update runs once per micro-batch, and the
model's state is the same in every checkpoint mode).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from pipesched import Pipeline, is_recomputing
from pipesched.runtime.stage.recompute import checkpoint

pytestmark = pytest.mark.usefixtures("fp64")

WIDTH = 8


class Counting(nn.Module):
    """Root-level buffers the forward updates, in place and by reassignment.

    export writes ``calls`` and ``total`` back with a ``copy_`` after the last
    operation, in the last stage; ``ema`` is updated in place where it is
    computed; ``scale`` is only read, in the first and the last block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)
        )
        self.head = nn.Linear(WIDTH, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(WIDTH))
        self.register_buffer("drift", torch.zeros(WIDTH))
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        if self.training:
            self.calls += 1
            self.total = self.total + ids.shape[0]
            self.ema.mul_(0.9).add_(0.1 * h.detach().mean((0, 1)))
            self.drift = 0.8 * self.drift + 0.2 * h.detach().square().mean((0, 1))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h.mean(1) * self.scale)


def _plain_state(model: nn.Module, ids: torch.Tensor, chunks: int, steps: int) -> dict:
    """The buffers after the plain model's forwards, one micro-batch after another."""
    for _ in range(steps):
        for part in ids.tensor_split(chunks):
            model(part)
    return {name: b.clone() for name, b in model.named_buffers()}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (8, 5), generator=generator)
    return ids, torch.randint(0, 3, (8,), generator=generator)


@pytest.mark.parametrize(
    ("schedule", "split_points", "checkpoint"),
    [
        ("gpipe", ["blocks.2"], "never"),
        ("gpipe", ["blocks.2"], "always"),
        ("1f1b", ["blocks.2"], "never"),
        ("1f1b", ["blocks.2"], "always"),
        ("1f1b", ["blocks.2"], "except_last"),
        ("zb-h1", ["blocks.2"], "always"),
        ("1f1b", ["blocks.1", "blocks.3"], "always"),
        ("gpipe", ["blocks.1", "blocks.3"], "except_last"),
    ],
)
def test_buffers_a_traced_forward_updates_match_the_plain_model_per_micro_batch(
    schedule, split_points, checkpoint
):
    chunks, steps = 4, 3
    ids, labels = _data()
    torch.manual_seed(0)
    plain = Counting()
    model = copy.deepcopy(plain)
    expected = _plain_state(plain, ids, chunks, steps)
    own = {name: b for name, b in model.named_buffers()}
    pipe = Pipeline(
        model, chunks, devices=["cpu"] * (len(split_points) + 1), schedule=schedule,
        split_points=split_points, checkpoint=checkpoint,
    )  # fmt: skip
    for _ in range(steps):
        pipe.step(ids, labels, loss_fn=nn.functional.cross_entropy)
    assert int(model.calls) == steps * chunks
    assert int(model.total) == steps * len(ids)
    for name, buffer in model.named_buffers():
        assert buffer is own[name], f"{name} is no longer the model's own tensor"
        # The same operations on the same micro-batches in the same order: bitwise.
        torch.testing.assert_close(buffer, expected[name], rtol=0, atol=0, msg=name)


def test_a_write_back_runs_in_the_stage_that_makes_its_value():
    """Only stage 0 updates the counters; later stages read only ``scale``."""
    ids, _ = _data()
    torch.manual_seed(0)
    pipe = Pipeline(
        Counting(), 4, devices=["cpu"] * 3, split_points=["blocks.1", "blocks.3"],
        example_inputs=(ids[:2],),
    )  # fmt: skip
    slots = [sorted(key for _, key in stage.buffer_slots()) for stage in pipe.stages]
    assert slots == [["calls", "drift", "ema", "scale", "total"], [], ["scale"]]


class _Repro(nn.Module):
    """The reported model's shape: ``calls += 1`` and an in-place average, at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, WIDTH), nn.Linear(WIDTH, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.calls += 1
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.b(h)


def _cut_in_two(build):
    """A model, its plain copy, two micro-batches, the plain outputs, and its two stages
    (cut at layer ``b``), called by hand in the order a test needs."""
    torch.manual_seed(0)
    plain = build()
    model = copy.deepcopy(plain)
    parts = torch.randn(8, 4).tensor_split(2)
    expected = [plain(part) for part in parts]
    pipe = Pipeline(model, 2, devices=["cpu"] * 2, split_points=["b"], example_inputs=(parts[0],))
    return plain, model, parts, expected, pipe.stages


def test_a_checkpointed_later_stage_writes_back_no_stale_counter():
    """Stage 1 copies micro-batch 0's input (a checkpointed stage does, at its start),
    then stage 0, another thread, runs micro-batch 1, then stage 1 runs on its copy:
    ``calls`` must still count both micro-batches."""
    plain, model, parts, expected, (first, last) = _cut_in_two(_Repro)
    received = {k: v.clone() for k, v in first(parts[0]).items()}  # as passes._own_copy
    sent = first(parts[1])
    got = [last(received), last({k: v.clone() for k, v in sent.items()})]
    for value, want in zip(got, expected, strict=True):
        torch.testing.assert_close(value, want, rtol=0, atol=0)
    assert int(model.calls) == int(plain.calls) == 2
    torch.testing.assert_close(model.ema, plain.ema, rtol=0, atol=0)


class _ReadLate(nn.Module):
    """``ema`` updated in place by the first stage; the last reads the updated value."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, 2)
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        h = torch.tanh(self.b(h))
        return self.c(h + self.ema)


def test_a_later_stage_reads_the_buffer_as_its_micro_batch_left_it():
    """Stage 0 runs micro-batch 1 before stage 1 runs micro-batch 0 (as GPipe does)."""
    plain, model, parts, expected, (first, last) = _cut_in_two(_ReadLate)
    sent = [first(part) for part in parts]
    for got, want in zip([last(x) for x in sent], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(model.ema, plain.ema, rtol=0, atol=0)


def _float_sum(values: dict) -> torch.Tensor:
    return sum(v.sum() for v in values.values() if v.requires_grad)


def test_recomputations_in_two_threads_leave_the_model_its_own_buffers():
    """Both stages recompute at once, and stage 0 runs a forward meanwhile, forced so.

    Stage 0's recomputation (micro-batch 0) waits, mid-way, until stage 1's
    (micro-batch 0, another thread) has begun; stage 1's waits until stage 0's
    has ended and stage 0 has run micro-batch 1's forward, as 1F1B runs them.
    The buffers must be the model's own tensors afterwards, updated once per
    micro-batch: the throwaway copies a recomputation reads are its own.
    """
    torch.manual_seed(0)
    plain = Counting()
    model = copy.deepcopy(plain)
    ids, _ = _data()
    parts = ids.tensor_split(2)
    expected = _plain_state(plain, ids, 2, 1)
    own = dict(model.named_buffers())
    pipe = Pipeline(
        model, 2, devices=["cpu"] * 2, split_points=["blocks.2"], example_inputs=(parts[0],)
    )
    first, last = pipe.stages
    assert "scale" in [key for _, key in last.buffer_slots()]  # read by both stages

    first_in, last_in, first_done = threading.Event(), threading.Event(), threading.Event()

    def pause(entered: threading.Event, until: threading.Event):
        def hook(module, args):
            if is_recomputing():
                entered.set()
                assert until.wait(30), "the other recomputation never got that far"

        return hook

    first.graph.register_forward_pre_hook(pause(first_in, last_in))
    last.graph.register_forward_pre_hook(pause(last_in, first_done))
    sent = checkpoint(first, parts[0], preserve_rng_state=False)
    received = {k: v.detach().requires_grad_(v.requires_grad) for k, v in sent.items()}
    out = checkpoint(last, received, preserve_rng_state=False)
    failures: list[BaseException] = []

    def run(backward, entered: threading.Event) -> None:
        try:
            backward()
        except BaseException as error:  # reported by the main thread
            failures.append(error)
            entered.set()

    threads = [
        threading.Thread(target=run, args=(lambda: _float_sum(sent).backward(), first_in)),
        threading.Thread(target=run, args=(lambda: out.sum().backward(), last_in)),
    ]
    try:
        threads[0].start()
        assert first_in.wait(30), "stage 0 was not recomputed"
        threads[1].start()
        threads[0].join(30)
        with torch.no_grad():
            first(parts[1])  # micro-batch 1, while stage 1 recomputes micro-batch 0
    finally:
        first_done.set()
        last_in.set()
        for thread in threads:
            thread.join(30)
    assert not failures, failures
    for name, buffer in model.named_buffers():
        assert buffer is own[name], f"{name} is no longer the model's own tensor"
        torch.testing.assert_close(buffer, expected[name], rtol=0, atol=0, msg=name)


class _OneNorm(nn.Module):
    """One BatchNorm called after each of four layers (its statistics updated four times)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = self.bn(layer(x)).tanh()
        return x


@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
@pytest.mark.parametrize("split", ["layers.1", "layers.3"])
def test_a_buffer_two_stages_would_write_is_refused_naming_it(split: str) -> None:
    """Before, stage 1 bumped a copy of num_batches_tracked it received: 1 or 3, not 4."""
    x = torch.randn(8, WIDTH)
    with pytest.raises(ValueError, match=r"'bn.num_batches_tracked' is written by stages \[0, 1\]"):
        pipe = Pipeline(_OneNorm(), 1, devices=["cpu"] * 2, split_points=[split])
        pipe.step(x, x, loss_fn=nn.functional.mse_loss)


@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
def test_a_layer_called_at_several_places_in_one_stage_updates_as_the_plain_model() -> None:
    x = torch.randn(8, WIDTH)
    plain = _OneNorm()
    nn.functional.mse_loss(plain(x), x).backward()
    model = _OneNorm()
    pipe = Pipeline(model, 1, num_stages=1, example_inputs=(x[:4],))
    pipe.step(x, x, loss_fn=nn.functional.mse_loss)
    assert int(model.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == 4
    torch.testing.assert_close(model.bn.running_mean, plain.bn.running_mean, rtol=0, atol=1e-15)
    torch.testing.assert_close(model.bn.running_var, plain.bn.running_var, rtol=0, atol=1e-15)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


def test_a_deferred_batch_norm_called_at_several_places_is_refused() -> None:
    """Its deferral was silently dropped (the calls stay operations, not the layer)."""
    x = torch.randn(8, WIDTH)
    with pytest.raises(ValueError, match="'bn' is called at 4 places"):
        Pipeline(_OneNorm(), 2, num_stages=1, example_inputs=(x[:4],), deferred_batch_norm=True)


@pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning")
def test_a_sequentials_batch_norm_in_two_stages_is_refused_and_in_one_runs() -> None:
    bn = nn.BatchNorm1d(WIDTH)
    layers = [nn.Linear(WIDTH, WIDTH), bn, nn.Linear(WIDTH, WIDTH), bn]
    model = nn.Sequential(*layers).eval()  # in eval mode it only reads its statistics
    split = Pipeline(model, 2, balance=[2, 2], devices=["cpu"] * 2)
    torch.testing.assert_close(split(torch.ones(4, WIDTH)), model(torch.ones(4, WIDTH)))
    model.train()
    with pytest.raises(ValueError, match=r"BatchNorm '1' is used by stages \[0, 1\]"):
        split.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH), loss_fn=nn.functional.mse_loss)
    assert int(bn.num_batches_tracked) == 0  # refused before anything ran
    model = nn.Sequential(*layers, nn.Linear(WIDTH, WIDTH))
    pipe = Pipeline(model, 1, balance=[4, 1], devices=["cpu"] * 2)
    x = torch.randn(8, WIDTH)
    pipe.step(x, x, loss_fn=nn.functional.mse_loss)
    assert int(bn.num_batches_tracked) == 2  # once per place, as the plain model


def test_converting_a_batch_norm_used_at_two_places_is_refused() -> None:
    """Before, only its first place became deferred; the second kept moving per micro-batch."""
    from pipesched import DeferredBatchNorm

    bn = nn.BatchNorm1d(WIDTH)
    with pytest.raises(ValueError, match=r"used at 2 places \('1', '3'\)"):
        DeferredBatchNorm.convert(nn.Sequential(nn.Linear(WIDTH, WIDTH), bn, nn.Tanh(), bn))
