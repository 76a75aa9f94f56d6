"""Outputs that mix rows of different samples are told, never silently computed per micro-batch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from pipesched import BatchCoupledWarning, Pipeline
from pipesched.pipeline.checks.coupled_outputs import coupled_flags

pytestmark = pytest.mark.usefixtures("fp64")


def _called(call):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in seen if issubclass(w.category, BatchCoupledWarning)]


def _clip():
    transformers = pytest.importorskip("transformers")
    text = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 99, "max_position_embeddings": 16,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 16, "patch_size": 8}  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    return transformers.CLIPModel(config)


def _clip_batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 99, (8, 7), generator=generator)
    return {"input_ids": ids, "pixel_values": torch.randn(8, 3, 16, 16, generator=generator)}


def test_clip_loss_and_logits_are_told_and_not_averaged_nor_cut():
    model = _clip()
    plain = copy.deepcopy(model)
    batch = _clip_batch()
    expected = plain(**batch, return_loss=True)
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    out, messages = _called(lambda: pipe(**batch, return_loss=True))
    for name in ("loss", "logits_per_image", "logits_per_text"):  # per micro-batch: a list
        assert isinstance(out[name], list) and len(out[name]) == 4, name
        assert any(f"output['{name}'] mixes rows" in m and "chunks=1" in m for m in messages)
    assert len(messages) == 3
    for name in ("image_embeds", "text_embeds"):  # per sample: the plain model's
        torch.testing.assert_close(out[name], expected[name], rtol=1e-10, atol=1e-12)
    loss, (message,) = _called(lambda: pipe.step(dict(batch, return_loss=True), loss_fn=_loss))
    assert "output['loss']" in message and "loss_fn receives each micro-batch's value" in message
    assert not torch.isclose(loss, expected.loss)  # what was told: another model's loss
    _, again = _called(lambda: pipe.step(dict(batch, return_loss=True), loss_fn=_loss))
    assert again == []  # once per Pipeline


def _loss(out):
    return out.loss


def test_clip_workaround_from_the_embeddings_is_the_plain_models_loss_and_gradients():
    from transformers.models.clip.modeling_clip import image_text_contrastive_loss

    model = _clip()
    plain = copy.deepcopy(model)
    batch = _clip_batch()
    expected = plain(**batch, return_loss=True).loss
    expected.backward()
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchCoupledWarning)  # logits_per_*: per micro-batch
        out = pipe(**batch)
    logits_per_text = out.text_embeds @ out.image_embeds.T * model.logit_scale.exp()
    loss = image_text_contrastive_loss(logits_per_text)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=0)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-8, atol=1e-12, msg=name)


def test_clip_in_one_micro_batch_is_the_plain_model():
    model = _clip()
    plain = copy.deepcopy(model)
    batch = _clip_batch()
    out, messages = _called(lambda: Pipeline(model, chunks=1, devices=["cpu"])(**batch))
    assert messages == []
    expected = plain(**batch)
    torch.testing.assert_close(out.logits_per_image, expected.logits_per_image, rtol=0, atol=0)


class InBatch(nn.Module):
    """Two towers, an in-batch contrastive loss, a centered and a softmax-over-batch output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        za = nn.functional.normalize(self.a(x), dim=-1)
        zb = nn.functional.normalize(self.b(y), dim=-1)
        logits = za @ zb.T / 0.1
        labels = torch.arange(za.shape[0])
        return {
            "loss": nn.functional.cross_entropy(logits, labels),
            "za": za,
            "centered": za - za.mean(0),
            "weights": torch.softmax(za.sum(-1), dim=0),
            "per_row": (za * zb).sum(-1),
        }


def test_an_in_batch_contrastive_model_is_flagged_exactly_where_rows_mix():
    model = InBatch()
    x, y = torch.randn(6, 6), torch.randn(6, 4)
    pipe = Pipeline(model, chunks=3, devices=["cpu"] * 2)
    out, messages = _called(lambda: pipe(x, y))
    mixed = {k for k, v in out.items() if isinstance(v, list)}
    assert mixed == {"loss", "centered", "weights"}
    assert len(messages) == 3
    plain = model(x, y)
    for name in ("za", "per_row"):
        torch.testing.assert_close(out[name], plain[name], rtol=1e-12, atol=1e-14)


def _gpt2_lm():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _vit():
    pytest.importorskip("transformers")
    from tests.partition.models import vit

    return vit()


class MLPWithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out, nn.functional.mse_loss(out, y)


def _lm_batch() -> dict[str, object]:
    ids = torch.randint(0, 50, (6, 8))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _transformer() -> nn.Module:
    return nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)


# name: (model, its call's arguments for 6 rows)
PER_SAMPLE = {
    "gpt2 with labels": (_gpt2_lm, _lm_batch),
    "vit": (_vit, lambda: {"pixel_values": torch.randn(6, 3, 32, 32)}),
    "transformer": (
        _transformer,
        lambda: {"src": torch.randn(6, 5, 16), "tgt": torch.randn(6, 4, 16)},
    ),
    "mlp with a loss": (MLPWithLoss, lambda: {"x": torch.randn(6, 4), "y": torch.randn(6, 2)}),
}


@pytest.mark.parametrize("name", PER_SAMPLE)
def test_per_sample_models_are_not_flagged(name):
    make, arguments = PER_SAMPLE[name]
    torch.manual_seed(0)
    pipe = Pipeline(make(), chunks=3, devices=["cpu"] * 2)
    _, messages = _called(lambda: pipe(**arguments()))
    assert messages == []
    assert not any(coupled_flags(pipe.stages[-1].traced))


class _Pooled(nn.Module):
    """Per-sample losses pooled over the batch by ``pool``; ``num_items_in_batch`` divides."""

    def __init__(self, pool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        self.pool = pool

    def forward(self, x, labels, num_items_in_batch=None):
        per = nn.functional.cross_entropy(self.b(self.a(x).tanh()), labels, reduction="none")
        loss = self.pool(per, x)
        return {"loss": loss if num_items_in_batch is None else loss / num_items_in_batch}


POOLS = {  # name: (pool, summed call, adds up)
    "max": (lambda per, x: per.max(), False, False),
    "median": (lambda per, x: per.median(), False, False),
    "variance": (lambda per, x: per.var(), False, False),
    "logsumexp": (lambda per, x: per.logsumexp(0), False, False),
    "square of the mean": (lambda per, x: per.mean() ** 2, False, False),
    "sum": (lambda per, x: per.sum(), False, False),
    "mean under num_items_in_batch": (lambda per, x: per.mean(), True, False),
    "mean": (lambda per, x: per.mean(), False, True),
    "sum over the rows' count": (lambda per, x: per.sum() / x.shape[0], False, True),
    "affine in the mean": (lambda per, x: per.mean() * 2 + 1, False, True),
    "a loss's mean (reduction=1)": (
        lambda per, x: nn.functional.mse_loss(per, torch.zeros_like(per)),
        False,
        True,
    ),
    "sum under num_items_in_batch": (lambda per, x: per.sum(), True, True),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_a_loss_pooled_over_the_batch_other_than_micro_batches_add_up_is_told(name):
    """Against the plain model: where micro-batches' values add up to its loss, nothing is
    said; where they do not (a max, a variance, a sum the call does not say is one, a mean a
    model returns though the call passes num_items_in_batch), the output is told."""
    pool, summed, adds_up = POOLS[name]
    x, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    extra = {"num_items_in_batch": 1} if summed else {}
    plain = _Pooled(pool)(x, labels, **extra)["loss"]
    pipe = Pipeline(_Pooled(pool), chunks=3, devices=["cpu"] * 2)
    out, messages = _called(lambda: pipe(x, labels, **extra))
    assert coupled_flags(pipe.stages[-1].traced, summed)[0] is not adds_up
    if adds_up:
        assert messages == []
        torch.testing.assert_close(out["loss"], plain, rtol=1e-12, atol=1e-14)
    else:
        assert len(messages) == 1 and "output['loss']" in messages[0]
        joined = out["loss"]
        parts = torch.stack(list(joined))
        rebuilt = parts.sum() if summed else parts.mean()  # what joining would have returned
        assert not torch.allclose(rebuilt, plain, rtol=1e-6)  # a silent wrong value, before


class WindowMerge(nn.Module):
    """Swin's window partition and merge: ``B * windows`` rows viewed back as ``(B, ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        windows = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 2, 2, c)
        windows = self.b(torch.tanh(self.a(windows)))
        # The -1 is B * (H/2 * W/2) / (H/2 * W/2): the export's size holds B over B.
        merged = windows.view(-1, h // 2, w // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5)
        return self.head(merged.reshape(-1, h, w, c).mean((1, 2)))


def test_a_size_that_names_the_batch_but_does_not_grow_with_it_is_not_coupled():
    """Before, Swin's logits and loss were told as coupled and came back as lists."""
    torch.manual_seed(0)
    model = WindowMerge()
    x = torch.randn(7, 8, 8, 3)
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    out, messages = _called(lambda: pipe(x))
    assert messages == []
    torch.testing.assert_close(out, model(x), rtol=1e-12, atol=1e-14)


class _Numbers(nn.Module):
    """A per-sample output computed with a number: ``how`` of the hidden rows ``h``."""

    def __init__(self, how) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.how(self.a(x).tanh()))


NUMBERS = {  # name: (how, coupled)
    "times the batch size": (lambda h: h * h.shape[0], True),
    "times an item of the batch's max": (lambda h: h * h.abs().max().item(), True),
    "times a count of distinct values": (lambda h: h * torch.unique(h.argmax(1)).numel(), True),
    "an identity over the samples": (lambda h: torch.eye(h.shape[0], dtype=h.dtype) @ h, True),
    "normalized over the samples": (lambda h: nn.functional.layer_norm(h.T, h.shape[:1]).T, True),
    "reshaped by the batch size": (lambda h: h.reshape(h.shape[0], 2, 4).flatten(1), False),
    "times a width": (lambda h: h * h.shape[1] ** -0.5, False),
    "normalized over the features": (lambda h: nn.functional.layer_norm(h, h.shape[1:]), False),
}


@pytest.mark.parametrize("name", NUMBERS)
def test_a_number_that_follows_the_batch_used_as_a_value_is_coupled(name):
    """Before, silent: the batch's size or an .item() of its data entered as numbers."""
    how, coupled = NUMBERS[name]
    model = _Numbers(how)
    x = torch.randn(6, 4)
    pipe = Pipeline(model, chunks=3, devices=["cpu"] * 2)
    out, messages = _called(lambda: pipe(x))
    assert isinstance(out, list) is coupled and len(messages) == int(coupled)
    if not coupled:
        torch.testing.assert_close(out, model(x), rtol=1e-12, atol=1e-14)
