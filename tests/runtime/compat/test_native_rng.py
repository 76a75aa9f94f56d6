"""The C++ kernel for random operations: it draws what the Python kernel draws, and where it
cannot be built or its probe fails, the Python kernel takes over with one warning and the
same numbers.

Each configuration runs in an interpreter of its own (routing is set up once per process):
the C++ kernel (built, or loaded from the cache), the Python kernel by choice
(``PIPESCHED_NATIVE_RNG=0``), a build that fails (``CXX=false``, an empty cache), a
kernel whose probe fails, and one whose walk of the call stack fails its probe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import hashlib, json, os, warnings
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from pipesched import Pipeline
from pipesched.errors import NativeKernelWarning, TorchInternalsWarning
from pipesched.runtime.compat import random_routing

if os.environ.get("TEST_NATIVE_PROBE_FAILS"):  # the C++ kernel built, but its probe fails
    random_routing._check_native = lambda: False
if os.environ.get("TEST_WALK_PROBE_FAILS"):  # its walk of the stack unlike the Python one
    from pipesched.runtime.stage import native_keys
    native_keys._walks_agree = lambda native: False

class Noise(nn.Module):  # a draw in a forward of the user's own, not a dropout
    def forward(self, x):
        return x + 0.1 * torch.rand_like(x)

class Direct(nn.Module):  # what the walk tells apart: a method called directly, a held self
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)

    def noisy(self, x):
        return F.dropout(self.inner(x), 0.2, self.training)

    def forward(self, x):
        def held():  # self in a cell
            return self.noisy(x)
        return self.drop(held()) + torch.utils.checkpoint.checkpoint(
            self.noisy, x, use_reentrant=False)  # the model checkpoints itself

torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(
    nn.Linear(16, 16), nn.Dropout(0.2), Noise(), Direct(),
    nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True),
    nn.RReLU(), nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True),
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pipe = Pipeline(model, 4, balance=[4, 3], devices=["cpu", "cpu"], schedule="1f1b",
                    checkpoint="except_last")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = torch.randn(8, 5, 16), torch.randn(8, 5, 16)
    for _ in range(3):
        opt.zero_grad()
        pipe.step(x, y, loss_fn=F.mse_loss)
        opt.step()
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().numpy().tobytes())
print(json.dumps({
    "params": digest.hexdigest(),
    "draws": random_routing.native_draws(),
    "warned": [type(w.message).__name__ for w in caught
               if issubclass(w.category, (NativeKernelWarning, TorchInternalsWarning))],
}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """The script under each kernel, the three interpreters started at once."""
    base = {k: v for k, v in os.environ.items() if k != "PIPESCHED_NATIVE_RNG"}
    base["OMP_NUM_THREADS"] = "1"
    envs = {
        "native": base,
        "python": {**base, "PIPESCHED_NATIVE_RNG": "0"},
        "broken": {
            **base,
            "CXX": "false",
            "PIPESCHED_CACHE": str(tmp_path_factory.mktemp("empty-cache")),
        },
        "refused": {**base, "TEST_NATIVE_PROBE_FAILS": "1"},
        "unwalked": {**base, "TEST_WALK_PROBE_FAILS": "1"},
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, env in envs.items()
    }
    out: dict[str, dict[str, object]] = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_the_cpp_kernel_seeds_the_draws_and_draws_what_the_python_kernel_draws(runs):
    native, python = runs["native"], runs["python"]
    if native["draws"] is None:
        pytest.skip("the C++ kernel could not be built here (no compiler or ninja)")
    seeded_in_cpp, via_python = native["draws"]
    # The first step learns where stages draw (all in Python); rand_like has no generator=.
    assert seeded_in_cpp > via_python > 0, native
    assert python["draws"] is None and native["warned"] == [] and python["warned"] == []
    assert native["params"] == python["params"]  # bitwise: three steps of training


def test_a_kernel_whose_probe_fails_gives_its_operations_back_to_the_python_kernel(runs):
    refused = runs["refused"]
    if runs["native"]["draws"] is None:
        pytest.skip("the C++ kernel could not be built here (no compiler or ninja)")
    assert refused["draws"] is None
    assert refused["warned"] == ["TorchInternalsWarning"]
    assert refused["params"] == runs["python"]["params"]


def test_a_walk_unlike_pythons_leaves_every_draw_to_the_python_kernel(runs):
    unwalked, native = runs["unwalked"], runs["native"]
    if native["draws"] is None:
        pytest.skip("the C++ kernel could not be built here (no compiler or ninja)")
    seeded_in_cpp, via_python = unwalked["draws"]
    assert seeded_in_cpp <= 1 < native["draws"][0]  # (1: the kernel's own probe)
    assert via_python > native["draws"][1]
    assert unwalked["warned"] == ["TorchInternalsWarning"]
    assert unwalked["params"] == runs["python"]["params"]


def test_a_kernel_that_cannot_be_built_leaves_the_python_kernel_with_one_warning(runs):
    broken = runs["broken"]
    assert broken["draws"] is None
    assert broken["warned"] == ["NativeKernelWarning"]
    assert broken["params"] == runs["python"]["params"]


def test_errors_inside_the_cpp_kernel_reach_the_caller_as_they_were_raised():
    import torch
    import torch.utils.checkpoint

    from pipesched.runtime.compat import random_routing
    from pipesched.runtime.stage import rng

    if not rng.prepare():  # pipesched's own handler: this thread seeds nothing
        pytest.skip("random operations are not routed in this torch")
    if random_routing.native_draws() is None:
        pytest.skip("the C++ kernel could not be built here (no compiler or ninja)")

    native = random_routing.native_module()
    code = torch.utils.checkpoint.checkpoint.__wrapped__.__code__
    names = native.Names([], [99], [0], 0, code)
    keys, twin = native.Keys(names, 0, 1, None), native.Keys(names, 0, 1, None)
    keys.learns, keys.known = False, 5
    was = random_routing.route_random_ops_here(True)
    previous = random_routing.keys_here(keys)
    try:
        with pytest.raises(RuntimeError, match="bernoulli_ expects p"):
            torch.empty(3).bernoulli_(2.0)  # the operation's own error, seeded in C++
        with pytest.raises(RuntimeError, match="bernoulli_ expects p"):  # the Python kernel's
            torch.empty(3).bernoulli_(2.0, generator=torch.Generator())
        seeded = torch.empty(64).bernoulli_(0.5)
    finally:
        random_routing.keys_here(previous)
        random_routing.route_random_ops_here(was)
    twin.seed_for(None, 5, False)  # the failed draw counted, as in keys
    seed, module = twin.seed_for(None, 5, False)
    assert module is None
    assert torch.equal(
        seeded, torch.empty(64).bernoulli_(0.5, generator=torch.Generator().manual_seed(seed))
    )
