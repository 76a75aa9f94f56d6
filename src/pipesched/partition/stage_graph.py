"""The stage graph: a networkx DiGraph of a model's layers or traced operations, with costs.

Nodes carry ``kind``, ``target``, ``module``, ``layer``, ``order``, ``params`` and
measured costs; edges carry ``bytes``. Why layers on top of operations: cutting
between any two operations is valid but rarely wise, so cuts fall between layers
(the outermost container element or leaf module that ran an operation), which
:func:`layer_graph` contracts the graph onto. docs/partitioning.md has the table.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from pipesched.partition.profile import NodeCost
from pipesched.partition.sequential import sequential_layers
from pipesched.partition.trace import TracedModel

__all__ = ["INPUT", "OUTPUT", "Layer", "layer_graph", "layers", "sequential_graph", "traced_graph"]

INPUT = "<input:{}>"
"""Name pattern of an input node."""
OUTPUT = "<output>"
"""Name of the output node."""
TOP = "(model)"
"""Layer name of operations the model's own forward runs, outside any submodule."""

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class Layer:
    """One unit of the stage graph: the smallest piece a cut does not split.

    Args:
        name: the layer's module name (``"transformer.h.0"``), ``"(model)"``
            for operations of the model's own forward; ``@k`` marks its k-th
            separate run.
        nodes: its nodes, in execution order.
        params: names of the parameters it uses.
        param_bytes: their bytes, each parameter counted once.
        forward_time, backward_time: sums over its nodes (None: not profiled).
        activation_bytes: bytes of new storage its nodes allocate.
        split_bytes: bytes it holds between a split backward's B and W (None:
            not measured; see :class:`~pipesched.partition.profile.NodeCost`).
    """

    name: str
    nodes: tuple[Any, ...]
    params: frozenset[str]
    param_bytes: int
    forward_time: float | None
    backward_time: float | None
    activation_bytes: int | None
    split_bytes: int | None = None


def sequential_graph(
    module: nn.Sequential, costs: list[NodeCost] | None = None, input_bytes: int | None = None
) -> nx.DiGraph:
    """The stage graph of an ``nn.Sequential``: a chain of its layers.

    Args:
        module: the model.
        costs: per layer, from :func:`~pipesched.partition.profile.measure_sequential`;
            None gives a graph of parameters only.
        input_bytes: bytes of the example input (the first edge's size).
    """
    graph = _new_graph(module, "sequential")
    names = {id(p): n for n, p in module.named_parameters()}
    previous = INPUT.format("x")
    graph.add_node(previous, kind="input", order=-1, layer=None, output_bytes=input_bytes)
    for order, (name, layer) in enumerate(sequential_layers(module)):
        params = tuple(names[id(p)] for p in layer.parameters() if id(p) in names)
        graph.add_node(
            name,
            kind="layer",
            target=type(layer).__name__,
            module=name,
            layer=name,
            unit=order,
            order=order,
            params=params,
            param_bytes=sum(graph.graph["param_bytes"][p] for p in params),
            **_cost_attributes(costs[order] if costs else None),
        )
        graph.add_edge(previous, name, bytes=graph.nodes[previous]["output_bytes"])
        previous = name
    graph.add_node(OUTPUT, kind="output", order=len(module), layer=None)
    graph.add_edge(previous, OUTPUT, bytes=graph.nodes[previous]["output_bytes"])
    return graph


def traced_graph(
    traced: TracedModel,
    costs: Mapping[str, NodeCost] | None = None,
    boundaries: Collection[int] = (),
) -> nx.DiGraph:
    """The stage graph of a traced model: its operations, grouped into layers.

    Args:
        traced: the trace.
        costs: per node name (operations and user inputs), from
            :func:`~pipesched.partition.profile.measure_traced`.
        boundaries: op positions where a new unit starts even inside a layer
            (explicit split points that name a module inside a layer).
    """
    costs = costs or {}
    modules = dict(traced.model.named_modules())
    graph = _new_graph(traced.model, "traced")
    for node in traced.inputs:
        cost = costs.get(node.name)
        graph.add_node(
            INPUT.format(node.name),
            kind="input",
            order=-1,
            layer=None,
            output_bytes=cost.output_bytes if cost else None,
        )
    found = [_layer_of(node, modules) for node in traced.ops]
    names = _attach_shape_arithmetic(traced.ops, [layer for layer, _ in found])
    runs: dict[str, int] = {}
    previous, unit = None, -1
    for order, node in enumerate(traced.ops):
        layer, innermost = names[order], found[order][1]
        if layer != previous or order in boundaries:
            unit += 1
            runs[layer] = runs.get(layer, 0) + 1
            previous = layer
        params = tuple(
            ref.name
            for n in node.all_input_nodes
            if (ref := traced.state.get(n)) is not None and ref.kind == "parameter"
        )
        graph.add_node(
            node.name,
            kind="op",
            target=str(node.target),
            module=innermost,
            layer=layer if runs[layer] == 1 else f"{layer}@{runs[layer] - 1}",
            unit=unit,
            order=order,
            params=params,
            param_bytes=sum(graph.graph["param_bytes"].get(p, 0) for p in params),
            **_cost_attributes(costs.get(node.name)),
        )
        for source in node.all_input_nodes:
            if source not in traced.state:
                name = _node_name(source)
                graph.add_edge(name, node.name, bytes=graph.nodes[name]["output_bytes"])
    graph.add_node(OUTPUT, kind="output", order=len(traced.ops), layer=None)
    for value in traced.outputs:
        if isinstance(value, fx.Node) and _node_name(value) in graph:
            name = _node_name(value)
            graph.add_edge(name, OUTPUT, bytes=graph.nodes[name]["output_bytes"])
    return graph


def layers(graph: nx.DiGraph) -> list[Layer]:
    """The graph's layers (cut units) in execution order, with their summed costs."""
    members: dict[int, list[tuple[int, Any]]] = {}
    for node, data in graph.nodes(data=True):
        if data.get("unit") is not None:
            members.setdefault(data["unit"], []).append((data["order"], node))
    sizes = graph.graph["param_bytes"]
    result = []
    for unit in sorted(members):
        nodes = tuple(n for _, n in sorted(members[unit]))
        data = [graph.nodes[n] for n in nodes]
        params = frozenset(p for d in data for p in d["params"])
        result.append(
            Layer(
                name=data[0]["layer"],
                nodes=nodes,
                params=params,
                param_bytes=sum(sizes.get(p, 0) for p in params),
                forward_time=_total(d["forward_time"] for d in data),
                backward_time=_total(d["backward_time"] for d in data),
                activation_bytes=_total(d["activation_bytes"] for d in data),
                split_bytes=_total(d.get("split_bytes") for d in data),
            )
        )
    return result


def layer_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """The graph contracted onto its layers (``networkx.quotient_graph``).

    Nodes are layer names (plus the input and output nodes); an edge ``a -> b``
    carries ``bytes``, the sum over the operation edges from ``a`` to ``b``, so a
    skip connection shows as an edge between distant layers.
    """
    block = {n: d["layer"] if d.get("layer") is not None else n for n, d in graph.nodes(data=True)}
    partition: dict[str, set[Any]] = {}
    for node, name in block.items():
        partition.setdefault(name, set()).add(node)

    def edge_data(b1: frozenset[Any], b2: frozenset[Any]) -> dict[str, Any]:
        total = sum(graph.edges[u, v]["bytes"] or 0 for u in b1 for v in graph[u] if v in b2)
        return {"bytes": total}

    quotient = nx.quotient_graph(graph, list(partition.values()), edge_data=edge_data)
    names = {frozenset(nodes): name for name, nodes in partition.items()}
    return nx.relabel_nodes(quotient, lambda b: names[b])


def _layer_of(node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[str, str]:
    """(the layer, the innermost module) an operation belongs to; see the module docstring."""
    stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    stack = [p for p in stack if p and p in modules]  # the model itself is ""
    innermost = stack[-1] if stack else ""
    for path in stack:
        module = modules.get(path)
        parent = modules.get(path.rpartition(".")[0])
        if module is not None and (
            isinstance(parent, _CONTAINERS) or next(module.children(), None) is None
        ):
            return path, innermost
    return innermost or TOP, innermost


def _attach_shape_arithmetic(ops: Sequence[fx.Node], names: list[str]) -> list[str]:
    """Layer names with shape arithmetic (``sym_size`` and the like, no tensor made) joined
    to the layer before it, or after it at the start: no layer of its own for it."""
    tensor = [isinstance(n.meta.get("val"), torch.Tensor) for n in ops]
    result = list(names)
    last = next((names[i] for i in range(len(ops)) if tensor[i]), None)
    for i in range(len(ops)):
        if tensor[i]:
            last = result[i]
        elif last is not None:
            result[i] = last
    return result


def _new_graph(model: nn.Module, kind: str) -> nx.DiGraph:
    """An empty stage graph; ``graph.graph["param_bytes"]`` maps each parameter name to bytes."""
    sizes = {name: _nbytes(p) for name, p in model.named_parameters(remove_duplicate=False)}
    return nx.DiGraph(model=type(model).__name__, kind=kind, param_bytes=sizes)


def _node_name(node: fx.Node) -> str:
    return INPUT.format(node.name) if node.op == "placeholder" else node.name


def _cost_attributes(cost: NodeCost | None) -> dict[str, Any]:
    if cost is None:
        return {
            "forward_time": None,
            "backward_time": None,
            "activation_bytes": None,
            "split_bytes": None,
            "output_bytes": None,
        }
    return {
        "forward_time": cost.forward,
        "backward_time": cost.backward,
        "activation_bytes": cost.activation_bytes,
        "split_bytes": cost.split_bytes,
        "output_bytes": cost.output_bytes,
    }


def _total(values: Any) -> Any:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
