"""The stage graph: nodes, costs, the edges of skip connections, the printed partition."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.partition import layer_graph, layers, simulate_partition
from pipesched.partition.report import SIMULATED_NOTE
from tests.partition.models import UNet


@pytest.fixture(scope="module")
def unet_pipe() -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        UNet(), chunks=2, example_inputs=(torch.randn(2, 3, 16, 16),), devices=["cpu"] * 2
    )


def test_traced_graph_nodes_carry_costs(unet_pipe):
    graph = unet_pipe.stage_graph
    assert isinstance(graph, nx.DiGraph) and nx.is_directed_acyclic_graph(graph)
    ops = [d for _, d in graph.nodes(data=True) if d["kind"] == "op"]
    conv = next(d for d in ops if d["target"] == "aten.conv2d.default" and d["layer"] == "stem")
    assert conv["params"] == ("stem.weight", "stem.bias")
    assert conv["param_bytes"] == 4 * (4 * 3 * 3 * 3 + 4)
    assert conv["activation_bytes"] == 4 * 2 * 4 * 16 * 16  # fp32, the example's 2 rows
    assert conv["forward_time"] > 0 and conv["backward_time"] > 0
    assert sum(d["param_bytes"] for d in ops if len(d["params"]) == 2) > 0
    total = sum(graph.graph["param_bytes"].values())
    assert total == sum(4 * p.numel() for p in unet_pipe.parameters())


def test_skip_connections_are_edges_between_distant_layers(unet_pipe):
    graph = unet_pipe.stage_graph
    names = [layer.name for layer in layers(graph)]
    assert names == ["stem", "down.0", "down.1", "down.2", "up.0", "up.1", "up.2", "head"]
    contracted = layer_graph(graph)
    # Each encoder level's input skips to the decoder level of its resolution.
    for source, target in [("stem", "up.2"), ("down.0", "up.1"), ("down.1", "up.0")]:
        assert contracted.has_edge(source, target), (source, target)
    stem_to_up = contracted.edges["stem", "up.2"]["bytes"]
    assert stem_to_up == 4 * 2 * 4 * 16 * 16  # the stem's output, as big as it was made
    op_edges = [
        (u, v)
        for u, v in graph.edges
        if graph.nodes[u].get("layer") == "stem" and graph.nodes[v].get("layer") == "up.2"
    ]
    assert op_edges and all(graph.edges[e]["bytes"] == stem_to_up for e in op_edges)
    chain = [("down.0", "down.1"), ("down.2", "up.0"), ("up.2", "head"), ("head", "<output>")]
    assert all(contracted.has_edge(*e) for e in chain)


def test_sequential_graph_is_a_chain():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = Pipeline(model, 2, balance=[2, 1], devices=["cpu", "cpu"])
    graph = pipe.stage_graph
    assert list(nx.topological_sort(graph)) == ["<input:x>", "0", "1", "2", "<output>"]
    assert graph.nodes["0"]["param_bytes"] == 4 * (4 * 8 + 8)
    assert graph.nodes["0"]["forward_time"] is None  # no example: parameters only
    assert pipe.partition.counts == (2, 1)
    text = str(pipe.partition)
    assert "balance='explicit'" in text and "0, 1" in text


def test_sequential_with_example_is_measured():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = Pipeline(
        model, 2, devices=["cpu", "cpu"], balance="time", example_inputs=(torch.randn(3, 4),)
    )
    graph = pipe.stage_graph
    assert graph.edges["0", "1"]["bytes"] == 4 * 3 * 8
    assert graph.edges["<input:x>", "0"]["bytes"] == 4 * 3 * 4
    assert all(graph.nodes[n]["forward_time"] > 0 for n in ("0", "1", "2"))


def test_partition_table_explains_the_stages(unet_pipe):
    partition = unet_pipe.partition
    assert partition.balance == "time" and sum(partition.counts) == 8
    assert [s.index for s in partition.stages] == [0, 1]
    first = partition.stages[0]
    assert first.layers[0] == "stem" and first.device == "cpu"
    assert first.params == sum(
        p.numel()
        for n, p in unet_pipe.named_parameters()
        if any(n.startswith(f"{layer}.") for layer in first.layers)
    )
    assert first.held_microbatches == 2  # GPipe holds every micro-batch
    assert first.peak_activation_bytes == 2 * first.activation_bytes
    assert partition.simulated is not None and partition.simulated.makespan > 0
    what_if = simulate_partition(unet_pipe.stage_graph, list(partition.counts), "gpipe", 2)
    assert what_if.makespan == pytest.approx(partition.simulated.makespan)
    lines = str(partition).splitlines()
    assert lines[0].startswith("2 stages, balance='time', schedule 'gpipe', 2 micro-batches")
    assert lines[1].split()[:3] == ["stage", "device", "layers"]
    assert lines[-len(SIMULATED_NOTE) - 1].startswith("simulated step:")
    assert tuple(lines[-len(SIMULATED_NOTE) :]) == SIMULATED_NOTE


def test_partition_table_says_what_its_simulated_step_leaves_out(unet_pipe):
    """Not a timing: the words under the number name what it counts and what it does not."""
    text = str(unet_pipe.partition)
    simulated = text[text.index("simulated step:") :]
    for included in ("fwd/bwd ms above", "timed alone on the example", "schedule's order"):
        assert included in simulated
    left_out = simulated[simulated.index("leaves out:") :]
    for missing in ("recomputation", "the loss", "thread hand-offs", "other processes"):
        assert missing in left_out
    assert "pipe.last_timeline.makespan" in left_out and "2-5x" in left_out


def test_unprofiled_table_says_there_is_no_simulated_step():
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), 2, devices=["cpu", "cpu"])
    assert pipe.partition.simulated is None
    last = str(pipe.partition).splitlines()[-1]
    assert last.startswith("simulated step: none, times not measured")
    assert "balance='time'" in last
