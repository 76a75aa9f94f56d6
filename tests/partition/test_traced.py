"""Traced models through the pipeline: outputs and gradients equal the plain model's.

GPT-2 and ViT come from Hugging Face configs (no download) and are skipped
when transformers is not installed; the U-Net-like CNN needs nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.schedule import SCHEDULES, stages_per_worker
from tests.partition.models import UNet

RTOL, ATOL = 1e-10, 1e-12


pytestmark = pytest.mark.usefixtures("fp64")


def _gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    from tests.partition.models import GPT2Logits

    return GPT2Logits()


def _vit() -> nn.Module:
    pytest.importorskip("transformers")
    from tests.partition.models import vit

    return vit()


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _logits_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out["logits"], labels)


def _image_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


# name: (model factory, input of `batch` rows, target of `batch` rows, loss)
MODELS = {
    "unet": (
        UNet,
        lambda b: torch.randn(b, 3, 16, 16),
        lambda b: torch.randn(b, 2, 16, 16),
        _image_loss,
    ),
    "gpt2": (
        _gpt2,
        lambda b: torch.randint(0, 100, (b, 12)),
        lambda b: torch.randint(0, 100, (b, 12)),
        _token_loss,
    ),
    "vit": (
        _vit,
        lambda b: torch.randn(b, 3, 32, 32),
        lambda b: torch.randint(0, 10, (b,)),
        _logits_loss,
    ),
}


def _pair(name: str) -> tuple[nn.Module, nn.Module]:
    make = MODELS[name][0]
    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    return plain, make()


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_grads_equal(pipe: nn.Module, plain: nn.Module) -> None:
    got, expected = _grads(pipe), _grads(plain)
    assert got.keys() == expected.keys() == {n for n, _ in plain.named_parameters()}
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_step_equals_the_plain_model(name, stages, schedule):
    plain, piped = _pair(name)
    _, inputs, targets, loss_fn = MODELS[name]
    x, y = inputs(7), targets(7)  # micro-batches of 3, 2 and 2 rows
    pipe = Pipeline(
        piped,
        chunks=3,
        example_inputs=(x[:2],),
        num_stages=stages,
        devices=["cpu"] * stages,
        schedule=schedule,
        balance="params",
    )
    assert pipe.num_stages == stages
    loss = pipe.step(x, y, loss_fn=loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    _assert_grads_equal(pipe, plain)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_is_autograd_transparent(name):
    plain, piped = _pair(name)
    _, inputs, targets, loss_fn = MODELS[name]
    x, y = inputs(5), targets(5)
    pipe = Pipeline(piped, chunks=5, example_inputs=(x[:2],), devices=["cpu"] * 2, balance="params")
    out = pipe(x)  # five micro-batches of one row: smaller than the traced example
    reference = plain(x)
    if isinstance(reference, torch.Tensor):
        torch.testing.assert_close(out, reference, rtol=RTOL, atol=ATOL)
    else:
        torch.testing.assert_close(out["logits"], reference["logits"], rtol=RTOL, atol=ATOL)
    loss_fn(out, y).backward()
    loss_fn(reference, y).backward()
    _assert_grads_equal(pipe, plain)


def test_tied_embeddings_get_both_stages_gradients():
    plain, piped = _pair("gpt2")
    pipe = Pipeline(
        piped,
        chunks=2,
        example_inputs=(torch.randint(0, 100, (2, 12)),),
        devices=["cpu"] * 4,
        balance="params",
    )
    wte, head = piped.gpt2.transformer.wte.weight, piped.gpt2.lm_head.weight
    assert wte is head
    users = [
        s
        for s, stage in enumerate(pipe.stages)
        if any(
            holder[key] is wte
            for holder, key in stage._state  # the parameters each stage reads
        )
    ]
    assert users == [0, 3]  # the embedding on the first stage, the LM head on the last
    x, y = torch.randint(0, 100, (4, 12)), torch.randint(0, 100, (4, 12))
    pipe.step(x, y, loss_fn=_token_loss)
    _token_loss(plain(x), y).backward()
    torch.testing.assert_close(wte.grad, plain.gpt2.transformer.wte.weight.grad, rtol=RTOL, atol=0)
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert pipe.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("gpipe", "1f1b")])
def test_other_schedules_and_checkpoint_modes(schedule):
    plain, piped = _pair("unet")
    x, y = torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16)
    workers = 2
    pipe = Pipeline(
        piped,
        chunks=3,
        example_inputs=(x[:2],),
        devices=["cpu"] * workers,
        schedule=schedule,
        checkpoint="always",
        balance="params",
    )
    assert pipe.num_stages == workers * stages_per_worker(schedule)
    pipe.step(x, y, loss_fn=_image_loss)
    _image_loss(plain(x), y).backward()
    _assert_grads_equal(pipe, plain)


def test_skip_tensor_travels_through_every_stage():
    _, piped = _pair("unet")
    pipe = Pipeline(
        piped,
        chunks=2,
        example_inputs=(torch.randn(2, 3, 16, 16),),
        split_points=["down.1", "down.2", "up.1"],
        devices=["cpu"] * 4,
    )
    stem_out = next(n for n, d in pipe.stage_graph.nodes(data=True) if d.get("layer") == "stem")
    sent = [stage._sends for stage in pipe.stages[:-1]]
    assert all(stem_out in names for names in sent)  # stem's output reaches up.2 on stage 3


def test_an_example_of_one_row_still_takes_any_batch():
    plain, piped = _pair("unet")
    pipe = Pipeline(piped, 3, example_inputs=(torch.randn(1, 3, 16, 16),), devices=["cpu"] * 2)
    x, y = torch.randn(7, 3, 16, 16), torch.randn(7, 2, 16, 16)
    pipe.step(x, y, loss_fn=_image_loss)
    _image_loss(plain(x), y).backward()
    _assert_grads_equal(pipe, plain)


class _Tagged(nn.Module):
    """Returns a string constant beside its tensor; ``tag`` may bear an input's name."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, object]:
        return {"out": self.b(torch.tanh(self.a(x))) * mask, "kind": self.tag}


@pytest.mark.parametrize("tag", ["regression", "mask", "x"])
def test_a_string_the_model_returns_comes_back_as_itself(tag):
    # Not as the graph's value of that name ("mask", "x": inputs reaching the last stage).
    model = _Tagged(tag).double()
    x, mask = torch.randn(8, 4, dtype=torch.float64), torch.ones(8, 2, dtype=torch.float64)
    pipe = Pipeline(model, 2, devices=["cpu", "cpu"], example_inputs=(x, mask))
    with torch.no_grad():
        out = pipe(x, mask)
    assert out["kind"] == tag and isinstance(out["kind"], str)
    torch.testing.assert_close(out["out"], model(x, mask)["out"], rtol=0, atol=1e-15)


class _ReturnsItsState(nn.Module):
    """Returns its own parameter and buffer beside its output (a temperature, a mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5]))
        self.register_buffer("offset", torch.arange(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(x))) + self.offset, self.scale, self.offset


def test_a_parameter_or_buffer_the_model_returns_comes_back_as_itself_and_trains(fp64):
    """Before, a KeyError from the last stage on every call."""
    torch.manual_seed(0)
    model = _ReturnsItsState()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe = Pipeline(model, 2, devices=["cpu", "cpu"])
    with torch.no_grad():
        out, scale, offset = pipe(x)
    assert scale is model.scale and offset is model.offset
    torch.testing.assert_close(out, plain(x)[0], rtol=1e-12, atol=0)

    def loss_fn(outputs, target):
        out, scale, _ = outputs
        return nn.functional.mse_loss(out * scale, target)

    loss = pipe.step(x, y, loss_fn=loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=1e-10, atol=1e-14)


class _SpectralNet(nn.Module):
    """Spectral norm's power iteration runs under no_grad and writes its buffers with out=."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6))
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_traced_no_grad_region_writing_buffers_out_trains_as_the_plain_model(checkpoint):
    import copy
    import warnings

    torch.manual_seed(0)
    model = _SpectralNet()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = Pipeline(model, chunks=2, devices=["cpu"] * 2, checkpoint=checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (told: its buffers update once per micro-batch)
        loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    expected = 0.0  # the plain model micro-batch by micro-batch, each a half of the batch
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        part = nn.functional.mse_loss(plain(xs), ys) / 2
        part.backward()
        expected += part.detach()
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=RTOL, atol=ATOL)
    for name, b in plain.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), b, rtol=RTOL, atol=ATOL)
