"""When one trace fits a call, and models that test it: modes, sizes, no_grad regions, BatchNorm.

Each test began as a reproduction of a bug found by trying models the other
tests do not (Llama/Qwen2 rotary embeddings, size branches, a sequence of one
token, a training-mode branch, a top-level BatchNorm, CLIP's batch-coupled
logits, HF's num_items_in_batch in a call); each now checks the fix against
the plain model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import ConfigError, RetraceWarning

RTOL, ATOL = 1e-10, 1e-12
CPUS = ["cpu", "cpu"]


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


# --- silently wrong numbers -------------------------------------------------------------


class TopLevelBatchNorm(nn.Module):
    """BatchNorm layers as direct children of the model (not nested in a submodule)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).relu().mean((2, 3)))


def test_deferred_batch_norm_commits_a_top_level_batch_norm_of_a_traced_model(fp64):
    # DeferredBatchNorm.convert(model) (build_stages, after tracing) replaces model.bn,
    # but the Pipeline registered the old BatchNorm2d as pipe.bn at construction
    # (register_model): commit_all(pipe) never reaches the new layer, so running stats never
    # change, pipe.state_dict() reads the old layer, and eval outputs are the untrained ones.
    torch.manual_seed(0)
    plain = TopLevelBatchNorm()
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS, deferred_batch_norm=True)
    x = torch.randn(8, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe(x)
    plain(x)
    assert int(pipe.state_dict()["bn.num_batches_tracked"]) == 1  # observed: 0
    # The first BatchNorm sees the plain model's input: the whole batch's statistics.
    _close(pipe.state_dict()["bn.running_mean"], plain.bn.running_mean)
    _close(pipe.state_dict()["bn.running_var"], plain.bn.running_var)


def test_num_items_in_batch_in_a_call_gives_the_plain_models_loss():
    # model(..., labels=, num_items_in_batch=n).loss is sum / n; each micro-batch returns its
    # own sum / n and join_outputs takes their rows-weighted *mean*: the pipeline's loss (and
    # the gradients of out.loss.backward()) are the plain model's divided by the chunk count.
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    plain = transformers.GPT2LMHeadModel(config).double()
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS)
    ids = torch.randint(0, 64, (4, 8))
    n = 4 * 7
    expected = plain(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    got = pipe(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    # HF computes its loss in float32: compare at float32's precision (observed: got = expected / 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class ScaleInTraining(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if self.training else x


class ModeBranch(nn.Module):
    """A module whose code depends on self.training with no dropout (timm's distilled heads,
    torchvision's aux logits, noise/jitter layers written by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.scale, self.b = nn.Linear(4, 4), ScaleInTraining(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.scale(self.a(x)))


def test_a_training_mode_branch_without_dropout_follows_the_mode(fp64):
    # The trace fixes `if self.training:`; a mode change is only detected for dropout
    # (p=0 in eval) and BatchNorm (partition/split._copy ModeCheck, Assembly.fits), so eval
    # after a training trace silently runs the training branch.
    torch.manual_seed(0)
    plain = ModeBranch()
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS)
    x = torch.randn(4, 4)
    _close(pipe(x), plain(x))
    pipe.eval()
    plain.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RetraceWarning)
        _close(pipe(x), plain(x))  # observed: the training-mode output (max diff ~0.14)


class LengthBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h * 2 if x.shape[1] > 4 else h * 3  # a Python branch on a (dynamic) size
        return self.b(h)


def test_a_branch_on_a_size_is_not_reused_for_sizes_that_take_the_other_branch(fp64):
    # torch.export records the branch as a guard (s1 > 4) in an _assert_scalar node, which
    # partition/trace.py drops (_DROPPED), and call_key ignores sizes: a later call with
    # length 3 runs the length-8 branch with no error.
    torch.manual_seed(0)
    plain = LengthBranch()
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS)
    x8, x3 = torch.randn(4, 8, 4), torch.randn(4, 3, 4)
    _close(pipe(x8), plain(x8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RetraceWarning)
        _close(pipe(x3), plain(x3))  # observed: max diff ~0.9


class PositionSlice(nn.Module):
    """Learned positions sliced to the input's length (GPT-2, ViT, timm all do this)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 16, 4))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + self.pos[:, : x.shape[1]]))


def test_a_first_call_with_a_dimension_of_one_does_not_fix_that_dimension(fp64):
    # trace_model doubles a batch of one row, but any other dim of size 1 in the first call
    # (a sequence of one token) is specialized to 1 by torch.export (Dim.AUTO). call_key
    # ignores sizes, so a later length-5 call reuses the trace: pos[:, :1] broadcasts over
    # all 5 positions, silently.
    torch.manual_seed(0)
    plain = PositionSlice()
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS)
    x1, x5 = torch.randn(4, 1, 4), torch.randn(4, 5, 4)
    _close(pipe(x1), plain(x1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RetraceWarning)
        _close(pipe(x5), plain(x5))  # observed: max diff ~0.8


# --- crashes ------------------------------------------------------------------------------


def test_variable_micro_batches_whose_first_has_one_token(fp64):
    # Same cause as above, through pipe.step(microbatches=...): the first micro-batch
    # (2 rows of 1 token) is traced with length 1; the next (3 x 9) fails with a raw
    # RuntimeError ("shape '[3, 1, 96]' is invalid for input of size 2592").
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    plain = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS, schedule="1f1b")
    xs = [torch.randint(0, 64, shape) for shape in ((2, 1), (3, 9))]

    def token_sum(out: object, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits  # type: ignore[attr-defined]
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    n = sum(x.numel() for x in xs)
    # Export traces a sequence length of 2 or more (0 and 1 are specialized), and HF's mask code
    # may branch on a length of 1: one step cannot run both on one trace. Named, not silent:
    with pytest.raises(ConfigError, match="dimension 1 of input input_ids is 1"):
        pipe.step(microbatches=xs, targets=xs, loss_fn=token_sum, num_items=n)
    assert all(p.grad is None for p in model.parameters())
    # Steps of one side each run, each on its own trace, and add up to the plain model's.
    loss = sum(pipe.step(microbatches=[x], targets=[x], loss_fn=token_sum, num_items=n) for x in xs)
    expected = sum(token_sum(plain(input_ids=x), x) for x in xs) / n
    expected.backward()
    _close(loss, expected.detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_rotary_models_trace_and_equal_the_plain_model(family, fp64):
    # HF's rotary embedding runs under @torch.no_grad(): torch.export makes it a
    # wrap_with_set_grad_enabled higher-order op over a get_attr submodule. TracedModel.ops
    # keeps only call_function nodes, so profiling (partition/profile._arguments) fails with
    # KeyError: submod_3. Llama, Mistral and Qwen2 all fail on their first call.
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    plain = getattr(transformers, f"{family}ForCausalLM")(config)
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS)
    ids = torch.randint(0, 64, (4, 8))
    out = pipe(input_ids=ids)  # observed: KeyError: submod_3
    expected = plain(input_ids=ids)
    _close(out.logits, expected.logits)
    out.logits.square().mean().backward()
    expected.logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_a_contrastive_loss_is_computed_from_the_gathered_embeddings():
    """CLIP's logits_per_image couple the batch's rows: per micro-batch they are (rows_i,
    rows_i), which no cut can fix (docs/guide.md, "What micro-batching changes"). The
    documented recipe: take the per-row embeddings from pipe(...) and compute the batch's
    contrastive loss from them; autograd-transparent, it equals the plain model's."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config={
            "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 16,
        },
        vision_config={
            "image_size": 8, "patch_size": 4, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32,
        },
        projection_dim=8,
    )  # fmt: skip
    plain = transformers.CLIPModel(config).eval()
    model = copy.deepcopy(plain)
    pipe = Pipeline(model, chunks=2, devices=CPUS)
    call = {"input_ids": torch.randint(0, 64, (4, 7)), "pixel_values": torch.randn(4, 3, 8, 8)}

    def clip_loss(out: object, scale: torch.Tensor) -> torch.Tensor:
        logits = scale.exp() * out.image_embeds @ out.text_embeds.T  # type: ignore[attr-defined]
        labels = torch.arange(len(logits))
        ce = nn.functional.cross_entropy
        return (ce(logits, labels) + ce(logits.T, labels)) / 2

    expected = plain(**call, return_loss=True)
    got = pipe(**call)
    loss = clip_loss(got, model.logit_scale)
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
