"""Where stages seed (whole passes, or only modules seen drawing) never changes a number.

INVARIANT 25, regime by regime: a fresh pipeline (seeding throughout), one that
has learned where its stages draw (hooks and tripwires), evaluation calls in
between, the model's own ``torch.utils.checkpoint``, a module's own pre-hook
that draws, and another thread's draw racing a seeded one.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from pipesched import ConfigError, Pipeline
from pipesched.runtime.stage.draw_keys import StepSeed
from pipesched.runtime.stage.seeding import StageSeeding, UnseededDraws
from tests.runtime.stage.random_kinds import model_of

pytestmark = pytest.mark.usefixtures("fp64")

ROWS, CHUNKS = 10, 4


def _pipe(model, balance=(2, 3), **kwargs):
    return Pipeline(model, CHUNKS, balance=list(balance), devices=["cpu"] * 2, **kwargs)


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 8, generator=g)


def _generator_moves(call) -> bool:
    before = torch.default_generator.get_state()
    call()
    return not torch.equal(before, torch.default_generator.get_state())


def _evaluate(pipe, x):
    pipe.eval()
    with torch.no_grad():
        pipe(x)
    pipe.train()


def _zero_dropout():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.Unflatten(1, (2, 4)), nn.Linear(4, 8), layer, nn.Linear(8, 4), nn.Flatten()
    )


class _FunctionalZeroDropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.0, self.training)  # a layer of one's own: seeded


def _zero_functional():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), _FunctionalZeroDropout(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)
    )


@pytest.mark.parametrize("model", [_zero_dropout, _zero_functional])
def test_a_model_that_draws_nothing_never_moves_the_generator(model):
    # torch's layers at p = 0 are never seeded. A layer of one's own is: its first step
    # seeded throughout, its next ones not; a seed drawn for an operation that drew
    # nothing (dropout p = 0) is given back, so neither moves it.
    pipe = _pipe(model())
    x, y = _data(1)
    for _ in range(3):
        assert not _generator_moves(lambda: pipe.step(x, y, loss_fn=F.mse_loss))
        assert not _generator_moves(lambda: _evaluate(pipe, x))


def _switch_dropout_on(model, p):
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
        elif isinstance(module, nn.MultiheadAttention):
            module.dropout = p


def test_a_dropout_switched_on_between_steps_is_seeded_from_the_next_step():
    # A stage of torch's layers at p = 0 is never seeded; switched on between steps, its
    # next step draws exactly what a pipeline built with that dropout draws in its first.
    x, y = _data(1)
    model = _zero_dropout()
    switched = _pipe(model)
    switched.step(x, y, loss_fn=F.mse_loss)
    _switch_dropout_on(model, 0.3)
    fresh = _pipe(copy.deepcopy(model))
    results = []
    for pipe in (switched, fresh):
        pipe.zero_grad()
        torch.manual_seed(5)
        loss = pipe.step(x, y, loss_fn=F.mse_loss)
        results.append((loss, [p.grad.clone() for p in pipe.parameters()]))
    (loss, grads), (expected, expected_grads) = results
    assert loss == expected
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    _switch_dropout_on(model, 0.0)  # and back: the masks are gone
    torch.manual_seed(5)
    assert switched.step(x, y, loss_fn=F.mse_loss) != loss


def test_a_drawing_model_takes_one_seed_per_training_step_and_none_to_evaluate():
    pipe = _pipe(model_of("TransformerEncoderLayer"))
    x, y = _data(1)
    for _ in range(3):  # the first step learns; the others seed only where draws were seen
        before = torch.default_generator.get_state()
        pipe.step(x, y, loss_fn=F.mse_loss)
        after = torch.default_generator.get_state()
        torch.default_generator.set_state(before)
        torch.randint(0, 2**62, ())  # one seed
        assert torch.equal(after, torch.default_generator.get_state())
        assert not _generator_moves(lambda: _evaluate(pipe, x))


def test_a_pipeline_resumed_mid_run_continues_as_the_uninterrupted_one():
    # A resumed job builds a fresh pipeline (seeding throughout) where the running one
    # had learned where its stages draw: the same weights and generator state must give
    # the same numbers, evaluation calls in between included.
    torch.manual_seed(0)
    model = model_of("TransformerEncoderLayer")
    resumed_model = copy.deepcopy(model)

    def train(pipe, steps, seed):
        x, y = _data(seed)
        losses = []
        for _ in range(steps):
            losses.append(pipe.step(x, y, loss_fn=F.mse_loss))
            _evaluate(pipe, x)
            with torch.no_grad():
                for p in pipe.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        return losses

    running = _pipe(model)
    torch.manual_seed(5)
    train(running, 2, 1)
    state, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    continued = train(running, 2, 2)
    resumed_model.load_state_dict(state)
    torch.set_rng_state(rng)
    resumed = train(_pipe(resumed_model), 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(continued, resumed, strict=True))


class Block(nn.Module):
    """A layer that checkpoints itself, as Hugging Face models and timm do when asked."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.linear = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def body(self, x):
        h = self.drop(torch.tanh(self.linear(x)))
        return F.dropout(h, 0.3, self.training) + torch.rand_like(h) * 0.1  # drawn in the layer

    def forward(self, x):
        if self.reentrant is None:
            return self.body(x)
        return torch_checkpoint(self.body, x, use_reentrant=self.reentrant)


def _checkpointing_model(reentrant):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Block(reentrant), nn.Linear(8, 8), Block(reentrant))


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_the_models_own_checkpointing_recomputes_the_forwards_masks(checkpoint, schedule):
    # Without the model's checkpoint, autograd keeps the forward's own masks: the
    # reference. Three steps; torch's checkpoint saves and restores the shared
    # generator from both stage threads at once, which must change nothing either.
    def steps(model):
        # fuse_weight_grads=False: a fused addmm_ into .grad rounds unlike mm-then-add,
        # and the model's checkpoint region runs the plain linear.
        pipe = _pipe(
            model, balance=(2, 2), schedule=schedule, checkpoint=checkpoint, fuse_weight_grads=False
        )
        torch.manual_seed(3)
        losses = [pipe.step(*_data(k), loss_fn=F.mse_loss) for k in range(3)]
        return losses, [p.grad.clone() for p in pipe.parameters()]

    want = steps(_checkpointing_model(None))
    for _ in range(3):  # timing-dependent before the fix: repeat
        got = steps(_checkpointing_model(False))
        for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
            assert torch.equal(a, b)


def test_pipe_x_refuses_a_backward_that_would_recompute_other_masks():
    # pipe(x) leaves the backward to the caller, outside pipesched's seeding: a model
    # that checkpoints itself around random operations would get wrong gradients.
    pipe = _pipe(_checkpointing_model(False), balance=(2, 2))
    x, y = _data(1)
    pipe.step(x, y, loss_fn=F.mse_loss)  # fine: pipesched runs this backward
    with pytest.raises(ConfigError, match="checkpoints itself"):
        pipe(x)
    with torch.no_grad():
        pipe(x)  # evaluation needs no backward


def test_a_modules_own_pre_hook_that_draws_is_seeded_without_reruns():
    torch.manual_seed(0)
    noisy = nn.Linear(8, 8)
    noisy.register_forward_pre_hook(lambda m, args: (args[0] + torch.randn_like(args[0]),))
    pipe = _pipe(nn.Sequential(noisy, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()))
    x, y = _data(1)
    for _ in range(4):
        pipe.step(x, y, loss_fn=F.mse_loss)
    assert [s.strikes for s in pipe.engine.seedings] == [0, 0, 0]
    assert pipe.engine.seedings[0].hooked and not pipe.engine.seedings[0].full[True]


class Maybe(nn.Module):
    draw = False

    def forward(self, x):
        return x + torch.rand_like(x) if self.draw else x


def test_an_unseeded_draw_racing_a_seeded_one_is_seen_and_changes_no_mask():
    # Stage A draws seeded masks in a loop; stage B's tripwire watches while B draws
    # unseeded. Seeded draws use a private generator: B's draw always shows, A's masks
    # never move.
    a, b = nn.Dropout(0.5), Maybe()
    stage_a = StageSeeding({id(a): "a"}, a, torch.device("cpu"), adaptive=False)
    stage_b = StageSeeding({id(b): "b"}, b, torch.device("cpu"), adaptive=True)
    seed = StepSeed(42)
    with stage_b.forward(seed, 0):  # learns: B draws nothing
        b(torch.zeros(1))
    stage_b.settle()
    assert stage_b.watching
    b.draw, stage_b.strikes = True, -(10**9)  # stays watching for the experiment
    big = torch.ones(100_000)
    with stage_a.forward(seed, 0):
        reference = a(big)
    stop, wrong, runs = threading.Event(), [], [0]

    def seeded_loop():
        while not stop.is_set():
            with stage_a.forward(seed, 0):
                wrong.append(not torch.equal(a(big), reference))
            runs[0] += 1

    thread = threading.Thread(target=seeded_loop)
    thread.start()
    hidden = 0
    try:
        for _ in range(3000):
            try:
                with stage_b.forward(seed, 0):
                    b(torch.zeros(8))
                hidden += 1
            except UnseededDraws:
                pass
    finally:
        stop.set()
        thread.join()
    assert hidden == 0
    assert runs[0] > 0 and not any(wrong)


class _Embed(nn.Module):
    def __init__(self, gpt2: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt2.wte, gpt2.wpe, gpt2.drop

    def forward(self, ids):
        return self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))


class _Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _gpt2_layers(checkpointing: bool) -> nn.Sequential:
    """Hugging Face GPT-2 blocks with dropout, run eagerly, checkpointing themselves or not."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16)
    gpt2 = GPT2Model(config)  # dropout 0.1 throughout (resid, embd, attn)
    if checkpointing:
        enable = getattr(gpt2, "activation_checkpointing_enable", None)  # transformers 5 name
        (enable or gpt2.gradient_checkpointing_enable)({"use_reentrant": False})
    gpt2.train()
    return nn.Sequential(_Embed(gpt2), *map(_Block, gpt2.h), gpt2.ln_f)


def test_hugging_face_layers_that_checkpoint_themselves_train_as_without():
    pytest.importorskip("transformers")

    def steps(checkpointing):
        pipe = Pipeline(
            _gpt2_layers(checkpointing),
            4,
            balance=[2, 2],
            devices=["cpu"] * 2,
            fuse_weight_grads=False,
        )
        torch.manual_seed(1)
        ids, target = torch.randint(0, 100, (8, 6)), torch.randn(8, 6, 32)
        losses = [pipe.step(ids, target, loss_fn=F.mse_loss) for _ in range(3)]
        return losses + [p.grad for p in pipe.parameters()]

    for a, b in zip(steps(True), steps(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_hook_that_draws_added_to_a_plain_stage_is_seeded_from_then_on(schedule):
    """A stage of plain layers skips seeding only while nothing in it can draw."""

    def run(checkpoint: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        pipe = Pipeline(
            model, 4, balance=[2, 1], devices=["cpu", "cpu"], schedule=schedule,
            checkpoint=checkpoint,
        )  # fmt: skip
        x = torch.randn(8, 4, dtype=torch.float64)
        pipe.step(x, loss_fn=lambda y: y.square().mean())  # plain: nothing seeded
        model[0].register_forward_hook(lambda m, i, o: o * torch.bernoulli(torch.full_like(o, 0.5)))
        pipe.zero_grad()
        torch.manual_seed(1)
        pipe.step(x, loss_fn=lambda y: y.square().mean())
        return [p.grad.clone() for p in pipe.parameters()]

    never, always = run("never"), run("always")
    # Recomputation redraws the hook's mask: equal only if the hook's draws are seeded.
    assert all(torch.equal(a, b) for a, b in zip(never, always, strict=True))


@pytest.mark.parametrize(("scenario", "world"), [("late", 2), ("late-dp", 4)])
def test_a_mesh_learns_where_stages_draw_and_every_rank_reruns_a_spoiled_step(
    scenario, world, tmp_path
):
    """INVARIANT 25 on a mesh: draws where none were learned rerun the step on every rank.

    Stage 1 (pp rank 1) starts drawing at step 2 and the loss at step 3, after
    the mesh learned where its stages draw: only pp rank 1's tripwires see it,
    yet pp rank 0 (and, where a step sums gradients over replicas, the replica
    that drew nothing) must put the step back and rerun it too, or transfers
    and all-reduces would no longer match.
    """
    from tests.distributed import seeding_worker as w
    from tests.distributed.launch import launch

    exits = launch(scenario, world, tmp_path, timeout=150, worker=Path(w.__file__))
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, result in enumerate(ranks):
        learned = result["learning"]
        assert learned["reruns"] == 2, r  # steps 2 and 3, on every rank
        assert learned["watching"][r % 2], r  # its own stage: hooks and a tripwire
    if scenario == "late":  # against one process running both stages in two threads
        net = w.model()
        pipe = Pipeline(net, w.CHUNKS, balance=w.BALANCE, devices=["cpu"] * 2, schedule="1f1b")
        losses = w.train(pipe, net[4], 0, {0})
        assert pipe.engine.reruns == 2
        params = dict(pipe.named_parameters())
        for result in ranks:
            assert result["learning"]["losses"] == losses
            for name, value in result["learning"]["params"].items():
                assert torch.equal(value, params[name]), name
    else:  # against the same mesh seeded throughout (no tripwire, no rerun)
        for result in ranks:
            learned, throughout = result["learning"], result["throughout"]
            assert throughout["reruns"] == 0
            assert learned["losses"] == throughout["losses"]
            for name, value in learned["params"].items():
                assert torch.equal(value, throughout["params"][name]), name
        for r in (0, 1):  # the replicas stay equal
            for name, value in ranks[r]["learning"]["params"].items():
                assert torch.equal(value, ranks[r + 2]["learning"]["params"][name]), name


def test_a_mesh_step_whose_rerun_trips_again_fails_and_leaves_the_window_as_before(tmp_path):
    """The rerun draws unseeded again (a backward drawing on another thread, after a forward):
    UnseededDraws on every rank, and the gradient sums that step started over the replicas
    are dropped: flush() ends the window exactly as if the step had not been taken."""
    from tests.distributed import seeding_worker as w
    from tests.distributed.launch import launch

    exits = launch("failed-rerun", 4, tmp_path, timeout=150, worker=Path(w.__file__))
    for e in exits:
        assert e.code == 0, f"rank {e.rank} exited {e.code}:\n{e.output[-3000:]}"
    for r in range(4):
        result = torch.load(tmp_path / f"rank{r}.pt")
        failed, skipped = result["failed"], result["skipped"]
        assert failed["raised"] == "UnseededDraws", r
        for name, value in failed["params"].items():
            assert torch.equal(value, skipped["params"][name]), (r, name)
