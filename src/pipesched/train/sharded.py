"""One checkpoint for any layout: a GradientAccumulator's state under the plain model's names.

Why: per-rank ``state_dict`` files resume only at the layout that wrote them. Here
every entry is keyed by the model's names (``model/``, ``optim/``, ``grad/``,
``accumulator``, ``rng/``, ``checksums/``), split state is summed first, every rank
writes its stages' entries, and a load at any pp, dp or balance reads its own.

A tied parameter (one Parameter under several names) has its ``optim/`` and
``grad/`` entries under the first of its names the saving rank sees, and
``aliases/<rank>`` maps each of its other names there: a rank that sees
another subset of its names (the tie split over ranks at one layout, whole on
one at the other) still finds them.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipesched.errors import CheckpointError
from pipesched.train import store
from pipesched.train.checkpoint_check import FIX, LoadSnapshot, check_fits, optimizer_type
from pipesched.train.dtensors import gathered
from pipesched.train.integrity import digest
from pipesched.train.state import rng_state

if TYPE_CHECKING:
    from pipesched.train.accumulator import GradientAccumulator

__all__ = ["agree", "load_sharded", "save_sharded"]


def save_sharded(acc: GradientAccumulator, path: str) -> None:
    """Writes ``acc``'s state as a new version of the checkpoint directory ``path``.

    On a mesh, a collective: every rank calls it (with the same ``path``).
    """
    pipe, mesh = acc.pipe, acc.pipe.mesh
    if mesh is not None and mesh.shard_mesh is not None and acc.position != 0:
        raise CheckpointError(
            f"cannot save {path!r} mid-window ({acc.position} of {acc.accumulation_steps} "
            "steps in): sharded stages keep the window's gradients gathered, which a "
            "checkpoint does not hold yet. Nothing was written; save after the window's "
            "last step (when acc.step(...).stepped)"
        )
    names = _aliases(pipe)
    # Sharded stages' tensors whole, gathered in one order on every replica.
    state: dict[str, Any] = {
        f"model/{k}": gathered(v) for k, v in pipe.state_dict().items() if not _is_meta(v)
    }
    rank = _rank(mesh is not None)
    groups = []
    for optimizer in acc.optimizers:
        for group in optimizer.param_groups:
            held = [p for p in group["params"] if not p.is_meta]  # (meta: another rank's)
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append(([names[id(p)][0] for p in held], options))
            for p in held:
                for key, value in optimizer.state.get(p, {}).items():
                    state[f"optim/{names[id(p)][0]}/{key}"] = gathered(value)
    state[f"optim_groups/{rank}"] = groups
    own = [p for p in pipe.parameters() if not p.is_meta]
    for pid, grad in pipe.sync.summed_gradients(own).items():
        state[f"grad/{names[pid][0]}"] = grad
    # Each other name of a tied parameter -> the name its entries are under (above).
    state[f"aliases/{rank}"] = {a: names[id(p)][0] for p in own for a in names[id(p)][1:]}
    sums = acc.window_sums
    items, samples, loss_sum, *rows = pipe.sync.sum(
        [sums.items, float(sums.samples), sums.loss_sum, *map(float, sums.step_rows)]
    )  # every replica is as many steps into the window
    extra = {
        "counters": {"steps": acc.steps, "windows": acc.windows},
        "window": {
            "position": acc.position,
            "items": items,
            "samples": int(samples),
            "loss_sum": loss_sum,
            "scale": sums.scale,
            "step_rows": [int(r) for r in rows],
        },
        "accumulation_steps": acc.accumulation_steps,
        "schedulers": [s.state_dict() for s in acc.schedulers],
        "scheduler_types": [optimizer_type(s) for s in acc.schedulers],
        "optimizer_types": [optimizer_type(o) for o in acc.optimizers],
        "loss_scale": acc.loss_scale.state_dict(),
        "layout": _layout(acc),
    }
    if rank == 0:  # global rank 0's schedulers and scaler: every rank's are in its state
        state["accumulator"] = extra
    state[f"rng/{rank}"] = rng_state()
    state[f"checksums/{rank}"] = {key: digest(value) for key, value in state.items()}
    store.write(state, path, distributed=mesh is not None)


def load_sharded(acc: GradientAccumulator, path: str) -> None:
    """Loads the checkpoint directory ``path`` into ``acc``, at this layout; all or nothing.

    On a mesh every rank calls it: each reads only its stages' entries, the
    ranks agree that every one of them fits before any changes anything, and
    should applying fail on any rank, every rank puts its state back.

    Raises:
        FileNotFoundError: nothing is at ``path``.
        CheckpointError: the checkpoint cannot be read or does not fit (on
            any rank: the message lists each rank's misfits). Nothing changed.
    """
    distributed = acc.pipe.mesh is not None
    problem: str | None = None
    absent = False
    state: dict[str, Any] = {}
    try:
        state = _local_state(acc, store.resolve(path), path)
        check_fits(acc, state, path)
    except (CheckpointError, FileNotFoundError) as err:
        if not distributed:
            raise
        problem, absent = str(err), isinstance(err, FileNotFoundError)
    if distributed:
        agree(problem, absent=absent)
    snapshot = LoadSnapshot(acc)
    failure: BaseException | None = None
    try:
        acc.apply_state(state)
    except BaseException as err:  # put back, agreed, then raised below
        failure = err
    failed = _failed_anywhere(failure) if distributed else failure is not None
    if failed:
        snapshot.restore()
        if failure is not None and not isinstance(failure, Exception):
            raise failure
        why = "it failed on another rank" if failure is None else f"{type(failure).__name__}"
        raise CheckpointError(
            f"checkpoint {path!r} passed the checks but could not be applied ({why}: "
            f"{failure}); everything it changed was put back, on every rank. Fix: {FIX}"
        ) from failure


def _local_state(acc: GradientAccumulator, directory: str, path: str) -> dict[str, Any]:
    """This rank's part of the checkpoint, as :meth:`GradientAccumulator.state_dict` has it."""
    pipe, mesh = acc.pipe, acc.pipe.mesh
    metadata = store.read_metadata(directory)
    if "accumulator" not in metadata:
        raise CheckpointError(
            f"checkpoint {path!r} holds no GradientAccumulator state (only "
            f"{len(metadata)} entries such as {sorted(metadata)[:3]}): it is a model's "
            "weights; load them with pipesched.train.load_model(pipe, path)"
        )
    live = pipe.state_dict(keep_vars=True)
    own_model = [k for k, v in live.items() if not _is_meta(v)]
    missing = [k for k in own_model if f"model/{k}" not in metadata]
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} lacks {len(missing)} of this model's tensors "
            f"({', '.join(map(repr, missing[:6]))}{', ...' if len(missing) > 6 else ''}): "
            f"it was saved from another model. Nothing was loaded or changed. Fix: {FIX}"
        )
    rank_rng = f"rng/{_rank(mesh is not None)}"
    small = ["accumulator", "rng/0", rank_rng]
    small += [k for k in metadata if k.startswith(("optim_groups/", "aliases/", "checksums/"))]
    data = store.read(directory, sorted({k for k in small if k in metadata}), metadata)
    extra = data["accumulator"]
    rng_key = rank_rng if extra["layout"] == _layout(acc) and rank_rng in data else "rng/0"
    options: dict[str, dict[str, Any]] = {}  # each saved parameter's group options
    for key in [k for k in data if k.startswith("optim_groups/")]:
        for held, group_options in data[key]:
            options.update(dict.fromkeys(held, group_options))
    moved: dict[str, str] = {}  # a tied parameter's other names -> the one saved under
    for key in [k for k in data if k.startswith("aliases/")]:
        moved.update(data[key])
    names = _aliases(pipe)
    own = [p for p in pipe.parameters() if not p.is_meta]
    saved: dict[int, tuple[str, dict[str, Any]]] = {}  # id -> (name saved under, its options)
    for p in own:
        found = _saved_name(names[id(p)], options, moved)
        if found is not None:
            saved[id(p)] = (found, options[found])
    _check_optimized(acc, names, saved, path)
    graded = {k[len("grad/") :] for k in metadata if k.startswith("grad/")}
    grad_names = {id(p): _saved_name(names[id(p)], graded, moved) for p in own}
    wanted = {name for name, _ in saved.values()}
    keys = [f"model/{k}" for k in own_model]
    keys += [k for k in metadata if k.startswith("optim/") and _owner(k) in wanted]
    keys += sorted({f"grad/{n}" for n in grad_names.values() if n is not None})
    data.update(store.read(directory, keys, metadata))
    _verify(data, directory, path)
    _check_ties(own, names, data, moved, path)
    primary = _primary(acc)
    grads = {}
    for n, p in pipe.named_parameters():
        saved_as = grad_names.get(id(p))
        if saved_as is not None:
            grad = data[f"grad/{saved_as}"]
            grads[n] = grad if id(p) in primary else torch.zeros_like(grad)
    window = dict(extra["window"], grads=grads)
    if mesh is not None and mesh.dp_rank != 0:  # the window's sums start on one replica
        window.update(items=0.0, samples=0, loss_sum=0.0, step_rows=[])
    return {
        "model": {k: data.get(f"model/{k}", v) for k, v in live.items()},
        "optimizers": [_optimizer_state(o, saved, data, path) for o in acc.optimizers],
        "optimizer_types": extra.get("optimizer_types"),  # (None: saved before they were)
        **_schedulers_for(len(acc.schedulers), extra),
        "loss_scale": extra["loss_scale"],
        "rng": data[rng_key],
        "counters": extra["counters"],
        "window": window,
    }


def _schedulers_for(count: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The saved schedulers, for ``count`` here: one per optimizer (per stage) at another
    stage count, where every saved one is alike (as per-stage schedulers of one kind,
    stepped together, are), each takes that state; otherwise as saved (the count is
    checked)."""
    saved, types = extra["schedulers"], extra.get("scheduler_types")  # (None: older saves)
    alike = bool(saved) and all(s == saved[0] for s in saved)
    if len(saved) == count or not count or not alike:
        return {"schedulers": saved, "scheduler_types": types}
    kind = [types[0]] * count if types and all(t == types[0] for t in types) else None
    return {"schedulers": [saved[0]] * count, "scheduler_types": kind}


def _saved_name(aliases: list[str], saved: Container[str], moved: Mapping[str, str]) -> str | None:
    """The name a parameter's entries are saved under, given its names here; None: none.

    One of ``aliases`` itself, or the name a saving rank that saw it tied
    wrote them under (``moved``): the tie may be split over ranks here and
    whole there, or the other way round.
    """
    for name in aliases:
        if name in saved:
            return name
    for name in aliases:
        if moved.get(name) in saved:
            return moved[name]
    return None


def _check_ties(
    own: list[nn.Parameter],
    names: dict[int, list[str]],
    data: Mapping[str, Any],
    moved: Mapping[str, str],
    path: str,
) -> None:
    """Refuses a checkpoint whose weights are tied otherwise than here.

    Why: entries are found by name, so a model that ties two names the run that
    saved it kept apart would silently take one of the two saved weights (and
    their optimizer state); one that keeps apart what was saved tied would give
    both the tied gradient, counted twice.
    """
    here = {n: id(p) for p in own for n in names[id(p)]}
    problems = []
    for p in own:
        tied = names[id(p)]
        apart = [n for n in tied if any(k.startswith((f"optim/{n}/", f"grad/{n}")) for k in data)]
        values = [data[f"model/{n}"] for n in tied if f"model/{n}" in data]
        if len(apart) > 1 or any(not torch.equal(values[0], v) for v in values[1:]):
            problems.append(f"{' and '.join(map(repr, tied))} are one parameter here, two in it")
        for name in tied:
            other = moved.get(name)
            if other is not None and here.get(other, id(p)) != id(p):
                problems.append(f"{name!r} and {other!r} are two parameters here, one in it")
    if problems:
        raise CheckpointError(
            f"checkpoint {path!r} ties its weights otherwise than this model: "
            f"{'; '.join(sorted(set(problems))[:4])}. Loading it would take one of two saved "
            "weights (or give both the tied gradient). Nothing was loaded or changed. Fix: "
            "tie the model's weights as the run that saved it did (tie_weights() or not) "
            "before loading"
        )


def _check_optimized(
    acc: GradientAccumulator,
    names: dict[int, list[str]],
    saved: dict[int, tuple[str, dict[str, Any]]],
    path: str,
) -> None:
    """Refuses a checkpoint whose optimizers held none of this rank's optimized parameters.

    Why: such a parameter would keep its options and get no state (fresh
    moments) silently, and its tied copies on other ranks diverge from it.
    """
    missing = sorted(
        names[id(p)][0]
        for optimizer in acc.optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        if not p.is_meta and id(p) in names and id(p) not in saved
    )
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} holds no optimizer entry for {len(missing)} of this rank's "
            f"optimized parameters ({', '.join(map(repr, missing[:6]))}"
            f"{', ...' if len(missing) > 6 else ''}) under any of their names: the optimizers "
            "that saved it did not hold them, or it predates the tied-weight names a "
            "checkpoint records (a weight tied across pp ranks). Nothing was loaded or "
            "changed. Fix: build the optimizers over the parameters the run that saved it "
            "did; a checkpoint of an older pipesched: load it at the layout that saved it, "
            "save it again, then load that"
        )


def _verify(data: dict[str, Any], directory: str, path: str) -> None:
    """Refuses entries whose contents differ from the checksums the save wrote.

    A checkpoint written before checksums has none: it is read unchecked.
    """
    expected: dict[str, str] = {}
    for key in [k for k in data if k.startswith("checksums/")]:
        expected.update(data.pop(key))
    changed = [k for k, v in data.items() if k in expected and digest(v) != expected[k]]
    if changed:
        files = store.files_of(directory)
        listed = ", ".join(f"{k!r} in {files.get(k, '?')!r}" for k in changed[:6])
        raise CheckpointError(
            f"checkpoint {path!r} is not what was saved: the contents of {listed} (in "
            f"{directory!r}) differ from their checksums: a byte of a file changed after it "
            "was written (disk, copy, transfer). Nothing was loaded or changed; load another "
            "checkpoint, or a good copy of this one"
        )


def _owner(key: str) -> str:
    """The parameter name of an ``optim/<name>/<key>`` entry."""
    return key[len("optim/") :].rpartition("/")[0]


def _optimizer_state(
    optimizer: torch.optim.Optimizer,
    saved: dict[int, tuple[str, dict[str, Any]]],
    data: dict[str, Any],
    path: str,
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the checkpoint has it: state by position, saved options."""
    per_parameter: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key.startswith("optim/"):
            per_parameter.setdefault(_owner(key), {})[key.rpartition("/")[2]] = value
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        options: dict[str, Any] | None = None
        ids = []
        for p in group["params"]:
            if id(p) in saved:
                name, these = saved[id(p)]
                entry = per_parameter.get(name)
                if entry:
                    state[index] = entry
                if options is not None and these != options:
                    raise CheckpointError(
                        f"checkpoint {path!r}: parameter group {g} of this optimizer mixes "
                        f"parameters saved with different options ({options} and {name!r}'s "
                        f"{these}); group the parameters as the run that saved it did"
                    )
                options = these
            ids.append(index)
            index += 1
        current = {k: v for k, v in group.items() if k != "params"}
        groups.append({**(current if options is None else options), "params": ids})
    return {"state": state, "param_groups": groups}


def _primary(acc: GradientAccumulator) -> set[int]:
    """``id``s of the parameters whose saved window gradient this rank takes."""
    mesh = acc.pipe.mesh
    own = [p for p in acc.pipe.parameters() if not p.is_meta]
    if mesh is None:
        return {id(p) for p in own}
    if mesh.dp_rank != 0:
        return set()
    tied = acc.pipe.tied_ranks
    return {id(p) for p in own if tied.get(id(p), (mesh.pp_rank,))[0] == mesh.pp_rank}


def _aliases(pipe: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, in the model's order (a tied one has several)."""
    names: dict[int, list[str]] = {}
    for name, p in pipe.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _layout(acc: GradientAccumulator) -> dict[str, Any]:
    """pp, dp and the balance (None: a traced model not cut yet, before its first call)."""
    mesh = acc.pipe.mesh
    pp, dp = (1, 1) if mesh is None else (mesh.pp_size, mesh.dp_size)
    return {"pp": pp, "dp": dp, "balance": list(acc.pipe.balance) if acc.pipe.is_cut else None}


def _rank(distributed: bool) -> int:
    return dist.get_rank() if distributed else 0


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def agree(problem: str | None, *, absent: bool = False) -> None:
    """Raises on every rank of the job if ``problem`` is set on any (a collective).

    Args:
        problem: what this rank found wrong, or None.
        absent: the problem is that the checkpoint is not there at all: when
            it is so on every rank, each raises ``FileNotFoundError`` ("no
            checkpoint yet: start afresh"), else ``CheckpointError``.
    """
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, (problem, absent))
    failed = [(r, p) for r, (p, _) in enumerate(problems) if p is not None]
    if failed and all(a for _, a in problems):
        raise FileNotFoundError(problem)
    if failed:
        listed = "\n".join(f"rank {r}: {p}" for r, p in failed)
        raise CheckpointError(
            f"the checkpoint cannot be loaded on {len(failed)} of {len(problems)} ranks; "
            f"nothing was loaded or changed on any rank:\n{listed}"
        )


def _failed_anywhere(failure: BaseException | None) -> bool:
    """Whether applying failed on any rank of the job (a collective)."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, failure is not None)
    return any(flags)
