"""``Pipeline(schedule="auto")``: the planner's pick is built, and trains exactly like the model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import ConfigError
from pipesched.planning import plan_model


def lm_like(width: int = 16, vocab: int = 256, blocks: int = 4) -> nn.Sequential:
    """Blocks, then a head much heavier than one of them."""
    torch.manual_seed(0)
    body = [
        nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
        for _ in range(blocks)
    ]
    return nn.Sequential(nn.Linear(8, width), *body, nn.Linear(width, vocab)).double()


class Branchy(nn.Module):
    """Not an nn.Sequential: traced. A skip connection crosses any cut."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = skip = self.inp(x)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.out(h + skip)


def _gradients_equal(pipe: Pipeline, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = pipe.step(x, y, loss_fn=nn.functional.cross_entropy)
    expected = nn.functional.cross_entropy(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)


@pytest.mark.parametrize(
    "make", [lm_like, lambda: Branchy().double()], ids=["sequential", "traced"]
)
def test_the_pick_is_built_and_its_gradients_are_the_models(make) -> None:
    model = make()
    reference = copy.deepcopy(model)
    x = torch.randn(24, 8, dtype=torch.float64)
    y = torch.randint(0, 64, (24,))
    pipe = Pipeline(model, 6, schedule="auto", devices=["cpu", "cpu"], example_inputs=(x[:4],))
    plan = pipe.plan.report
    assert plan is not None and plan.pick.fits
    assert pipe.checkpoint == plan.pick.checkpoint
    assert tuple(pipe.balance) == plan.pick.counts
    assert pipe.schedule_name == plan.pick.schedule
    assert len(pipe.devices) == 2
    _gradients_equal(pipe, reference, x, y)


def test_a_budget_a_balance_and_a_checkpoint_mode_given_are_kept() -> None:
    x = torch.randn(16, 8, dtype=torch.float64)
    free = plan_model(lm_like(), (x[:2],), 2, 8, num_threads=1)
    budget = sorted(c.peak_bytes for c in free.candidates)[len(free.candidates) // 3]
    pipe = Pipeline(
        lm_like(),
        8,
        schedule="auto",
        devices=["cpu"] * 2,
        example_inputs=(x[:2],),
        memory_budget=budget,
    )
    assert pipe.plan.report is not None and pipe.plan.report.pick.peak_bytes <= budget
    assert pipe.plan.report.memory_budget == budget
    fixed = Pipeline(
        lm_like(),
        8,
        schedule="auto",
        devices=["cpu"] * 2,
        example_inputs=(x[:2],),
        balance=[4, 2],
        checkpoint="always",
    )
    assert (
        fixed.plan.report is not None and fixed.balance == [4, 2] and fixed.checkpoint == "always"
    )
    assert {c.checkpoint for c in fixed.plan.report.candidates} == {"always"}
    assert {c.counts for c in fixed.plan.report.candidates} == {(4, 2)}


def test_without_auto_the_checkpoint_default_is_except_last() -> None:
    pipe = Pipeline(lm_like(), 4, devices=["cpu"] * 2)
    assert pipe.checkpoint == "except_last" and pipe.plan.report is None


def test_auto_needs_an_example_and_a_searchable_balance() -> None:
    with pytest.raises(ConfigError, match=r"schedule='auto' measures .* example_inputs=\(x,\)"):
        Pipeline(lm_like(), 4, schedule="auto", devices=["cpu"] * 2)
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"balance='params' does not apply"):
        Pipeline(
            lm_like(),
            4,
            schedule="auto",
            devices=["cpu"] * 2,
            example_inputs=(x,),
            balance="params",
        )
    with pytest.raises(ConfigError, match=r"no plan fits memory_budget"):
        Pipeline(
            lm_like(),
            4,
            schedule="auto",
            devices=["cpu"] * 2,
            example_inputs=(x,),
            memory_budget=100.0,
        )


def test_planning_times_each_layer_in_the_runtime_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Linear(16, 4)
    ).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 8, dtype=torch.float64)
    rng = torch.get_rng_state()
    pipe = Pipeline(model, 4, schedule="auto", devices=["cpu"] * 2, example_inputs=(x[:2],))
    assert pipe.plan.report is not None
    assert "measured per layer in pipesched's runtime" in pipe.plan.report.source
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():  # BatchNorm statistics untouched
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)


def test_a_model_that_cannot_run_per_layer_falls_back_to_the_profile_and_says_so(monkeypatch):
    import pipesched.planning.measure as measure

    def fails(*args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(measure, "run_layer_times", fails)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="per-operation profile"):
        pipe = Pipeline(lm_like(), 2, schedule="auto", devices=["cpu"] * 2, example_inputs=(x,))
    assert pipe.plan.report is not None
    assert "a run per layer failed: RuntimeError" in pipe.plan.report.source


def test_a_budget_that_is_not_positive_is_refused_before_anything_runs() -> None:
    x = torch.randn(2, 8, dtype=torch.float64)
    for budget in (0, -1.0):
        with pytest.raises(ConfigError, match=r"memory_budget must be a positive number"):
            Pipeline(
                lm_like(),
                4,
                schedule="auto",
                devices=["cpu"] * 2,
                example_inputs=(x,),
                memory_budget=budget,
            )


def test_the_profile_names_a_tied_parameter_on_every_layer_that_uses_it() -> None:
    from pipesched.planning.measure import layer_costs

    torch.manual_seed(0)
    embed, head = nn.Embedding(64, 8), nn.Linear(8, 64, bias=False)
    head.weight = embed.weight  # tied, as GPT-2's
    model = nn.Sequential(embed, nn.Linear(8, 8), nn.Tanh(), head).double()
    costs, _ = layer_costs(model, (torch.randint(0, 64, (4, 3)),))
    tied = (("0.weight", 64 * 8 * 8.0),)
    assert costs[0].shared == tied and costs[-1].shared == tied
    assert all(c.shared == () for c in costs[1:-1])


def test_the_planner_times_b_and_w_apart() -> None:
    """Its one-worker schedule runs each layer's W right after its B: the runtime would run
    such a pair whole (Schedule.whole_backwards), so the planner turns that off to see W."""
    from pipesched.planning.timing import run_layer_times

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
    times = run_layer_times(model, (torch.randn(256, 512),), 3, torch.device("cpu"), 1)
    for k in (0, 2):  # a linear's W is its weight's GEMM: about half its backward
        assert times.backward_weight[k] > 0.2 * times.backward[k], times
