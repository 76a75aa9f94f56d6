"""The ("dp", "pp") device mesh of a torchrun job, and this rank's place in it."""

from __future__ import annotations

import os
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.compat.internals import set_group_timeout

__all__ = ["DEFAULT_TIMEOUT", "MeshInfo", "init_mesh", "rank0_value"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a pipeline's transfers and agreements wait when the mesh does not say."""

_options: dict[int, tuple[weakref.ref[DeviceMesh], float, DeviceMesh | None, str]] = {}
"""By ``id(mesh)``: the mesh, its timeout, its shard mesh. Why not a WeakKeyDictionary:
DeviceMesh compares by layout, and two meshes of one layout may differ here."""

_waited: deque[Any] = deque(maxlen=4)
"""The works of the last few collectives :func:`wait_kept` waited for."""


def init_mesh(
    pp: int,
    dp: int = 1,
    *,
    shard: int = 1,
    reshard: str = "step",
    timeout: float = DEFAULT_TIMEOUT,
) -> DeviceMesh:
    """The ("dp", "pp") mesh of this job, initializing the process group if needed.

    Ranks are laid out ``rank = dp_index * pp + pp_index``: the ``pp`` ranks of
    one pipeline are consecutive (on one node, when ``pp`` divides the GPUs per
    node, so that the heavy point-to-point traffic stays inside it).

    Args:
        pp: pipeline workers (ranks per pipeline).
        dp: data-parallel replicas of the pipeline.
        shard: replicas over which each stage's parameters, gradients and
            optimizer state are sharded (FSDP2, ``docs/distributed.md`` "Sharded
            data parallel"): 1 replicates every stage on each of the ``dp``
            replicas; ``dp`` shards each stage over all of them; a divisor of
            ``dp`` between shards within groups of that many consecutive
            replicas and replicates across the groups (HSDP).
        reshard: when a sharded stage gathers its parameters: ``"step"`` (once
            per step, kept through all its actions) or ``"action"`` (around each
            of its forward, backward and weight actions, sharded again after:
            a rank holds one stage's parameters whole at a time, for an
            all-gather per action).
        timeout: seconds a pipeline's transfers and per-step agreement may
            wait for another rank before failing with a timeout that names
            it (and the process group's timeout, when this call creates it).

    Raises:
        ConfigError: ``pp * dp`` is not the job's world size, or ``shard`` does
            not divide ``dp``.

    Example (under ``torchrun --nproc_per_node 4``)::

        mesh = pipesched.runtime.mesh.init_mesh(pp=2, dp=2)
        pipe = pipesched.Pipeline(model, chunks=8, mesh=mesh, schedule="1f1b")
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    for name, value in (("pp", pp), ("dp", dp), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}")
        if value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(reshard, str):
        raise ConfigTypeError(f"reshard must be 'step' or 'action', got {reshard!r}")
    if reshard not in ("step", "action"):
        raise ConfigError(
            f"reshard must be 'step' (gather a stage's parameters once per step) or 'action' "
            f"(around each of its actions), got {reshard!r}"
        )
    if dp % shard:
        raise ConfigError(
            f"shard must divide dp: each stage is sharded over groups of {shard} of the dp={dp} "
            f"replicas, got shard={shard}; use 1 (replicated), dp (fully sharded) or a divisor "
            "of dp between (HSDP: sharded within a group, replicated across groups)"
        )
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ConfigError(
                "init_mesh found no process group and no torchrun environment (RANK is not "
                "set); launch with `torchrun --nproc_per_node N script.py`"
            )
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
    world = dist.get_world_size()
    if pp * dp != world:
        raise ConfigError(
            f"pp x dp must equal the world size: pp={pp} x dp={dp} = {pp * dp}, but the job "
            f"has {world} ranks; use dp={world // pp if world % pp == 0 else '?'} or launch "
            f"{pp * dp} processes"
        )
    device_type = "cuda" if cuda and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
    key = id(mesh)
    shard_mesh = None  # what each stage is sharded over: 1-D, or 2-D (replicate, shard)
    if shard == dp and dp > 1:
        shard_mesh = mesh["dp"]
    elif shard > 1:  # the same ranks: rank = (replicate * shard + index) * pp + pp_rank
        names = ("replicate", "shard", "pp")
        grouped = init_device_mesh(device_type, (dp // shard, shard, pp), mesh_dim_names=names)
        shard_mesh = grouped["replicate", "shard"]
    # Why: a DeviceMesh's groups take torch's default timeout (30 minutes for gloo), not the
    # job's; a replica waiting on a hung one would wait that long in the gradients' all-reduce.
    for group in mesh.get_all_groups() + (
        [] if shard_mesh is None else shard_mesh.get_all_groups()
    ):
        if dist.get_backend(group) == "gloo":  # (NCCL's watchdog would abort the process)
            set_group_timeout(group, timeout)
    ref = weakref.ref(mesh, lambda _: _options.pop(key, None))
    _options[key] = (ref, timeout, shard_mesh, reshard)
    return mesh


@dataclass(frozen=True)
class MeshInfo:
    """This rank's view of a ("dp", "pp") mesh.

    Attributes:
        pp_rank, pp_size: this rank's index in its pipeline, and the pipeline's length.
        dp_rank, dp_size: this rank's replica, and the number of replicas.
        pp_group, dp_group: the process groups along each dimension.
        pp_ranks: the global ranks of this rank's pipeline, by pp index.
        device: this rank's device.
        shard_mesh: the mesh over which this rank's stages are sharded (FSDP2):
            1-D over the replicas, or 2-D (replicate, shard) for HSDP; None
            where every replica holds them whole.
        reshard: when sharded stages gather their parameters (``init_mesh``'s).
        timeout: seconds a transfer or agreement waits for another rank
            (``init_mesh``'s ``timeout``).
    """

    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    pp_group: Any
    dp_group: Any
    pp_ranks: tuple[int, ...]
    device: torch.device
    timeout: float = DEFAULT_TIMEOUT
    shard_mesh: DeviceMesh | None = None
    reshard: str = "step"

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshInfo:
        """Reads this rank's place from ``mesh`` (dims named "dp" and "pp")."""
        if not isinstance(mesh, DeviceMesh):
            raise ConfigTypeError(
                f"mesh must be a DeviceMesh, got {type(mesh).__name__} {mesh!r}; build it "
                "with pipesched.runtime.mesh.init_mesh(pp, dp)"
            )
        names = tuple(mesh.mesh_dim_names or ())
        if names != ("dp", "pp"):
            raise ConfigError(
                f"mesh must have dims ('dp', 'pp'), got {names}; build it with "
                "pipesched.runtime.mesh.init_mesh(pp, dp)"
            )
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        ref, timeout, shard_mesh, reshard = _options.get(
            id(mesh), (None, DEFAULT_TIMEOUT, None, "step")
        )
        if ref is None or ref() is not mesh:
            timeout, shard_mesh, reshard = DEFAULT_TIMEOUT, None, "step"
        dp_rank = mesh.get_local_rank("dp")
        pp_ranks = tuple(int(r) for r in mesh.mesh[dp_rank].tolist())
        if mesh.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(
            pp_rank=mesh.get_local_rank("pp"),
            pp_size=mesh.size(1),
            dp_rank=dp_rank,
            dp_size=mesh.size(0),
            pp_group=pp_group,
            dp_group=dp_group,
            pp_ranks=pp_ranks,
            device=device,
            timeout=float(timeout),
            shard_mesh=shard_mesh,
            reshard=reshard,
        )


def rank0_value(value: Any) -> Any:
    """Global rank 0's ``value`` (any picklable object), on every rank of the job.

    A collective: every rank calls it. Where ranks compute something that
    should agree but may not (a cut chosen from measured times), rank 0's wins.
    """
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_kept(work: Any) -> None:
    """Waits for a collective started with ``async_op=True``, then keeps its work a while.

    Why: gloo's worker thread may still hold a finished work when ``wait()``
    returns; if its reference is the last, it frees the work's tensors itself,
    which takes the GIL, and aborts the process ("terminate called without an
    active exception") when the interpreter is already exiting: a script that
    ends right after a step (pytorch/pytorch#190489). Kept here, the work is
    freed by Python instead. Only for the mesh's groups: a kept work keeps its
    group's connections open, and a pipeline's own group must close on failure.
    """
    if work is None:  # this rank is not in the group
        return
    try:
        work.wait()
    finally:
        _waited.append(work)
