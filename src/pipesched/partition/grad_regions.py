"""``torch.no_grad()`` regions of an exported graph, copied inline as ordinary operations."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram

from pipesched.runtime.compat.internals import pytree

__all__ = ["inline_grad_regions"]

_SET_GRAD = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
"""export's node for a region run under ``torch.no_grad()`` (Llama's rotary embedding)."""


def inline_grad_regions(program: ExportedProgram) -> None:
    """Copies each ``torch.no_grad()`` region's operations into the graph, outputs detached.

    Why: export keeps such a region as a sub-graph behind one higher-order
    operation, which a cut could not split nor the profiler time. Inlined, its
    operations are ordinary ones reading detached inputs (so none records a
    graph, and an ``out=`` operation, spectral norm's power iteration, runs as
    under ``no_grad``) and its outputs are detached: no gradient crosses it;
    the values are the same.
    """
    if _SET_GRAD is None:
        return
    gm, graph = program.graph_module, program.graph_module.graph
    while regions := [n for n in graph.nodes if n.op == "call_function" and n.target is _SET_GRAD]:
        node = regions[0]
        enabled, holder, *operands = node.args
        sub = getattr(gm, holder.target)
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        results: list[Any] = []
        with graph.inserting_before(node):
            for placeholder, operand in zip(placeholders, operands, strict=True):
                if not enabled and isinstance(operand, fx.Node) and _tensor(operand):
                    operand = _detached(graph, operand)  # (an out= operation refuses grad)
                env[placeholder] = operand
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    results = list(pytree.tree_leaves(n.args[0]))
                    continue
                if n.op == "get_attr":  # a nested region's sub-graph: held by the top module
                    name = f"{holder.target}_{n.target}".replace(".", "_")
                    setattr(gm, name, getattr(sub, n.target))
                    env[n] = graph.get_attr(name)
                    continue
                env[n] = graph.node_copy(n, env.__getitem__)
            for i, out in enumerate(results):
                value = env[out] if isinstance(out, fx.Node) else out
                if not enabled and isinstance(value, fx.Node):
                    value = _detached(graph, value)
                results[i] = value
        for user in list(node.users):  # operator.getitem(node, i)
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not holder.users:
            graph.erase_node(holder)
    gm.recompile()


def _tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _detached(graph: fx.Graph, value: fx.Node) -> fx.Node:
    detached = graph.call_function(torch.ops.aten.detach.default, (value,))
    detached.meta = dict(value.meta)
    return detached
