"""What the ranks of one pipeline agree on at every step's start, in one small all-gather.

Why: each rank cuts its own batch and builds its own schedule, so ranks given
different batches would wait for transfers that never come. Every pp rank shares a
:class:`StepShape`; a difference fails all at once with one message. The same
exchange hands out the step's seed, which every rank must share.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipesched.errors import ConfigError
from pipesched.runtime.stage.tree import tensors
from pipesched.schedule import Schedule

__all__ = ["StepShape", "agreed_seed", "batch_digest", "mismatch"]

_NAME_WORDS = 4  # a schedule's name travels as up to 32 bytes
_MAGIC = 0x5049_5045  # the first integer: tells a pipesched agreement from anything else


@dataclass(frozen=True)
class StepShape:
    """One rank's view of a step: what every pp rank must share, and its drawn seed.

    Attributes:
        training: whether the step runs backward (``step``/``accumulate``) or
            only forward (``pipe(x)``).
        num_microbatches: micro-batches the rank's batch was cut into.
        schedule: the schedule's name.
        num_stages: stages of the schedule.
        fingerprint: a checksum of the schedule's whole action table.
        has_target: whether a loss target was given.
        seed: the seed this rank drew for random layers (0: none drawn).
        weights: a checksum of the micro-batches' loss weights (their rows
            or ``num_items``; 0 for forward only): a rank given micro-batches
            of other sizes would weigh the loss otherwise, silently.
        shapes: a checksum of the micro-batches' input shapes, where the
            transport posts receives by them (NCCL's ordering); else 0.
        contents: a checksum of the micro-batches' inputs and targets, their
            bits (:func:`batch_digest`): a rank given another batch of the same
            size (one that skipped a batch) would train on mismatched data.
    """

    training: bool
    num_microbatches: int
    schedule: str
    num_stages: int
    fingerprint: int
    has_target: bool
    seed: int
    weights: int = 0
    shapes: int = 0
    contents: int = 0

    @classmethod
    def of(
        cls,
        schedule: Schedule,
        *,
        training: bool,
        has_target: bool,
        seed: int,
        weights: Sequence[float] = (),
        shapes: object = None,
        contents: int = 0,
    ) -> StepShape:
        """The shape of a step running ``schedule`` with these micro-batch loss ``weights``.

        ``shapes``: what the ranks' micro-batch input shapes must agree on
        (any value with a stable ``repr``), or None.
        """
        return cls(
            training=training,
            num_microbatches=schedule.num_microbatches,
            schedule=schedule.name,
            num_stages=schedule.num_stages,
            fingerprint=_fingerprint(schedule),
            has_target=has_target,
            seed=seed,
            weights=zlib.crc32(struct.pack(f"<{len(weights)}d", *weights)) if weights else 0,
            shapes=0 if shapes is None else zlib.crc32(repr(shapes).encode()),
            contents=contents,
        )

    def encode(self) -> torch.Tensor:
        """The shape as a small int64 tensor (what the all-gather carries)."""
        if not -(2**63) <= self.seed < 2**63:
            raise ConfigError(f"a step's seed must fit in 64 signed bits, got {self.seed}")
        name = self.schedule.encode()[: 8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b"\0")
        words = [int.from_bytes(name[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
        values = [
            _MAGIC,
            int(self.training),
            self.num_microbatches,
            self.num_stages,
            self.fingerprint,
            int(self.has_target),
            self.seed,
            self.weights,
            self.shapes,
            self.contents,
            *words,
        ]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def decode(cls, values: list[int]) -> StepShape:
        """The shape :meth:`encode` wrote."""
        (
            magic,
            training,
            count,
            stages,
            fingerprint,
            target,
            seed,
            weights,
            shapes,
            contents,
            *words,
        ) = values
        if magic != _MAGIC:
            raise ConfigError(
                "a rank of this pipeline sent something other than a step's shape at the "
                "step's start: run the same pipesched version and calls on every rank"
            )
        name = b"".join(w.to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0")
        return cls(
            training=bool(training),
            num_microbatches=count,
            schedule=name.decode(errors="replace"),
            num_stages=stages,
            fingerprint=fingerprint,
            has_target=bool(target),
            seed=seed,
            weights=weights,
            shapes=shapes,
            contents=contents,
        )

    @staticmethod
    def size() -> int:
        """Integers in an encoded shape."""
        return 10 + _NAME_WORDS


def mismatch(shapes: list[StepShape]) -> str | None:
    """What the pp ranks (``shapes[pp_rank]``) disagree on, with the fix; None if nothing.

    Seeds may differ (see the module docstring); everything else must not.

    Example:
        >>> from pipesched.schedule import get_schedule
        >>> ranks = [StepShape.of(get_schedule("1f1b", 2, m), training=True,
        ...     has_target=True, seed=0) for m in (4, 3)]
        >>> print(mismatch(ranks).split(":")[0])
        pp rank 0 has 4 micro-batches, pp rank 1 has 3
    """
    first = shapes[0]
    for r, shape in enumerate(shapes[1:], start=1):
        if shape.training != first.training:
            kinds = {True: "a training step (step/accumulate)", False: "forward only (pipe(x))"}
            return (
                f"pp rank 0 runs {kinds[first.training]}, pp rank {r} runs "
                f"{kinds[shape.training]}: every rank of a pipeline must make the same call "
                "(and, for pipe(x), be under torch.no_grad() alike)"
            )
        if (shape.schedule, shape.num_stages) != (first.schedule, first.num_stages) or (
            shape.num_microbatches == first.num_microbatches
            and shape.fingerprint != first.fingerprint
        ):
            return (
                f"pp rank 0 runs schedule {first.schedule!r} with {first.num_stages} stages, "
                f"pp rank {r} runs {shape.schedule!r} with {shape.num_stages} stages"
                + (" (other actions)" if shape.schedule == first.schedule else "")
                + ": build the Pipeline with the same schedule, balance and model on every rank"
            )
        if shape.num_microbatches != first.num_microbatches:
            return (
                f"pp rank 0 has {first.num_microbatches} micro-batches, pp rank {r} has "
                f"{shape.num_microbatches}: give every rank of a pipeline a batch of the same "
                "size (a batch of n rows gives min(chunks, n) micro-batches), or the same "
                "microbatches=[...] list; each replica "
                "(dp rank) may have its own size"
            )
        if shape.has_target != first.has_target:
            has = {True: "passes a target", False: "passes no target"}
            return (
                f"pp rank 0 {has[first.has_target]}, pp rank {r} {has[shape.has_target]}: "
                "pass the target on every rank or on none (only the last stage's rank uses it, "
                "but every rank cuts it into micro-batches)"
            )
        if shape.weights != first.weights:
            return (
                f"pp rank {r} weighs its {shape.num_microbatches} micro-batches' losses "
                "otherwise than pp rank 0 (their row counts, or num_items, differ): pass every "
                "rank of a pipeline the same batch, or the same microbatches=[...] list, and "
                "the same num_items (the last stage's rank weighs the loss by them)"
            )
        if shape.shapes != first.shapes:
            return (
                f"pp rank {r}'s micro-batches have other input shapes than pp rank 0's: with "
                "NCCL (or PIPESCHED_P2P=ordered) receives are posted ahead at sizes known from "
                "the micro-batches' shapes, so pass every rank of a pipeline the same batch, "
                "or the same microbatches=[...] list"
            )
        if shape.contents != first.contents:
            return (
                f"pp rank {r} was given another batch than pp rank 0 (of the same size, "
                "other contents: a checksum of its inputs and targets differs): every rank of "
                "a pipeline must step the same batch, in the same order; a rank that skipped "
                "or repeated a batch would train its stages on another batch's activations"
            )
    return None


def batch_digest(values: Sequence[Any]) -> int:
    """A checksum of the tensors in ``values`` (micro-batches: their inputs and targets):
    per tensor, its bytes read as integers and summed on its device, all read back at once.
    Bits, not values: equal batches agree exactly on any device."""
    sums = []
    for t in tensors(values):
        if t.device.type == "meta" or t.layout != torch.strided or t.numel() == 0:
            continue  # (a sparse tensor's values: not read here)
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
        sums.append(words.sum(dtype=torch.int64))
    if not sums:
        return 0
    read = torch.stack([s.to(sums[0].device) for s in sums]).tolist()  # one sync
    return zlib.crc32(struct.pack(f"<{len(read)}q", *read))


def agreed_seed(shapes: list[StepShape]) -> int:
    """The step's seed: the lowest pp rank's that drew one (0: no rank did).

    A rank without random layers of its own draws none (0), so pp rank 0's
    seed wins only when it drew one.
    """
    return next((shape.seed for shape in shapes if shape.seed != 0), 0)


_fingerprints: dict[int, tuple[Schedule, int]] = {}


def _fingerprint(schedule: Schedule) -> int:
    """A checksum of ``schedule``'s actions and placement (cached: schedules are reused)."""
    cached = _fingerprints.get(id(schedule))
    if cached is not None and cached[0] is schedule:
        return cached[1]
    table = repr((schedule.placement, [[str(a) for a in row] for row in schedule.actions]))
    value = zlib.crc32(table.encode())
    if len(_fingerprints) >= 64:
        _fingerprints.clear()
    _fingerprints[id(schedule)] = (schedule, value)
    return value
