"""`Pipeline(model, chunks=4, devices=[...])` on models as their users call them.

Hugging Face ViT, GPT-2 and BERT (built from small configs, nothing
downloaded) and a timm-style ViT written here, each wrapped with exactly that
line, no example inputs: the outputs have the model's own type and equal the
plain model's, gradients equal (fp64), and a GradientAccumulator trains from a
dict batch as the plain model trains.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import ConfigError, RetraceWarning

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

RTOL, ATOL = 1e-10, 1e-12
BATCH = 8


class PatchEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, 4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, drop_path: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop_path = drop_path

    def _path(self, x: torch.Tensor) -> torch.Tensor:  # timm's DropPath, per sample
        if not self.training or self.drop_path == 0.0:
            return x
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - self.drop_path)
        return x * keep / (1 - self.drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._path(self.attn(self.norm1(x)))
        return x + self._path(self.mlp(self.norm2(x)))


class TimmStyleViT(nn.Module):
    """timm's VisionTransformer in miniature: patches, cls token, positions, blocks, head."""

    def __init__(self, dim: int = 32, depth: int = 4, drop_path: float = 0.0) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, 4, drop_path) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def _gpt2() -> nn.Module:  # default dropouts (0.1): turned off in eval mode for the equality
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=4)
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _images(g: torch.Generator) -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g),
    }


def _tokens(g: torch.Generator) -> dict[str, Any]:
    ids = torch.randint(0, 64, (BATCH, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _masked(g: torch.Generator) -> dict[str, Any]:
    mask = torch.ones(BATCH, 12, dtype=torch.long)
    mask[::2, 7:] = 0  # half the rows padded after 7 tokens
    return {
        "input_ids": torch.randint(0, 64, (BATCH, 12), generator=g),
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (BATCH,), generator=g),
    }


FAMILIES: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], dict[str, Any]]]] = {
    "hf-vit": (_vit, _images),
    "hf-gpt2": (_gpt2, _tokens),
    "hf-bert": (_bert, _masked),
}


def _built(family: str) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    make, data = FAMILIES[family]
    torch.manual_seed(0)
    plain = make().eval()
    model = make().eval()
    model.load_state_dict(plain.state_dict())
    return plain, model, data(torch.Generator().manual_seed(1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(pipe: nn.Module, plain: nn.Module) -> None:
    got, expected = _grads(pipe), _grads(plain)
    assert got.keys() == expected.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=ATOL, msg=name)


def _logits_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The models' own losses in fp64 (GPT-2's shifts the labels)."""
    logits = out.logits
    if logits.ndim == 3:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_literal_line_gives_the_models_own_output_and_gradients(family, fp64):
    plain, model, batch = _built(family)
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    out = pipe(**batch)  # traced and cut here, from this call's first micro-batch
    expected = plain(**batch)
    assert type(out) is type(expected)
    torch.testing.assert_close(out.logits, expected.logits, rtol=RTOL, atol=ATOL)
    # The model's own loss: a mean, the micro-batches' weighted by their rows. GPT-2 computes
    # its LM loss in float32 (it upcasts the logits to float), so there fp32's tolerance.
    fp32 = expected.loss.dtype == torch.float32
    tolerance = {} if fp32 else {"rtol": RTOL, "atol": ATOL}
    torch.testing.assert_close(out.loss, expected.loss, **tolerance)
    _logits_loss(out, batch["labels"]).backward()
    _logits_loss(expected, batch["labels"]).backward()
    _assert_grads_equal(model, plain)
    assert len(pipe.balance) == 2 and pipe.partition.stages[1].params > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_accumulator_trains_from_a_dict_batch_as_the_plain_model_does(family, fp64):
    plain, model, _ = _built(family)
    data = FAMILIES[family][1]
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)  # before the first call
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=2)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        batch = data(g)
        acc.step(batch, batch["labels"], loss_fn=_logits_loss)
        (_logits_loss(plain(**batch), batch["labels"]) / 2).backward()
        if acc.steps % 2 == 0:
            reference.step()
            reference.zero_grad()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=name)


def test_timm_style_vit_equals_the_plain_model(fp64):
    torch.manual_seed(0)
    plain = TimmStyleViT()
    model = TimmStyleViT()
    model.load_state_dict(plain.state_dict())
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    x, y = torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))
    ce = nn.functional.cross_entropy
    pipe.step(x, y, loss_fn=ce)
    ce(plain(x), y).backward()
    _assert_grads_equal(model, plain)
    out = pipe(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, plain(x), rtol=RTOL, atol=ATOL)


def test_drop_path_in_training_is_reproducible_across_runs_and_modes():
    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = TimmStyleViT(drop_path=0.3)
        pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"], schedule="1f1b")
        x, y = torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RetraceWarning)  # train then eval: a cut each, quietly
            loss = pipe.step(x, y, loss_fn=nn.functional.cross_entropy)
            pipe.eval()
            with torch.no_grad():
                pipe(x)
        return loss, _grads(pipe)

    (loss_a, grads_a), (loss_b, grads_b) = run(), run()
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_gpt2_with_its_default_dropout_trains_after_an_eval_first_call():
    torch.manual_seed(0)
    model = _gpt2()  # eval mode first: HF zeroes the attention dropout there
    model.eval()
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    batch = _tokens(torch.Generator().manual_seed(3))
    with torch.no_grad():
        evaluated = pipe(**batch)
    assert "past_key_values" not in evaluated  # traced with use_cache=False
    pipe.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)  # a mode's own cut: routine, no warning
        loss = pipe.step(batch, loss_fn=lambda out: out.loss)
    assert torch.isfinite(loss) and loss.item() > 0
    assert pipe.num_cuts == 2


def test_a_new_argument_structure_is_traced_again_with_a_warning_and_kept(fp64):
    torch.manual_seed(0)
    plain, model, batch = _built("hf-gpt2")
    pipe = Pipeline(model, chunks=2, devices=["cpu", "cpu"])
    pipe(input_ids=batch["input_ids"])
    with pytest.warns(RetraceWarning, match=r"keywords \['input_ids', 'use_cache'\] to"):
        out = pipe(**batch)
    torch.testing.assert_close(out.logits, plain(**batch).logits, rtol=RTOL, atol=ATOL)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)  # both kinds of call are kept
        pipe(input_ids=batch["input_ids"])
        pipe(**batch)
    assert pipe.num_cuts == 2


def test_parameters_are_the_models_own_before_the_first_call():
    model = _bert()
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    own = dict(model.named_parameters())
    assert {n: id(p) for n, p in pipe.named_parameters()} == {n: id(p) for n, p in own.items()}
    with pytest.raises(ConfigError, match="pass example_inputs="):
        pipe.partition  # noqa: B018 - the property raises


def test_a_model_computing_its_own_token_loss_gives_token_weighted_gradients(fp64):
    """The recipe of docs/guide.md: HF sums its loss when given num_items_in_batch=1."""
    plain, model, _ = _built("hf-gpt2")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (BATCH, 12), generator=g)
    labels = ids.clone()
    labels[::2, 5:] = -100  # padding: micro-batches hold different numbers of tokens
    tokens = int((labels[:, 1:] != -100).sum())  # GPT-2 predicts token t + 1 from t
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    batch = {"input_ids": ids, "labels": labels, "num_items_in_batch": 1}
    loss = pipe.step(batch, loss_fn=lambda out: out.loss, num_items=tokens)
    expected = plain(input_ids=ids, labels=labels, num_items_in_batch=tokens).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)  # its fp32 loss
    got, want = _grads(model), _grads(plain)
    for name in want:  # a float32 loss, summed: float32's tolerance
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_gpt2_runs_micro_batches_of_their_own_sequence_lengths(schedule, fp64):
    """Packed-style steps on a traced model: lengths 5, 12 and 9, no padding, token-weighted."""
    plain, model, _ = _built("hf-gpt2")
    g = torch.Generator().manual_seed(5)
    micro = [torch.randint(0, 64, (rows, length), generator=g) for rows, length in
             [(2, 5), (3, 12), (2, 9)]]  # fmt: skip
    tokens = sum(ids[:, 1:].numel() for ids in micro)
    num_stages = 4 if schedule in ("interleaved-1f1b", "zb-v") else 2
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"], schedule=schedule,
                    num_stages=num_stages)  # fmt: skip

    def token_sum(out: Any, ids: torch.Tensor) -> torch.Tensor:  # in fp64, unlike GPT-2's own
        logits = out.logits[:, :-1].flatten(0, 1)
        return nn.functional.cross_entropy(logits, ids[:, 1:].flatten(), reduction="sum")

    loss = pipe.step(
        microbatches=[{"input_ids": ids} for ids in micro],
        targets=micro,
        loss_fn=token_sum,
        num_items=tokens,
    )
    expected = sum(token_sum(plain(input_ids=ids), ids) for ids in micro) / tokens
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    _assert_grads_equal(model, plain)


def test_a_call_the_forward_does_not_take_names_its_signature():
    pipe = Pipeline(TimmStyleViT(), chunks=2, devices=["cpu", "cpu"])
    with pytest.raises(
        TypeError, match=r"TimmStyleViT.forward\(x: .*unexpected keyword argument 'colour'"
    ):
        pipe(torch.randn(4, 3, 16, 16), colour=1)
