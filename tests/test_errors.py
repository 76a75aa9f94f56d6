"""The error taxonomy: wrong types are TypeErrors, missing devices are named, floors are true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version
from torch import nn

import pipesched
from pipesched import (
    ConfigError,
    GradientAccumulator,
    Pipeline,
    PipeschedError,
    get_schedule,
)
from pipesched.runtime.compat.torch_floor import (
    TORCH_FLOOR,
    check_torch_version,
    installed_torch_version,
)
from pipesched.runtime.stage.recompute import checkpoint

mse = nn.functional.mse_loss


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _pipe(**kwargs: Any) -> Pipeline:
    options: dict[str, Any] = {"balance": [2, 1], "devices": ["cpu", "cpu"], **kwargs}
    return Pipeline(_model(), 2, **options)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 4), torch.randn(6, 2)


# --- the classes ---------------------------------------------------------------------------


def test_config_type_error_is_a_config_error_a_pipesched_error_and_a_type_error():
    from pipesched.errors import ConfigTypeError

    error = ConfigTypeError("chunks must be an int")
    assert isinstance(error, ConfigError)
    assert isinstance(error, PipeschedError)
    assert isinstance(error, TypeError)
    assert isinstance(error, ValueError)  # as a ConfigError it always was


def test_remote_error_and_config_type_error_are_exported():
    from pipesched import ConfigTypeError, RemoteError

    assert issubclass(RemoteError, PipeschedError)
    assert issubclass(ConfigTypeError, TypeError)
    assert {"RemoteError", "ConfigTypeError"} <= set(pipesched.__all__)


# --- wrong types and argument counts are TypeErrors ----------------------------------------


def test_input_varargs():
    # torchgpipe's tests/test_gpipe.py::test_input_varargs, for a Pipeline.
    pipe = Pipeline(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"])
    a, b = torch.rand(1), torch.rand(1)
    with pytest.raises(TypeError):
        pipe(a, b)  # TypeError: forward() takes 2 positional arguments but 3 were given


@pytest.mark.parametrize("chunks", ["4", 2.5, True, None])
def test_chunks_of_the_wrong_type_is_a_type_error(chunks: Any):
    with pytest.raises(TypeError, match="chunks"):
        Pipeline(_model(), chunks, balance=[2, 1], devices=["cpu", "cpu"])


def test_chunks_out_of_range_is_a_config_error_but_not_a_type_error():
    with pytest.raises(ConfigError, match="chunks") as caught:
        Pipeline(_model(), 0, balance=[2, 1], devices=["cpu", "cpu"])
    assert not isinstance(caught.value, TypeError)
    with pytest.raises(TypeError, match="chunks"):  # and the type is checked first
        Pipeline(_model(), "0", balance=[2, 1], devices=["cpu", "cpu"])


@pytest.mark.parametrize("method", ["step", "accumulate"])
@pytest.mark.parametrize("loss_fn", [None, 3, "mse"])
def test_a_loss_fn_that_is_not_callable_is_a_type_error_naming_it(method: str, loss_fn: Any):
    x, y = _batch()
    with pytest.raises(TypeError, match="loss_fn"):
        getattr(_pipe(), method)(x, y, loss_fn=loss_fn)


def test_a_module_that_is_not_an_nn_module_is_a_type_error():
    x, _ = _batch()
    with pytest.raises(TypeError, match="nn.Module"):
        Pipeline("model", 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        Pipeline(lambda t: t, 2, example_inputs=(x,), num_stages=2)  # type: ignore[arg-type]


TYPE_ERRORS: dict[str, Callable[[], Any]] = {
    "balance=3": lambda: _pipe(balance=3),
    "devices='cpu'": lambda: _pipe(devices="cpu"),
    "devices=[1.5]": lambda: _pipe(devices=["cpu", 1.5]),
    "checkpoint=3": lambda: _pipe(checkpoint=3),
    "schedule=3": lambda: _pipe(schedule=3),
    "num_stages='2'": lambda: Pipeline(_model(), 2, num_stages="2"),
    "mesh='junk'": lambda: Pipeline(_model(), 2, mesh="junk"),
    "memory_budget='1e9'": lambda: _pipe(
        balance="time", example_inputs=(torch.randn(3, 4),), memory_budget="1e9"
    ),
    "split_points='2'": lambda: Pipeline(_model(), 2, split_points="2", devices=["cpu", "cpu"]),
    "example_inputs=tensor": lambda: _pipe(balance="time", example_inputs=torch.randn(3, 4)),
    "example_inputs=tensor, auto": lambda: _pipe(schedule="auto", example_inputs=torch.randn(3, 4)),
    "num_items=[3]": lambda: _pipe().step(*_batch(), loss_fn=mse, num_items=[3]),
    "optimizer='sgd'": lambda: GradientAccumulator(_pipe(), "sgd", accumulation_steps=2),
    "max_grad_norm='1'": lambda: GradientAccumulator(
        (p := _pipe()),
        torch.optim.SGD(p.parameters(), lr=0.1),
        accumulation_steps=2,
        max_grad_norm="1",
    ),
    "accumulation_steps=2.0": lambda: GradientAccumulator(
        (p := _pipe()), torch.optim.SGD(p.parameters(), lr=0.1), accumulation_steps=2.0
    ),
    "get_schedule(3, ...)": lambda: get_schedule(3, 2, 2),
    "get_schedule(..., num_stages='2')": lambda: get_schedule("1f1b", "2", 2),
    "get_schedule(..., foo=1)": lambda: get_schedule("1f1b", 2, 2, foo=1),
    "checkpoint(function)": lambda: checkpoint(lambda t: t, torch.ones(2)),
}


@pytest.mark.parametrize("name", list(TYPE_ERRORS))
def test_wrong_types_are_config_type_errors(name: str):
    # A TypeError (not torch's or Python's own from deep inside) that is also a ConfigError.
    with pytest.raises(TypeError) as caught:
        TYPE_ERRORS[name]()
    assert isinstance(caught.value, ConfigError), repr(caught.value)


# --- devices this torch build does not have ---------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch build has CUDA")
def test_cuda_devices_on_a_cpu_build_name_the_device_and_the_fix():
    with pytest.raises(ConfigError) as caught:
        _pipe(devices=["cuda:0", "cuda:0"])
    message = str(caught.value)
    assert "'cuda:0'" in message and "devices=['cpu', 'cpu']" in message
    assert "CUDA" in message and torch.__version__ in message


@pytest.mark.cuda
def test_a_cuda_index_past_the_device_count_names_the_visible_devices():
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ConfigError, match=re.escape(repr(missing))):
        _pipe(devices=["cpu", missing])


# --- the floors pyproject declares ---------------------------------------------------------

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())


def test_python_floor_is_3_11_for_add_note():
    floor = PYPROJECT["project"]["requires-python"]
    assert floor == ">=3.11", floor  # BaseException.add_note is new in 3.11
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"


def test_torch_floor_is_not_above_the_installed_torch():
    (spec,) = [d for d in PYPROJECT["project"]["dependencies"] if re.match(r"torch\b", d)]
    floor = Version(spec.removeprefix("torch>="))
    # torch.nn.utils.get_total_norm and clip_grads_with_norm_ are new in 2.6.
    assert floor >= Version("2.6"), spec
    assert Version(torch.__version__).release >= floor.release
    # The floor is the oldest torch tested, and the import-time check knows the same one.
    assert floor.release[:2] == TORCH_FLOOR, (spec, TORCH_FLOOR)
    assert installed_torch_version() == torch.__version__


def test_importing_pipesched_with_a_torch_below_the_floor_names_the_fix(tmp_path):
    # A stand-in torch package whose version.py says 2.6.0, first on the path.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.6.0'\n")
    src = Path(pipesched.__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", "import pipesched"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    floor = ".".join(map(str, TORCH_FLOOR))
    assert "ImportError: pipesched needs torch " + floor in result.stderr, result.stderr
    assert "torch 2.6.0 is installed" in result.stderr
    assert f"pip install 'torch>={floor}'" in result.stderr


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0a0+git1234", "2.14.1+cu130", "3.0.0"])
def test_torch_at_or_above_the_floor_passes(version):
    check_torch_version(version)
    check_torch_version(None)  # unknown: torch's own import decides


@pytest.mark.parametrize("version", ["2.12.1+cpu", "2.6.0", "1.13.1"])
def test_torch_below_the_floor_is_an_import_error(version):
    with pytest.raises(ImportError, match=re.escape(f"torch {version} is installed")):
        check_torch_version(version)


def test_a_target_with_other_rows_than_the_inputs_is_named_as_the_target():
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3)), chunks=2)
    target = {"label": torch.zeros(5, dtype=torch.long)}
    with pytest.raises(ConfigError, match=r"^target has 5 rows \(dim 0\) but inputs has 8"):
        pipe.step(torch.randn(8, 4), target, loss_fn=lambda y, t: y.sum())
