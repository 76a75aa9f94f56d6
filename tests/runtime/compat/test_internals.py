"""Private torch APIs: each one missing still gives exact steps and one warning naming it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.compat import internals

_REMOVALS = {
    # API: (how the subprocess takes it away before importing pipesched, fusion still on?)
    "torch._C._will_engine_execute_node": (
        "delattr(torch._C, '_will_engine_execute_node')",
        True,
    ),
    "torch.autograd.graph._engine_run_backward": (
        "import torch.autograd.graph\ndelattr(torch.autograd.graph, '_engine_run_backward')",
        True,
    ),
    "torch._C._autograd._top_saved_tensors_default_hooks": (
        "delattr(torch._C._autograd, '_top_saved_tensors_default_hooks')",
        False,
    ),
    # A C type's attribute cannot be deleted: shadowed by one that reads None.
    "torch.Tensor._backward_hooks": (
        "torch.Tensor._backward_hooks = property(lambda self: None)",
        False,
    ),
    "torch.Tensor._post_accumulate_grad_hooks": (
        "torch.Tensor._post_accumulate_grad_hooks = property(lambda self: None)",
        False,
    ),
    # torch's own checkpoint reads it: changed so that it no longer opens without arguments.
    "torch.utils.checkpoint.GraphExecGroup": (
        "import torch.utils.checkpoint as c\n"
        "class Changed(c.GraphExecGroup):\n"
        "    def __init__(self, required): super().__init__()\n"
        "c.GraphExecGroup = Changed",
        True,
    ),
    # torch's own Function.apply calls it: changed so that no transform is ever seen.
    "torch._C._are_functorch_transforms_active": (
        "torch._C._are_functorch_transforms_active = lambda: False",
        True,
    ),
    # torch's own modules read its overload: changed to return a tracked view instead.
    "torch.ops.aten._unsafe_view": (
        "class Viewing:\n"
        "    default = torch.ops.aten._unsafe_view.default\n"
        "    def __call__(self, t, size): return t.view(size)\n"
        "torch.ops.aten._unsafe_view = Viewing()",
        True,
    ),
    # torch's own modules need these two (dynamo, nn.Module.to): changed, not deleted.
    "torch._foreach_mul_": ("torch._foreach_mul_ = lambda tensors, factor: None", True),
    "torch._C._nn._parse_to": (
        "parse = torch._C._nn._parse_to\n"
        "torch._C._nn._parse_to = lambda *a, **k: list(parse(*a, **k))",
        True,
    ),
}

_SCRIPT = """
import copy, json, warnings
import torch
from torch import nn
{removal}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from torch import nn
    from pipesched import Pipeline, TorchInternalsWarning
    from pipesched.runtime.compat import internals
    from pipesched.runtime import fused_linear
    from pipesched.train.gradients import scale_

    fused_linear.MIN_FUSED_BYTES = 0
    exact = {{}}
    for schedule, checkpoint in [("zb-h1", "never"), ("zb-h1", "except_last"), ("1f1b", "never")]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 5)
        ).double()
        reference = copy.deepcopy(model)
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
        nn.functional.mse_loss(reference(x), y).backward()
        pipe = Pipeline(
            model, 4, balance=[2, 3], devices=["cpu", "cpu"], schedule=schedule,
            checkpoint=checkpoint,
        )
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        exact[schedule + "/" + checkpoint] = all(
            torch.allclose(p.grad, r.grad, rtol=1e-10, atol=1e-14)
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )
    grads = [torch.ones(3, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.float64)]
    scale_(grads, 0.5)
    exact["scale_"] = grads[0].eq(0.5).all().item() and grads[1].eq(2.0).all().item()
    exact["parse_to"] = internals.parse_to("cpu", torch.float64)[:2] == (
        torch.device("cpu"), torch.float64
    )
warned = [str(w.message) for w in caught if issubclass(w.category, TorchInternalsWarning)]
print(json.dumps({{"exact": exact, "warned": warned, "fusion": internals.FUSION_SUPPORTED}}))
"""


@pytest.fixture(scope="module")
def runs_without() -> dict[str, subprocess.Popen[str]]:
    """One interpreter per removal, all started at once (each mostly imports torch alone)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return {
        api: subprocess.Popen(
            [sys.executable, "-c", _SCRIPT.format(removal=removal)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for api, (removal, _) in _REMOVALS.items()
    }


@pytest.mark.parametrize("api", list(_REMOVALS))
def test_a_step_without_the_private_api_equals_the_plain_model(
    api: str, runs_without: dict[str, subprocess.Popen[str]]
) -> None:
    fusion = _REMOVALS[api][1]
    proc = runs_without[api]
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(result["exact"].values()), result["exact"]
    assert len(result["warned"]) == 1, result["warned"]
    assert api in result["warned"][0]
    assert result["fusion"] == fusion


def test_probes_see_the_cpu_whatever_device_the_first_import_comes_under() -> None:
    # The package loads lazily: naming pipesched.Pipeline first inside a meta device
    # context imports it there. The probes must not run on tensors that hold no values.
    script = (
        "import warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "import pipesched\n"
        "with torch.device('meta'), torch.device('meta'):\n"
        "    pipesched.Pipeline\n"
        "from pipesched.runtime.compat import internals\n"
        "print(internals.MISSING)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


_FIRST_PIPELINES = """
import torch
from torch import nn
from torch import nn
from pipesched import Pipeline

def grads(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3))
    state = torch.get_rng_state()
    pipe = Pipeline(model, 2, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule)
    moved = not torch.equal(state, torch.get_rng_state())
    g = torch.Generator().manual_seed(1)
    pipe.step(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g),
              loss_fn=nn.functional.mse_loss)
    return moved, [p.grad.clone() for p in pipe.parameters()]

for schedule in ("1f1b", "zb-h1"):
    (moved, first), (_, second) = grads(schedule), grads(schedule)
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    print(schedule, moved, same)
"""


def test_the_first_pipeline_of_a_process_leaves_the_generator_alone() -> None:
    # The probes run at the first Pipeline; one that drew from torch's generator made the
    # first seeded run of a process differ from every later one (its dropout masks).
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_PIPELINES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1f1b", "False", "True", "zb-h1", "False", "True"]


def test_this_torch_has_them_all() -> None:
    assert internals.MISSING == []
    assert internals.FUSION_SUPPORTED


def test_without_unsafe_view_outputs_written_in_place_are_copies_and_steps_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(internals, "_unsafe_view", None)
    view = torch.arange(6.0).reshape(2, 3).t()
    out = internals.function_output(view)
    assert not out._is_view() and torch.equal(out, view) and out.data_ptr() != view.data_ptr()
    grads = []
    for pipelined in (False, True):  # 3-D linears with a bias (views), each written in place
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True)
        ).double()
        x = torch.randn(8, 3, 6, dtype=torch.float64)
        if pipelined:
            pipe = Pipeline(model, 4, balance=[2, 2], devices=["cpu", "cpu"], schedule="zb-h1")
            pipe.step(x, loss_fn=lambda out: out.square().mean())
        else:
            model(x).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("cpu",), {}),
        (("cpu", torch.float16), {}),
        ((torch.float32,), {}),
        ((torch.zeros(1, dtype=torch.int8),), {}),
        ((), {"dtype": torch.float64, "non_blocking": True}),
        ((torch.device("cpu"), torch.float64, True), {}),
        ((), {"device": "cpu", "memory_format": torch.channels_last}),
    ],
)
def test_to_arguments_read_in_python_as_torch_reads_them(args, kwargs) -> None:
    expected = torch._C._nn._parse_to(*args, **kwargs)
    assert internals._read_to_arguments(*args, **dict(kwargs)) == expected


_PRIVATE = re.compile(
    r"torch\._C\b|torch\._ops\b|torch\.utils\._|_will_engine_execute_node|"
    r"_top_saved_tensors_default_hooks|_foreach_|_parse_to|_backward_hooks|"
    r"_post_accumulate_grad_hooks|_backward_cls|_is_view\(\)"
)


def test_no_other_module_names_a_private_torch_api() -> None:
    # The shims: internals.py, and random_routing.py (the dispatch key CustomRNGKeyId).
    package = Path(internals.__file__).parent
    found = [
        f"{path.relative_to(package)}:{n}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name not in ("internals.py", "random_routing.py") or path.parent != package
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _PRIVATE.search(line)
    ]
    assert found == []


def test_every_checked_api_is_listed_in_the_guide() -> None:
    guide = (Path(__file__).parents[3] / "docs" / "guide.md").read_text()
    table = guide.split("### Private torch APIs", 1)[1].split("\n## ", 1)[0]
    for api in _REMOVALS:
        assert api.rsplit(".", 1)[-1] in table, api
