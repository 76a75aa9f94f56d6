"""Timelines as Chrome trace-event JSON, for Perfetto and chrome://tracing.

Why not torch's: torch.distributed.pipelining writes unit durations, so its
traces show the order of actions but not their real length. Here each action
is a complete event with its real start and duration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipesched.errors import ConfigTypeError
from pipesched.schedule import Timeline, data_predecessor
from pipesched.viz._units import time_unit

__all__ = ["chrome_trace", "trace_events"]

_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def chrome_trace(timeline: Timeline, path: str | Path, *, unit: str | None = None) -> Path:
    """Writes ``timeline`` as a trace that https://ui.perfetto.dev and chrome://tracing open.

    One process per worker ("worker 0", ...), one complete event (``"ph": "X"``)
    per action with ``ts`` and ``dur`` in microseconds from the first action's start,
    its name in the short form (``"2F0"``) and stage, kind and micro-batch in
    ``args``; plus a counter per stage of the micro-batches whose activations
    it holds; and a flow arrow (``"ph": "s"`` at the producer's end, ``"f"`` at the
    consumer's start, one id per pair) for each value that crosses between workers.

    Args:
        timeline: measured (seconds) or simulated.
        path: the JSON file to write; missing folders are made.
        unit: ``"s"`` when the times are seconds, ``"units"`` for a plan in
            abstract units (drawn as 1 ms each); None guesses as :func:`pipesched.viz.gantt` does.

    Returns:
        ``path``.

    Raises:
        ConfigError: ``timeline`` is not a Timeline, or ``unit`` is unknown.

    Example:
        >>> import json, tempfile, pathlib
        >>> from pipesched.schedule import get_schedule
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "trace.json"
        >>> plan = get_schedule("gpipe", 2, 2).simulate()
        >>> data = json.loads(chrome_trace(plan, path).read_text())
        >>> sum(e["ph"] == "X" for e in data["traceEvents"])
        8
    """
    path = Path(path)
    document = trace_events(timeline, unit=unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, separators=(",", ":")))
    return path


def trace_events(timeline: Timeline, *, unit: str | None = None) -> dict[str, Any]:
    """The trace-event document :func:`chrome_trace` writes, as a dict."""
    if not isinstance(timeline, Timeline):
        raise ConfigTypeError(
            f"timeline must be a Timeline, got {type(timeline).__name__}; simulate a "
            "Schedule first (schedule.simulate(costs)) or use pipe.last_timeline"
        )
    u = time_unit([timeline], unit)
    origin = timeline.start

    def micros(t: float) -> float:
        return round((t - origin) * u.micros, 3)

    events: list[dict[str, Any]] = []
    for w in range(timeline.num_workers):
        stages = [s for s, p in enumerate(timeline.placement) if p == w]
        name = f"worker {w} (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"
        events += [
            {"ph": "M", "name": "process_name", "pid": w, "tid": 0, "args": {"name": name}},
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": w,
                "tid": 0,
                "args": {"sort_index": w},
            },
            {"ph": "M", "name": "thread_name", "pid": w, "tid": 0, "args": {"name": "actions"}},
        ]
    for e in sorted(timeline.events, key=lambda e: (e.worker, e.start, e.end)):
        a = e.action
        events.append(
            {
                "ph": "X",
                "name": str(a),
                "cat": _KIND_NAMES.get(a.kind, a.kind),
                "pid": e.worker,
                "tid": 0,
                "ts": micros(e.start),
                "dur": round(e.duration * u.micros, 3),
                "args": {"stage": a.stage, "kind": a.kind, "microbatch": a.microbatch},
            }
        )
    events += _flows(timeline, micros)
    for stage, points in enumerate(timeline.activations_over_time):
        for t, held in points:
            events.append(
                {
                    "ph": "C",
                    "name": f"held activations, stage {stage}",
                    "pid": timeline.placement[stage],
                    "ts": micros(t),
                    "args": {"micro-batches": held},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "pipesched",
            "time unit": "seconds" if u.name == "s" else "time units, shown as 1 ms each",
            "makespan": timeline.makespan,
            "bubble fraction": timeline.bubble_fraction,
        },
    }


def _flows(timeline: Timeline, micros: Any) -> list[dict[str, Any]]:
    """A flow pair per transfer between workers: from the producer's end to the consumer's start."""
    producers = {tuple(e.action): e for e in timeline.events}
    flows: list[dict[str, Any]] = []
    for e in sorted(timeline.events, key=lambda e: (e.start, e.worker)):
        need = data_predecessor(e.action, timeline.num_stages)
        source = producers.get(need) if need is not None else None
        if source is None or source.worker == e.worker:
            continue
        n = len(flows) // 2
        common = {"name": "transfer", "cat": "transfer", "id": n, "tid": 0}
        flows += [
            {**common, "ph": "s", "pid": source.worker, "ts": micros(source.end)},
            {**common, "ph": "f", "bp": "e", "pid": e.worker, "ts": micros(e.start)},
        ]
    return flows
