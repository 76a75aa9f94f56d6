"""V-Half and V-Min: V schedules with 1/2 and 1/3 of 1F1B's activation memory.

A port of Qi et al., 2024, "Pipeline Parallelism with Controllable Memory"
(sail-sg/zero-bubble-pipeline-parallelism, ``zbv_greedy.py``): a building block
repeated every 6 slots, its offsets setting the memory, squeezed twice by a greedy
pass and its holes filled with Ws. The reference's ``F f B b W w`` on worker ``w``
are F of stage ``w``, F of ``2p-1-w``, B of ``2p-1-w``, B of ``w``, and their Ws.
"""

from __future__ import annotations

from collections.abc import Callable

from pipesched.errors import ConfigError
from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.builders.argument_checks import (
    check_count,
    check_schedule_size,
    check_v_stages,
)
from pipesched.schedule.schedule import Schedule

__all__ = ["MAX_SQUEEZE", "check_squeeze_work", "v_half", "v_min"]

MAX_SQUEEZE = 4_000_000
"""The most squeeze steps (``p^2 m``) v-half and v-min take on: about a minute."""
_PERIOD = 6  # slots per building block: the six passes of one micro-batch on a worker
# Type t of the reference on worker w: (stage on the down (0) or up (1) side, kind).
_TYPES = ((0, FORWARD), (1, FORWARD), (1, BACKWARD), (0, BACKWARD), (1, WEIGHT), (0, WEIGHT))
_MEMORY = (1, 1, 0, 0, -1)  # activations a pass of each type adds (the W type: one list)

Slots = list[list[int]]  # a worker's slot of each micro-batch, one list per type


def v_half(num_stages: int, num_microbatches: int) -> Schedule:
    """V-Half (Qi et al., 2024): a V with about half of 1F1B's peak activations.

    ``p = num_stages / 2`` workers, worker ``w`` runs stages ``w`` and
    ``2p-1-w`` as in ZB-V. The building block of worker ``w`` puts F down at
    slot ``2w``, F up at ``3p-w-2``, B up at ``3p+e+2w-1``, B down at
    ``6p+e-w-2`` (``e = 3`` for even ``p``, else 0), repeating every 6 slots;
    then squeezed and W-filled (module docstring). With ``m >= 2p`` each
    worker peaks at ``floor(p/2) + 1`` whole shares (1F1B: ``p``); the
    bubble at equal costs lies between ZB-V's and interleaved 1F1B's.

    Example (4 stages on 2 workers, m=2; worker rows):
        >>> s = v_half(4, 2)
        >>> s.placement
        (0, 1, 1, 0)
        >>> print(s.to_csv(), end="")
        0F0,0F1,3F0,3B0,3W0,3F1,0B0,3B1,3W1,0W0,0B1,0W1
        1F0,2F0,1F1,2F1,2B0,2W0,1B0,1W0,2B1,2W1,1B1,1W1
    """
    return _build("v-half", num_stages, num_microbatches, _v_half_block)


def v_min(num_stages: int, num_microbatches: int) -> Schedule:
    """V-Min (Qi et al., 2024): a V with about a third of 1F1B's peak activations.

    Placement as :func:`v_half`. The building block of worker ``w`` puts F
    down at slot ``w``, F up at ``2p-w-1``, B up at ``2p+e+w``, B down at
    ``4p+e-w-1`` (``e = 2`` when 3 divides ``p``, else 0), repeating every 6
    slots; then squeezed and W-filled. With ``m >= 2p`` each worker peaks at
    ``floor((p+4)/3)`` whole shares (1F1B: ``p``); the bubble is about
    1F1B's (the paper: V-Min's throughput is close to 1F1B's, and it
    degrades when F, B and W differ).

    Example (4 stages on 2 workers, m=2; worker rows):
        >>> s = v_min(4, 2)
        >>> print(s.to_csv(), end="")
        0F0,0F1,3F0,3B0,3W0,0B0,0W0,3F1,3B1,3W1,0B1,0W1
        1F0,2F0,2B0,1B0,1F1,2F1,2W0,1W0,2B1,1B1,2W1,1W1
    """
    return _build("v-min", num_stages, num_microbatches, _v_min_block)


def check_squeeze_work(name: str, num_stages: int, num_microbatches: int) -> None:
    """A ConfigError when squeezing the building blocks would take more than about a minute.

    The squeeze re-measures a worker's whole memory profile (``O(m)``) for
    each pass it moves, and it moves the passes of the ramps, ``O(p)`` per
    worker: about ``p^2 m`` steps, 10-15 us each on a 2-core machine (29 s
    for V-Half at 64 workers x 512 micro-batches). Past :data:`MAX_SQUEEZE`
    steps it refuses rather than run for minutes.

    Example:
        >>> check_squeeze_work("v-half", 128, 512)  # 64 workers: 2.1M steps
        >>> check_squeeze_work("v-half", 256, 512)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pipesched.errors.ConfigError: v-half: building 128 workers x 512 micro-batches ...
    """
    p = num_stages // 2
    work = p * p * num_microbatches
    if work > MAX_SQUEEZE:
        raise ConfigError(
            f"{name}: building {p} workers x {num_microbatches} micro-batches squeezes "
            f"about p^2 m = {work} steps, more than {MAX_SQUEEZE} (about a minute); use fewer "
            "workers or micro-batches per step (accumulate gradients over several steps), "
            "or zb-v"
        )


def _v_min_block(p: int) -> list[list[int]]:
    e = 2 if p % 3 == 0 else 0
    return [[w, 2 * p - w - 1, 2 * p + e + w, 4 * p + e - w - 1] for w in range(p)]


def _v_half_block(p: int) -> list[list[int]]:
    e = 3 if p % 2 == 0 else 0
    return [[2 * w, 3 * p - w - 2, 3 * p + e + 2 * w - 1, 6 * p + e - w - 2] for w in range(p)]


def _build(
    name: str, num_stages: int, num_microbatches: int, block: Callable[[int], list[list[int]]]
) -> Schedule:
    """The schedule of the building block ``block(p)``, squeezed twice, Ws placed."""
    n = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    p = check_v_stages(name, n)
    check_schedule_size(name, n, m, 3)
    check_squeeze_work(name, n, m)
    slots = [[list(range(x, x + _PERIOD * m, _PERIOD)) for x in offsets] for offsets in block(p)]
    squeezed = _squeeze(slots, with_weights=True)
    squeezed = _squeeze([s[:4] for s in squeezed], with_weights=False)
    final = [[*s[:4], *_weights(s[:4], split=True)] for s in squeezed]
    rows = []
    for w, worker in enumerate(final):
        stage = (w, n - 1 - w)
        timed = sorted((t, k, i) for k, times in enumerate(worker) for i, t in enumerate(times))
        rows.append(tuple(Action(stage[_TYPES[k][0]], _TYPES[k][1], i) for _, k, i in timed))
    placement = tuple(s if s < p else n - 1 - s for s in range(n))
    return Schedule(tuple(rows), placement, m, name)


def _weights(worker: Slots, *, split: bool) -> list[list[int]]:
    """Slots for the Ws of a worker's four pass lists: each hole takes the oldest pending W.

    Holes before the last pass take pending Ws (those of ``B`` before those
    of ``b`` when ``split``), the rest go after it. One W list when not
    ``split`` (the reference's ``put_w``).
    """
    events = sorted((t, k) for k, times in enumerate(worker) for t in times)
    lists: list[list[int]] = [[], []]
    pending = [0, 0]
    slot = 0
    for t, k in events:
        while slot < t:  # a hole
            for j in (0, 1):
                if pending[j]:
                    lists[j].append(slot)
                    pending[j] -= 1
                    break
            slot += 1
        if k >= 2:
            pending[k - 2 if split else 0] += 1
        slot = t + 1
    for j in (0, 1):
        for _ in range(pending[j]):
            lists[j].append(slot)
            slot += 1
    return lists if split else lists[:1]


def _peak(worker: Slots) -> int:
    """A worker's peak activations (in stage micro-batches) when it runs its passes at these slots.

    F adds one, a W removes one; with four lists (no Ws placed yet) each hole
    runs a pending W (the reference's ``mem_of_stage``).
    """
    implicit = len(worker) == 4
    events = sorted((t, k) for k, times in enumerate(worker) for t in times)
    held = peak = pending = 0
    previous = -1
    for t, k in events:
        if implicit:
            done = min(pending, t - previous - 1)
            held -= done
            pending -= done
            if k >= 2:
                pending += 1
        held += _MEMORY[k]
        peak = max(peak, held)
        previous = t
    return peak


def _need(slots: list[Slots], w: int, k: int, i: int) -> list[int]:
    """The slots of what pass ``(w, k, i)`` waits for (the reference's dependencies)."""
    p = len(slots)
    own = slots[w]
    need = []
    if k in (0, 2) and w > 0:
        need.append(slots[w - 1][k][i])
    if k in (1, 3) and w + 1 < p:
        need.append(slots[w + 1][k][i])
    if 0 < k < 4:
        need.append(own[k - 1][i])
    if k == 4:
        need.append(sorted(own[2] + own[3])[i])
    if i > 0:
        need.append(own[k][i - 1])
    return need


def _squeeze(slots: list[Slots], *, with_weights: bool) -> list[Slots]:
    """The reference's ``reorder``: pull passes into earlier holes without raising peak memory.

    Passes are visited in slot order. Before worker 0's first ``b``
    (``with_weights`` only) and after the last ``F`` of the first worker to
    finish its forwards, a pass moves to the earliest free slot after what it
    waits for, if the worker's peak memory stays at most the block's. Then
    Ws are placed in the holes, and the slots are replaced by the start
    times of an as-soon-as-possible run at unit costs.
    """
    slots = [[list(times) for times in worker] for worker in slots]
    if with_weights:
        slots = [[*worker, *_weights(worker, split=False)] for worker in slots]
    limit = max(_peak(worker) for worker in slots)
    size = 1 + max(t for worker in slots for times in worker for t in times)
    taken = [[False] * size for _ in slots]
    visits = sorted(
        (t, w, k, i)
        for w, worker in enumerate(slots)
        for k, times in enumerate(worker)
        for i, t in enumerate(times)
    )
    phase = 0
    last_forward = len(slots[0][0]) - 1
    for t, w, k, i in visits:
        if phase == 0 and k == 3 and w == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not with_weights):
            if phase == 1 and k == 0 and i == last_forward:
                phase = 2
            taken[w][t] = True
            continue
        earliest = max(_need(slots, w, k, i), default=-1) + 1
        for candidate in range(earliest, t):
            if not taken[w][candidate]:
                slots[w][k][i] = candidate
                if _peak(slots[w]) <= limit:
                    break
        else:
            slots[w][k][i] = t
        taken[w][slots[w][k][i]] = True
    if not with_weights:
        slots = [[*worker, *_weights(worker, split=False)] for worker in slots]
    return _as_soon_as_possible(slots)


def _as_soon_as_possible(slots: list[Slots]) -> list[Slots]:
    """Start times at unit costs, each worker keeping its slot order (the reference's squeeze)."""
    p = len(slots)
    end: dict[tuple[int, int, int], int] = {}
    free = [0] * p
    starts = [[[0] * len(times) for times in worker] for worker in slots]
    visits = sorted(
        (t, w, k, i)
        for w, worker in enumerate(slots)
        for k, times in enumerate(worker)
        for i, t in enumerate(times)
    )
    for _, w, k, i in visits:
        ready = free[w]
        if k in (0, 2) and w > 0:
            ready = max(ready, end[w - 1, k, i])
        if k in (1, 3) and w + 1 < p:
            ready = max(ready, end[w + 1, k, i])
        if 0 < k < 4:
            ready = max(ready, end[w, k - 1, i])
        if i > 0:
            ready = max(ready, end[w, k, i - 1])
        starts[w][k][i] = ready
        end[w, k, i] = free[w] = ready + 1
    return starts
