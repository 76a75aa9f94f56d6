"""Cutting a traced model's operations into stage modules at given positions.

Why not ``torch.fx.passes.split_module``: it copies parameters and passes separate
arguments, while the runtime passes one object between stages and stages must use
the model's own parameters. Dropout and BatchNorm layers (torch's own ``forward``)
are called as layers, so modes, seeding and ``deferred_batch_norm`` apply; other
random operations run as a seeded :class:`~pipesched.partition.traced_stage.RandomOp`.
Why write-backs move: export writes a reassigned buffer back (``self.n += 1``,
``self.n = self.n + 1``) with a ``copy_`` at the graph's end, in the last stage,
while stage 0 computes it; see :func:`_place_write_backs`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import ConfigError, PartitionError
from pipesched.partition.trace import TracedModel
from pipesched.partition.traced_stage import ModeCheck, RandomOp, Switch, TracedStage, ValueName
from pipesched.runtime.compat.internals import OpOverload, op_schema, pytree
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm
from pipesched.runtime.stage.draw_keys import RANDOM_MODULES

__all__ = ["split_traced"]

_LAYERS_CALLED_AS_MODULES: tuple[type[nn.Module], ...] = (_BatchNorm, *RANDOM_MODULES)

_TORCH_FORWARDS = frozenset(
    [DeferredBatchNorm.forward]
    + [
        c.forward
        for c in vars(nn).values()
        if isinstance(c, type) and issubclass(c, _LAYERS_CALLED_AS_MODULES)
    ]
)
"""The ``forward`` of each torch layer class above (and ours): what calling the layer runs."""


def _called_as_layer(module: nn.Module) -> bool:
    """Whether ``module``'s operations may be replaced by a call of ``module``: its code is torch's.

    The class says nothing: a BatchNorm subclass whose ``forward`` adds an
    activation (run by a child, so traced under the child's name) would run
    that activation twice, once in the call and once as traced.
    """
    return isinstance(module, _LAYERS_CALLED_AS_MODULES) and type(module).forward in _TORCH_FORWARDS


@dataclass(frozen=True)
class _Region:
    """The operations of one call of a Dropout or BatchNorm layer."""

    name: str
    nodes: frozenset[fx.Node]
    source: fx.Node
    output: fx.Node


def split_traced(
    traced: TracedModel, bounds: Sequence[int], devices: Sequence[torch.device] | None = None
) -> list[TracedStage]:
    """The stages: operations ``bounds[s]`` to ``bounds[s + 1] - 1`` of ``traced.ops`` form stage s.

    Args:
        traced: the trace.
        bounds: increasing op positions, ``bounds[0] == 0`` and
            ``bounds[-1] == len(traced.ops)``.
        devices: the device of each stage, to check that a parameter used by
            two stages (tied weights) is not asked to live on two devices.

    Raises:
        PartitionError: a stage would be empty, or tied weights span devices.
    """
    ops = traced.ops
    num_stages = len(bounds) - 1
    if list(bounds) != sorted(set(bounds)) or bounds[0] != 0 or bounds[-1] != len(ops):
        raise PartitionError(
            f"stage bounds {list(bounds)} must rise strictly from 0 to {len(ops)} (operations)"
        )
    stage_of: dict[fx.Node, int] = {node: 0 for node in traced.inputs}
    for s in range(num_stages):
        for node in ops[bounds[s] : bounds[s + 1]]:
            stage_of[node] = s
    regions = _regions(traced)
    for region in regions.values():  # a layer's operations run where its output is made
        for node in region.nodes:
            stage_of[node] = stage_of[region.output]
    aliases = _buffer_aliases(traced)
    _place_write_backs(traced, stage_of, aliases)
    _check_buffer_writers(traced, stage_of, aliases)
    members: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for node in ops:
        members[stage_of[node]].append(node)
    last_use: dict[fx.Node, int] = {}
    for node in ops:
        for source in node.all_input_nodes:
            if source in stage_of:
                last_use[source] = max(last_use.get(source, 0), stage_of[node])
    for value in traced.outputs:
        if isinstance(value, fx.Node) and value in stage_of:
            last_use[value] = num_stages
    order = {node: i for i, node in enumerate([*traced.inputs, *ops])}
    sends = [
        sorted(
            (v for v, s in stage_of.items() if s <= k < last_use.get(v, -1)), key=order.__getitem__
        )
        for k in range(num_stages - 1)
    ]
    _check_devices(traced, members, regions, devices)
    return [
        _stage(traced, s, num_stages, members[s], regions, sends, aliases)
        for s in range(num_stages)
    ]


def _buffer_aliases(traced: TracedModel) -> dict[fx.Node, fx.Node]:
    """Each buffer and each value sharing its data (an in-place result, a view): the buffer."""
    aliases = {node: node for node, ref in traced.state.items() if ref.kind == "buffer"}
    for node in traced.ops:
        target = node.args[0] if node.args else None
        if isinstance(target, fx.Node) and target in aliases and _returns_alias(node):
            aliases[node] = aliases[target]
    return aliases


def _place_write_backs(
    traced: TracedModel, stage_of: dict[fx.Node, int], aliases: dict[fx.Node, fx.Node]
) -> None:
    """Moves each buffer write-back to the last stage that uses the buffer or makes its value.

    Why: export writes a reassigned buffer back with ``copy_(buffer, value)``
    after the model's last operation. Left there, the last stage writes micro-batch
    ``i``'s value while stage 0, another thread, already runs micro-batch ``i + 1``
    on the old one (``self.n = self.n + 1`` counts once per pipeline, not per
    micro-batch), or, for ``self.n += 1``, copies back a copy of the buffer it
    received (a checkpointed stage copies its input), taken before stage 0's next
    update and written after it: updates are lost. A stage runs its micro-batches
    in order, so the write-back keeps the plain model's order when it runs in the
    last stage that reads the buffer (or a view or in-place result of it) and
    after its value is made, and no later stage touches the buffer. It stays where
    it is when its value shares another buffer's data.

    Args:
        traced: the trace.
        stage_of: each operation's stage; the write-backs' entries are changed.
        aliases: from :func:`_buffer_aliases`.
    """
    last: dict[fx.Node, int] = {}  # buffer -> last stage of an operation using it
    write_backs: list[tuple[fx.Node, fx.Node, Any]] = []  # (copy_, buffer, value)
    for node in traced.ops:
        target = node.args[0] if node.args else None
        copies = node.target is torch.ops.aten.copy_.default and not node.users
        if copies and isinstance(target, fx.Node) and aliases.get(target) is target:
            write_backs.append((node, target, node.args[1]))
            continue
        for source in node.all_input_nodes:
            if (buffer := aliases.get(source)) is not None:
                last[buffer] = max(last.get(buffer, 0), stage_of[node])
    for node, buffer, value in write_backs:
        if not isinstance(value, fx.Node):
            made = 0  # a constant
        elif aliases.get(value, buffer) is not buffer:
            continue  # its value shares another buffer's data: that buffer's order matters
        else:
            made = stage_of.get(value, 0)  # 0: a user input or the model's state
        stage_of[node] = min(stage_of[node], max(last.get(buffer, 0), made))


def _check_buffer_writers(
    traced: TracedModel, stage_of: dict[fx.Node, int], aliases: dict[fx.Node, fx.Node]
) -> None:
    """Raises PartitionError if two stages write one buffer (in place or by its write-back).

    Why: stages run in threads of their own (or processes on a mesh): a buffer
    written by two of them (one BatchNorm called after layers on both sides of a
    cut, a counter bumped at two places) would have its updates race, or split
    between the ranks' copies, where the plain model makes them in order.
    """
    writers: dict[fx.Node, set[int]] = {}
    for node in traced.ops:
        if not isinstance(node.target, OpOverload):
            continue
        for argument, value in zip(op_schema(node.target).arguments, node.args, strict=False):
            info = argument.alias_info
            written = info is not None and info.is_write and isinstance(value, fx.Node)
            if written and (buffer := aliases.get(value)) is not None:  # type: ignore[arg-type]
                writers.setdefault(buffer, set()).add(stage_of[node])
    for buffer, stages in writers.items():
        if len(stages) > 1:
            name = traced.state[buffer].name
            raise PartitionError(
                f"buffer {name!r} is written by stages {sorted(stages)}: the model updates "
                "it at more than one place (one BatchNorm called after layers on both sides "
                "of a cut, a counter bumped twice) and stages run in threads or processes "
                "of their own, so its updates would race or be split between copies. Cut "
                "where its updates fall in one stage (split_points=, balance=), or give "
                "each place a module of its own"
            )


def _returns_alias(node: fx.Node) -> bool:
    """Whether ``node`` returns (a view of) its first argument: an in-place or view op."""
    op = node.target
    if not isinstance(op, OpOverload):
        return False
    schema = op_schema(op)
    if not schema.arguments or not schema.returns:
        return False
    first, result = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and result is not None and first.before_set == result.before_set


def _stage(
    traced: TracedModel,
    s: int,
    num_stages: int,
    ops: list[fx.Node],
    regions: dict[fx.Node, _Region],
    sends: list[list[fx.Node]],
    aliases: dict[fx.Node, fx.Node],
) -> TracedStage:
    model = traced.model
    inside = {n for r in regions.values() for n in r.nodes} - set(regions)
    last = s == num_stages - 1
    reads: set[fx.Node] = set()
    for op in ops:
        if op in regions:
            reads.add(regions[op].source)
        elif op not in inside:
            reads.update(op.all_input_nodes)
    received = traced.inputs if s == 0 else sends[s - 1]
    used_inputs = [n for n in received if n in reads]
    state_nodes = sorted((n for n in reads if n in traced.state), key=lambda n: n.name)
    graph = fx.Graph()
    device = graph.placeholder("device")
    env = {n: graph.placeholder(n.name) for n in [*used_inputs, *state_nodes]}
    modules: dict[str, nn.Module] = {}
    checks: list[ModeCheck] = []
    for node in ops:
        if node in regions:
            target = f"layers.{len(modules)}"
            modules[target] = model.get_submodule(regions[node].name)
            env[node] = graph.call_module(target, (env[regions[node].source],))
        elif node not in inside:
            env[node] = _copy(graph, node, env, device, modules, checks, model)
    wanted = set(traced.outputs) if last else set(sends[s])
    produced = [n for n in ops if n in wanted]
    graph.output(tuple(env[n] for n in produced))
    constants: dict[str, torch.Tensor] = {}
    state: list[tuple[dict[str, Any] | None, str]] = []
    owners: list[nn.Module] = []
    for node in state_nodes:
        ref = traced.state[node]
        if ref.kind == "constant":
            key = f"constant_{len(constants)}"
            constants[key] = traced.constant(ref.name)
            state.append((None, key))
            continue
        owner_name, _, attr = ref.name.rpartition(".")
        owner = model.get_submodule(owner_name)
        state.append((owner._parameters if ref.kind == "parameter" else owner._buffers, attr))
        if all(owner is not o for o in owners):
            owners.append(owner)
    return TracedStage(
        traced,
        s,
        num_stages,
        fx.GraphModule(modules, graph, class_name=f"Stage{s}"),
        inputs=[n.name for n in used_inputs],
        state=state,
        owners=owners,
        produced=[n.name for n in produced],
        sends=None if last else [n.name for n in sends[s]],
        snapshots=[] if last else [n.name for n in sends[s] if n in aliases and n in ops],
        outputs=[ValueName(v.name) if isinstance(v, fx.Node) else v for v in traced.outputs],
        mode_checks=list({c.name: c for c in checks}.values()),
        constants=constants,
    )


def _copy(
    graph: fx.Graph,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
    device: fx.Node,
    modules: dict[str, nn.Module],
    checks: list[ModeCheck],
    model: nn.Module,
) -> fx.Node:
    """``node`` copied into ``graph``: devices made the stage's, random ops made seeded."""
    new = graph.node_copy(node, lambda n: env[n])
    new.args, new.kwargs = pytree.tree_map_only(
        torch.device, lambda _: device, (new.args, new.kwargs)
    )
    owner = _owner(node, model)
    module = model.get_submodule(owner) if owner is not None else None
    random = _randomness(node)
    if random is None:
        if isinstance(module, _BatchNorm):  # a BatchNorm that could not be called as a layer
            checks.append(ModeCheck(module, owner or "", module.training, "batch-norm operations"))
        return new
    position, name, probability = random
    switch = None
    if name is not None and module is not None:
        if probability:
            on = True if name == "train" else probability
            switch = Switch(position, name, on, False if name == "train" else 0.0)
        elif not module.training:  # p = 0 seen in eval mode: the code may zero it there
            reason = f"dropout probability ({node.target}: 0 when traced)"
            checks.append(ModeCheck(module, owner or "", False, reason))
    if probability or name is None:
        target = f"random.{node.name}"
        modules[target] = RandomOp(node.target, module, switch)  # type: ignore[arg-type]
        new.op, new.target = "call_module", target
    return new


def _regions(traced: TracedModel) -> dict[fx.Node, _Region]:
    """The Dropout and BatchNorm calls that can be replaced by a call of the layer, by output."""
    groups: dict[str, list[fx.Node]] = {}
    for node in traced.ops:
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            key = next(reversed(stack))
            groups.setdefault(key, []).append(node)
    sites = Counter(_stack_path(nodes[0], key) for key, nodes in groups.items())
    held = Counter(id(m) for _, m in traced.model.named_modules(remove_duplicate=False))
    regions = {}
    for key, nodes in groups.items():
        name = _stack_path(nodes[0], key)
        try:
            module = traced.model.get_submodule(name)
        except AttributeError:
            continue
        if not _called_as_layer(module):
            continue
        if sites[name] > 1 or held[id(module)] > 1:
            # A layer called at several sites (a model's self.drop after each block) or
            # held under two names stays operations. A dropout's each become a RandomOp
            # named after its node: a draw's place is its call site, which no cut moves
            # (as a layer, it was the module's n-th draw in the stage). A BatchNorm's
            # updates of its statistics become values flowing from use to use, as
            # torch.export wrote them, not two stages writing one buffer.
            if isinstance(module, DeferredBatchNorm):
                raise ConfigError(
                    f"BatchNorm {name!r} is called at {sites[name]} places: nn.BatchNorm moves "
                    "its running statistics once per call, a DeferredBatchNorm once per "
                    "mini-batch for all its calls together; give each place a BatchNorm of "
                    "its own, or keep per-micro-batch statistics (deferred_batch_norm=False)"
                )
            continue
        members = frozenset(nodes)
        own = {
            n for n, ref in traced.state.items() if ref.name.startswith(f"{name}.") and name != ""
        }
        sources = {a for n in nodes for a in n.all_input_nodes if a not in members and a not in own}
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        if len(sources) == 1 and len(outputs) == 1:
            source = next(iter(sources))
            if source not in traced.state:
                regions[outputs[0]] = _Region(name, members, source, outputs[0])
    return regions


def _stack_path(node: fx.Node, key: str) -> str:
    path: str = node.meta["nn_module_stack"][key][0]
    return path


def _randomness(node: fx.Node) -> tuple[int | None, str | None, float] | None:
    """None for a deterministic op; else where its mode switch is, and its probability.

    Returns ``(position, name, p)``: the argument that turns dropout off in
    eval mode (``train``, or ``dropout_p`` of attention), its position in
    ``node.args`` (None: a keyword or absent), and the dropout probability as
    traced. ``name`` is None for random ops without one (``rand``, ``bernoulli``).
    """
    op = node.target
    if not isinstance(op, OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags:
        return None
    names = [a.name for a in op_schema(op).arguments]
    values: dict[str, Any] = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    for name in ("train", "dropout_p"):
        if name in names:
            p = values.get("p" if name == "train" else name, 0.0)
            index = names.index(name)
            return (index if index < len(node.args) else None), name, float(p or 0.0)
    return None, None, 1.0


def _owner(node: fx.Node, model: nn.Module) -> str | None:
    """The name of the innermost module that ran ``node``; None for the model's own code."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(stack.values()):
        try:
            if path:
                model.get_submodule(path)
                return str(path)
        except AttributeError:
            continue  # export's own markers, not modules
    return None


def _check_devices(
    traced: TracedModel,
    members: list[list[fx.Node]],
    regions: dict[fx.Node, _Region],
    devices: Sequence[torch.device] | None,
) -> None:
    """Raises PartitionError if one parameter is used by stages on different devices."""
    if devices is None:
        return
    named = dict(traced.model.named_parameters(remove_duplicate=False))
    where: dict[int, dict[int, str]] = {}
    for s, ops in enumerate(members):
        for op in ops:
            names = [traced.state[n].name for n in op.all_input_nodes if n in traced.state]
            if op in regions:
                layer = traced.model.get_submodule(regions[op].name)
                names += [f"{regions[op].name}.{p}" for p, _ in layer.named_parameters()]
            for name in names:
                if name in named:
                    where.setdefault(id(named[name]), {})[s] = name
    for stages in where.values():
        used_on = {devices[s] for s in stages}
        if len(used_on) > 1:
            listing = ", ".join(f"stage {s} on {devices[s]} ({n})" for s, n in stages.items())
            raise PartitionError(
                f"one parameter is used by {listing}; a Parameter lives on one device. "
                "Place those stages on one device (devices=[...] or a schedule that puts them "
                "on one worker), untie the weights, or choose other split points"
            )
