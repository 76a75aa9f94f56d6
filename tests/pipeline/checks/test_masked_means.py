"""A loss's mean over the targets it keeps (padding skipped) weighs micro-batches by them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched import BatchCoupledWarning, Pipeline
from pipesched.pipeline.checks.masked_means import proportional

pytestmark = pytest.mark.usefixtures("fp64")

VOCAB = 11


class TokenLM(nn.Module):
    """Predicts token t + 1 from t and computes its loss inside, as a causal LM does."""

    def __init__(self, loss: str = "cross_entropy") -> None:
        super().__init__()
        self.loss = loss
        self.embed = nn.Embedding(VOCAB, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, VOCAB)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, VOCAB))
        self.weight_parameter = nn.Parameter(torch.linspace(2.0, 0.5, VOCAB), requires_grad=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(self.embed(ids)))
        scores, targets = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
        if self.loss == "weighted":
            loss = F.cross_entropy(scores, targets, weight=self.class_weight)
        elif self.loss == "smoothed":
            loss = F.cross_entropy(scores, targets, label_smoothing=0.1, ignore_index=0)
        elif self.loss == "two heads":  # the same kept targets twice: their counts agree
            loss = F.cross_entropy(scores, targets) + F.cross_entropy(scores * 0.5, targets)
        elif self.loss == "plus a mean":  # a term over the rows beside one over kept targets
            loss = F.cross_entropy(scores, targets) + 0.01 * logits.pow(2).mean()
        elif self.loss == "parameter weights":
            loss = F.cross_entropy(scores, targets, weight=self.weight_parameter)
        elif self.loss == "moved":  # as Hugging Face's loss moves its labels to the logits'
            loss = F.cross_entropy(scores, targets.to(scores.device))
        elif self.loss == "by hand":  # a sum divided by the count of kept targets
            kept = targets != -100
            each = F.cross_entropy(scores, targets, reduction="none")
            loss = (each * kept).sum() / kept.sum()
        elif self.loss == "pseudo-labels":  # the padding kept, the rest the model's own guess
            guess = scores.detach().argmax(-1)
            loss = F.cross_entropy(scores, torch.where(targets == -100, -100, guess))
        elif self.loss == "teacher":  # a teacher's argmax: every target kept
            loss = F.cross_entropy(scores, (scores * 2).detach().argmax(-1).view(-1))
        elif self.loss == "nll":
            loss = F.nll_loss(F.log_softmax(scores, -1), targets) * 2.0 + 1.0
        else:
            loss = F.cross_entropy(scores, targets)
        return {"loss": loss, "logits": logits}


def _batch(padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (8, 6), generator=generator)
    labels = ids.clone()
    if padded:  # micro-batches of 2 rows keep 4, 10, 0 and 7 of their 10 targets
        labels[0, 2:] = labels[1, 4:] = -100
        labels[4:6, 1:] = -100
        labels[6, 3:] = -100
    labels[labels == 0] = -100 if padded else 1  # (ignore_index=0 of the smoothed loss)
    return ids, labels


def _told(call):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in seen if issubclass(w.category, BatchCoupledWarning)]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "loss",
    [
        "cross_entropy",
        "weighted",
        "smoothed",
        "nll",
        "two heads",
        "parameter weights",
        "moved",
        "by hand",
        "teacher",
    ],
)
def test_pipe_x_returns_the_plain_models_mean_over_the_targets_padding_leaves(loss):
    torch.manual_seed(0)
    model = TokenLM(loss)
    plain = copy.deepcopy(model)
    ids, labels = _batch()
    if loss == "smoothed":
        labels[labels == -100] = 0
    expected = plain(ids, labels)["loss"]
    expected.backward()
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    out, told = _told(lambda: pipe(ids, labels))
    assert told == []
    # The micro-batch of fully padded rows has a 0/0 mean: it weighs nothing, as in the plain model.
    torch.testing.assert_close(out["loss"], expected, rtol=1e-12, atol=0)
    out["loss"].backward()
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss", ["cross_entropy", "by hand"])
def test_a_step_whose_micro_batches_keep_unequal_shares_of_targets_is_told_once(loss):
    """Before, silent; a mean written by hand was told as mixing rows, padding or not."""
    torch.manual_seed(0)
    model = TokenLM(loss)
    ids, labels = _batch()
    even_ids, even_labels = _batch(padded=False)
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    plain = copy.deepcopy(model)

    loss, told = _told(lambda: pipe.step((even_ids, even_labels), loss_fn=lambda o: o["loss"]))
    assert told == []  # no padding: rows weigh the targets right
    torch.testing.assert_close(loss, plain(even_ids, even_labels)["loss"], rtol=1e-12, atol=0)

    rows = [0, 1, 2, 3, 6, 7]  # (none fully padded: a 0/0 loss is a skipped window)
    _, (message,) = _told(lambda: pipe.step((ids[rows], labels[rows]), loss_fn=lambda o: o["loss"]))
    assert "output['loss']" in message and "keep [4, 10, 2, 5]" in message
    assert "for [2, 2, 1, 1] rows" in message and "num_items" in message
    _, again = _told(lambda: pipe.step((ids, labels), loss_fn=lambda o: o["loss"]))
    assert again == []  # once per Pipeline


def test_the_fix_the_warning_names_trains_the_plain_model_and_is_not_told():
    torch.manual_seed(0)
    model = TokenLM()
    plain = copy.deepcopy(model)
    ids, labels = _batch()
    plain(ids, labels)["loss"].backward()

    def token_sum(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        scores = out["logits"][:, :-1].flatten(0, 1)
        return F.cross_entropy(scores, target[:, 1:].flatten(), reduction="sum")

    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    kept = int((labels[:, 1:] != -100).sum())
    _, told = _told(lambda: pipe.step((ids, labels), labels, loss_fn=token_sum, num_items=kept))
    assert told == []
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-10, atol=1e-14)


class TwoLosses(TokenLM):
    """Two means over different kept targets, added: no one count weighs both."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(self.embed(ids)))
        scores = logits[:, :-1].flatten(0, 1)
        ahead = F.cross_entropy(scores, labels[:, 1:].flatten())
        here = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": ahead + here}


def test_means_over_different_kept_targets_added_are_told_as_not_rebuilt():
    torch.manual_seed(0)
    pipe = Pipeline(TwoLosses(), chunks=4, devices=["cpu"] * 2)
    out, (message,) = _told(lambda: pipe(*_batch()))
    assert isinstance(out["loss"], list) and "output['loss'] adds means over targets" in message


def test_a_gpt2_loss_over_padded_labels_is_the_plain_models():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    plain = copy.deepcopy(model)
    ids = torch.randint(1, 50, (6, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 3:] = labels[1, 2:] = labels[4, 6:] = -100
    call = {"input_ids": ids, "labels": labels, "use_cache": False}
    expected = plain(**call).loss
    expected.backward()
    pipe = Pipeline(model, chunks=3, devices=["cpu"] * 2)
    out, told = _told(lambda: pipe(**call))
    assert told == []
    # GPT-2 computes its loss in float32 whatever the model's dtype.
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
    out.loss.backward()
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-8)


def test_a_rank_without_the_losss_class_weights_counts_nothing_and_tells_nothing():
    from pipesched.pipeline.checks.coupled_outputs import masked_weights, warn_uneven_targets

    torch.manual_seed(0)
    model = TokenLM("weighted")
    pipe = Pipeline(model, chunks=2, devices=["cpu"] * 2)
    ids, labels = _batch()
    pipe(ids, labels)
    traced = pipe.stages[-1].traced
    micro = [(ids[:4], labels[:4]), (ids[4:], labels[4:])]
    ((weights, kept, uncounted),) = masked_weights(traced, micro, [4, 4]).values()
    assert weights == kept and not proportional(kept, [4, 4]) and not uncounted
    model.class_weight = model.class_weight.to("meta")  # as a meta build on another rank holds it
    ((weights, kept, _),) = masked_weights(traced, micro, [4, 4]).values()
    assert weights == [4.0, 4.0] and all(c != c for c in kept)  # NaN: not known here: rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_uneven_targets(pipe, traced, micro, [4, 4])


def test_a_mean_over_kept_targets_plus_one_over_rows_is_rebuilt_only_where_they_agree():
    torch.manual_seed(0)
    model = TokenLM("plus a mean")
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2)
    ids, labels = _batch(padded=False)
    out, told = _told(lambda: pipe(ids, labels))  # no padding: both weigh by rows
    assert told == []
    torch.testing.assert_close(out["loss"], model(ids, labels)["loss"], rtol=1e-12, atol=0)
    ids, labels = _batch()  # padding: no weighing of the micro-batches' sums rebuilds it
    out, (message,) = _told(lambda: pipe(ids, labels))
    assert isinstance(out["loss"], list)
    assert "output['loss'] adds means over targets its micro-batches keep in different" in message
    _, (message,) = _told(lambda: pipe.step((ids, labels), loss_fn=lambda o: o["loss"]))
    assert "other shares" in message


def test_a_model_built_on_meta_counts_its_targets_where_its_inputs_are():
    """Before, its loss's `.to(logits.device)` (traced on meta) made the count a meta tensor."""
    torch.manual_seed(0)
    ids, labels = _batch()
    with torch.device("meta"):
        model = TokenLM("moved")
    pipe = Pipeline(model, chunks=4, devices=["cpu"] * 2, example_inputs=(ids[:2], labels[:2]))
    out, told = _told(lambda: pipe(ids, labels))
    assert told == []
    torch.testing.assert_close(out["loss"], model(ids, labels)["loss"], rtol=1e-12, atol=0)
    rows = [0, 1, 2, 3, 6, 7]
    _, (message,) = _told(lambda: pipe.step((ids[rows], labels[rows]), loss_fn=lambda o: o["loss"]))
    assert "keep [4, 10, 2, 5]" in message


def test_targets_the_model_computes_from_its_parameters_are_weighed_by_rows_and_told():
    """Before, silent: pipe(x) and the step took such a mean over the rows, padding or not."""
    torch.manual_seed(0)
    model = TokenLM("pseudo-labels")
    plain = copy.deepcopy(model)
    ids, labels = _batch()
    rows = [0, 1, 2, 3, 6, 7]  # micro-batches keeping 4, 10 and 7 of their 10 targets
    ids, labels = ids[rows], labels[rows]
    pipe = Pipeline(model, chunks=3, devices=["cpu"] * 2)
    out, (message,) = _told(lambda: pipe(ids, labels))
    assert message.startswith("pipe(x): output['loss']") and "pseudo-labels" in message
    assert "of [2, 2, 2] rows are weighed by their rows" in message
    by_rows = torch.stack([plain(ids[k : k + 2], labels[k : k + 2])["loss"] for k in (0, 2, 4)])
    torch.testing.assert_close(out["loss"], by_rows.mean(), rtol=1e-12, atol=0)
    assert not torch.isclose(out["loss"], plain(ids, labels)["loss"])  # what it tells of
    _, again = _told(lambda: pipe(ids, labels))
    assert again == []  # once
    _, (message,) = _told(lambda: pipe.step((ids, labels), loss_fn=lambda o: o["loss"]))
    assert message.startswith("the step: output['loss']") and "num_items=" in message
