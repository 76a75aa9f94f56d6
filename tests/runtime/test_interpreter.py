"""The one interpreter and its transports: a pass per kind, composition not inheritance, modes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

import pipesched.runtime as runtime_package
from pipesched import ConfigError, Pipeline
from pipesched.runtime import distributed, local, mailbox, ordered, p2p
from pipesched.runtime.transport import P2P_MODES, p2p_mode
from pipesched.schedule import Kind

RUNTIME = Path(runtime_package.__file__).parent


def test_the_interpreter_has_one_pass_per_kind_and_nothing_else():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pipe = Pipeline(model, 2, balance=[1, 1], devices=["cpu", "cpu"], schedule="zb-h1")
    assert set(pipe.engine.runtime.interpreter.handlers) == set(Kind)


def test_no_runtime_class_inherits_behaviour_from_another():
    """Behaviour is shared by composition: no class in runtime/ subclasses a concrete class
    (Protocols, exceptions, dataclass records and torch's own bases aside)."""
    allowed = {"Protocol", "Exception", "NamedTuple", "Module", "TorchFunctionMode", "Function"}
    allowed |= {"local"}  # threading.local: per-thread state, the standard idiom
    for path in sorted(RUNTIME.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
                assert bases <= allowed, f"{path.name}: class {node.name}({', '.join(bases)})"


def test_the_two_runtimes_share_the_interpreter_not_a_base_class():
    for cls in (local.LocalRuntime, distributed.DistributedRuntime):
        assert cls.__mro__ == (cls, object)
        assert "interpreter" in inspect.getsource(cls.__init__)


def test_every_transport_has_the_protocols_methods():
    names = {"start", "before", "take", "put", "finish", "abort", "aborted"}
    for cls in (mailbox.Mailbox, p2p.TaggedTransport, ordered.OrderedTransport):
        assert names <= set(dir(cls)), cls


@pytest.mark.parametrize(
    ("backend", "roomy", "asked", "mode"),
    [
        ("gloo", True, None, "tagged"),
        ("gloo", True, "ordered", "ordered"),
        ("gloo", True, " Ordered ", "ordered"),
        ("gloo", True, "tagged", "tagged"),
        ("gloo", False, None, "ordered"),  # gloo's uv transport needs exact sizes
        ("nccl", True, None, "ordered"),
        ("nccl", True, "ordered", "ordered"),
    ],
)
def test_which_transport_a_mesh_gets(monkeypatch, backend, roomy, asked, mode):
    if asked is None:
        monkeypatch.delenv("PIPESCHED_P2P", raising=False)
    else:
        monkeypatch.setenv("PIPESCHED_P2P", asked)
    assert p2p_mode(backend, roomy=roomy) == mode
    assert mode in P2P_MODES


@pytest.mark.parametrize(("backend", "roomy"), [("nccl", True), ("gloo", False)])
def test_tags_cannot_be_asked_for_where_they_do_not_match_messages(monkeypatch, backend, roomy):
    monkeypatch.setenv("PIPESCHED_P2P", "tagged")
    with pytest.raises(ConfigError, match="unset PIPESCHED_P2P"):
        p2p_mode(backend, roomy=roomy)


def test_an_unknown_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv("PIPESCHED_P2P", "fast")
    with pytest.raises(ConfigError, match="'fast' is not one of tagged, ordered"):
        p2p_mode("gloo")


def test_a_v_schedules_turn_never_reaches_the_transport():
    """Stages 1 and 2 of ZB-V share worker 1: their values stay in the worker's memory."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]).double()
    pipe = Pipeline(model, 3, balance=[1, 1, 1, 1], devices=["cpu", "cpu"], schedule="zb-v")
    seen = []
    take = mailbox.Mailbox.take

    def spy(self, message, peer, stream):
        seen.append(message)
        return take(self, message, peer, stream)

    mailbox.Mailbox.take = spy  # type: ignore[method-assign]
    try:
        pipe.step(torch.randn(6, 4, dtype=torch.float64), loss_fn=lambda y: y.square().mean())
    finally:
        mailbox.Mailbox.take = take  # type: ignore[method-assign]
    assert seen and not any(m.stage == 2 and m.kind == "F" for m in seen)
    assert not any(m.stage == 1 and m.kind == "B" for m in seen)


def test_a_w_whose_b_ran_whole_gathers_no_sharded_stage():
    """A stage sharded per action is gathered around each action, but not around a W that
    has nothing to do (its B ran the whole backward: Schedule.whole_backwards)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]).double()
    pipe = Pipeline(model, 4, balance=[1, 1, 1, 1], devices=["cpu", "cpu"], schedule="zb-v")
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe.step(x, loss_fn=lambda y: y.square().mean())  # builds the engine
    calls: list[tuple[int, bool]] = []
    pipe.engine.runtime.interpreter.around_action = lambda s, enter: calls.append((s, enter))
    pipe.step(x, loss_fn=lambda y: y.square().mean())
    schedule = pipe.schedule_for(4)
    actions = sum(map(len, schedule.actions))
    assert len(schedule.whole_backwards) == 7
    assert calls.count((0, True)) == calls.count((0, False)) == 4 * 2  # stage 0: F and B
    assert len(calls) == 2 * (actions - len(schedule.whole_backwards))
