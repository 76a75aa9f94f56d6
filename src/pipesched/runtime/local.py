"""The local runtime: every worker of a schedule in one process, one thread each.

One worker per schedule worker, not per device: two stages on "cpu" run in
two threads, truly in parallel. Values cross between workers through a
:class:`~pipesched.runtime.mailbox.Mailbox` (with CUDA events where stages
sit on GPUs); the loop that runs each worker is the interpreter every
runtime shares (:mod:`pipesched.runtime.interpreter`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from pipesched.runtime.interpreter import Interpreter
from pipesched.runtime.link import TransferStats
from pipesched.runtime.mailbox import Mailbox
from pipesched.runtime.passes import StagePasses, StepInputs, StepState
from pipesched.runtime.stage.seeding import StageSeeding
from pipesched.runtime.threads import current_cpu
from pipesched.runtime.turns import Turns
from pipesched.schedule import Schedule

__all__ = ["LocalRuntime"]


class LocalRuntime:
    """Runs schedules over stage modules placed on devices, in one process.

    Args:
        stages: the stage modules, ``stages[s]`` already on ``devices[placement[s]]``.
        devices: the device of each schedule worker.
        placement: the worker of each stage.
        num_threads: intra-op threads each worker may use.
        seeding: as in :class:`~pipesched.runtime.passes.StagePasses`.
        fused: as in :class:`~pipesched.runtime.passes.StagePasses`.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device],
        placement: Sequence[int],
        num_threads: int,
        seeding: Sequence[StageSeeding],
        fused: Sequence[frozenset[int]] | None = None,
    ) -> None:
        self.passes = StagePasses(stages, devices, placement, seeding, fused)
        self.interpreter = Interpreter(self.passes, num_threads)
        self.stats = TransferStats()
        # On CUDA an action's time on the CPU is only its kernels' launch: no turns there.
        self.turns = Turns() if all(d.type == "cpu" for d in devices) else None
        """Whether workers take turns (:mod:`pipesched.runtime.turns`); None: never."""

    def run(self, schedule: Schedule, step: StepInputs, *, detach: bool) -> StepState:
        """Runs every worker's actions of ``schedule`` (only F where ``step.loss_fn`` is None).

        Raises:
            BaseException: the first exception of any worker, with a note naming
                the stage, micro-batch and worker; every other worker has stopped.
        """
        workers = range(schedule.num_workers)
        forward_only = step.loss_fn is None
        policy = self.turns if len(workers) > 1 else None
        turns = policy is not None and policy.choose(forward_only)
        box, one_cpu = Mailbox(hold=turns), current_cpu() if turns else None
        start, busy = time.perf_counter(), time.process_time()
        state = self.interpreter.run(schedule, step, box, workers, detach=detach, cpu=one_cpu)
        if policy is not None and state.events:
            seconds = time.perf_counter() - start
            cores = (time.process_time() - busy) / seconds
            policy.measured(forward_only, turns, seconds / len(state.events), cores)
        return state
