"""Materializing a model built on the meta device: a rank allocates and initializes its stages.

Why not ``Module.to_empty``: it unties tied weights and allocates the whole module.
Here each meta tensor of a stage becomes one tensor on the stage's device in every
place that holds it. Each module is initialized under a generator seeded from
``(seed, name)``, so weights do not depend on the cut or the ranks; anything left
uninitialized (NaN-filled before) is a :class:`~pipesched.errors.ConfigError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from pipesched.errors import ConfigError, ConfigTypeError

__all__ = [
    "SKIP",
    "InitWeights",
    "Materialized",
    "Swaps",
    "Unloaded",
    "check_init_weights",
    "check_meta",
    "initialize",
    "materialize",
    "materialize_stages",
    "on_meta",
]

InitWeights = Callable[[str, nn.Module], Any] | Literal["skip"] | None
"""What ``init_weights=`` takes: None, a callable ``(name, module)``, or ``"skip"``."""

SKIP: Literal["skip"] = "skip"
"""``init_weights="skip"``: parameters and persistent buffers are left as allocated, for a load."""


def check_init_weights(value: object) -> InitWeights:
    """``value`` if ``init_weights=`` can take it.

    Raises:
        ConfigTypeError: not None, a callable or a string.
        ConfigError: a string other than ``"skip"``.
    """
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        if value != SKIP:
            raise ConfigError(
                f"init_weights must be None, a callable init_weights(name, module) or "
                f"'skip', got {value!r}; pass init_weights='skip' to leave the weights for "
                "a checkpoint load"
            )
        return SKIP
    raise ConfigTypeError(
        f"init_weights must be None, a callable init_weights(name, module) or 'skip', got "
        f"{type(value).__name__} {value!r}; write def init_weights(name, module): ... and "
        "pass init_weights=init_weights"
    )


def check_meta(module: nn.Module, example_inputs: object, init_weights: object) -> InitWeights:
    """The Pipeline's ``init_weights``, checked with the model it is for.

    Raises:
        ConfigTypeError, ConfigError: see :func:`check_init_weights`.
        ConfigError: a traced model on the meta device without ``example_inputs``.
    """
    init_weights = check_init_weights(init_weights)
    if not isinstance(module, nn.Sequential) and example_inputs is None and on_meta(module):
        raise ConfigError(
            f"{type(module).__name__} is on the meta device and is not an nn.Sequential: pass "
            "example_inputs=(x,) (one micro-batch, on any device) so that it is traced, cut "
            "and materialized at construction, before an optimizer takes its parameters"
        )
    return init_weights


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (holds no data)."""
    return any(t.is_meta for t in _tensors(module))


def initialize(
    model: nn.Module,
    init_weights: InitWeights = None,
    *,
    device: torch.device | str = "cpu",
    seed: int | None = None,
) -> nn.Module:
    """Initializes the whole ``model`` as a Pipeline initializes it stage by stage.

    Use it to build the model a pipeline of a meta-device model equals: the
    same modules, built normally (or on meta and materialized here), then
    ``initialize(model, init_weights)`` with the Pipeline's ``init_weights``
    and the seed the Pipeline will read (``torch.manual_seed(seed)`` before both).

    Args:
        model: the model; tensors on the meta device are allocated on ``device``,
            the others stay where they are and are initialized again.
        init_weights: as the Pipeline's (see :mod:`pipesched.partition.materialize`).
        device: where meta tensors are allocated.
        seed: the seed of every module's generator; None: ``torch.initial_seed()``.

    Returns:
        ``model``, initialized in place.

    Raises:
        ConfigError: a tensor was left uninitialized (the message names the module).
    """
    init_weights = check_init_weights(init_weights)
    seed = torch.initial_seed() if seed is None else seed
    modules = list(model.modules())
    materialize(modules, model, torch.device(device), init_weights, seed, every=True)
    return model


def materialize(
    owners: Sequence[nn.Module],
    model: nn.Module,
    device: torch.device,
    init_weights: InitWeights,
    seed: int,
    *,
    holders: Sequence[nn.Module] = (),
    every: bool = False,
    record: Swaps | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Allocates the meta tensors of ``owners`` on ``device`` and initializes their modules.

    Args:
        owners: the modules whose own tensors (not their children's) a stage holds.
        model: the model: its modules are initialized, under its names.
        device: the stage's device.
        init_weights: None, a callable ``(name, module)``, or ``"skip"``.
        seed: the base of every module's seed.
        holders: other modules that hold the model's tensors too (traced
            stages): their references follow.
        every: initialize every module holding a tensor of ``owners``, meta or not
            (:func:`initialize`); else only those holding a tensor allocated here.
        record: where each replacement made here is recorded, for modules
            that hold the model's tensors and are not ``holders`` (the Pipeline
            applies it to itself, :meth:`Swaps.apply`).

    Returns:
        Under ``"skip"``, each tensor allocated and left for a load, with its
        name in the model (see :class:`Unloaded`); else nothing.

    Raises:
        ConfigError: a tensor was left uninitialized, or (``"skip"``) a
            non-persistent buffer, which no checkpoint restores, would be.
    """
    fill = init_weights != SKIP
    fresh: dict[int, torch.Tensor] = {}  # id(tensor held now) -> the tensor to hold
    for owner in owners:
        for tensors in (owner._parameters, owner._buffers):
            for old in tensors.values():
                if old is not None and (old.is_meta or every) and id(old) not in fresh:
                    fresh[id(old)] = _allocate(old, device, fill=fill)
                    if record is not None:
                        record.add(old, fresh[id(old)])
    _swap([model, *holders], fresh)
    replaced = {id(t): t for t in fresh.values()}
    touched = [
        (name, m)
        for name, m in model.named_modules()
        if any(id(t) in replaced for t in (*m._parameters.values(), *m._buffers.values()))
    ]
    if init_weights == SKIP:
        _check_skippable(touched)
        return [
            (f"{name}.{key}" if name else key, t)
            for name, m in touched
            for d in _dicts(m)
            for key, t in d.items()
            if t is not None and id(t) in replaced
        ]
    versions = {id(t): t._version for t in replaced.values()}
    before = {(id(d), k): (d, k, t) for _, m in touched for d in _dicts(m) for k, t in d.items()}
    for name, module in touched:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_module_seed(seed, name))
            with torch.no_grad():
                for reset in _resets(module):
                    reset()
                if callable(init_weights):
                    init_weights(name, module)
    # A tensor the init assigned anew (module.mask = ...) counts as written; others follow it.
    assigned = {
        id(t): (d[k] if d[k].device == device else d[k].to(device))
        for d, k, t in before.values()
        if t is not None and d.get(k) is not t and d.get(k) is not None
    }
    if record is not None:
        for _, _, t in before.values():
            if t is not None and id(t) in assigned:
                record.add(t, assigned[id(t)])
    _swap([model, *holders], assigned)
    _check_written([model, *holders], replaced, versions)
    return []


def _swap(roots: Sequence[nn.Module], new: dict[int, torch.Tensor]) -> None:
    """In every module of ``roots``, each tensor ``t`` with ``id(t)`` in ``new`` replaced."""
    if not new:
        return
    for root in roots:
        for m in root.modules():
            for d in _dicts(m):
                for key, t in d.items():
                    if t is not None and id(t) in new:
                        d[key] = new[id(t)]


def _dicts(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    return module._parameters, module._buffers


def _allocate(old: torch.Tensor, device: torch.device, *, fill: bool) -> torch.Tensor:
    """A meta tensor's replacement on ``device`` (a real one: itself), filled with the sentinel."""
    if not old.is_meta:
        if fill:
            old.data.fill_(_sentinel(old.dtype))
        return old
    data = torch.empty_like(old, device=device)
    if fill:
        data.fill_(_sentinel(data.dtype))
    if isinstance(old, nn.Parameter):
        return nn.Parameter(data, requires_grad=old.requires_grad)
    return data


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return False
    return int(torch.iinfo(dtype).min)


def _unwritten(t: torch.Tensor, old_version: int | None) -> bool:
    """Whether ``t`` still holds its sentinel (booleans: was never written in place)."""
    if t.dtype == torch.bool:
        return old_version is not None and t._version == old_version
    if t.numel() == 0:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        # A sum is NaN if any element is (no copy of the tensor); then confirm element-wise.
        return bool(torch.isnan(t.sum())) and bool(torch.isnan(t).any())
    return bool((t == _sentinel(t.dtype)).any())


def _check_written(
    roots: Sequence[nn.Module], replaced: dict[int, torch.Tensor], versions: dict[int, int]
) -> None:
    """Raises ConfigError naming every tensor allocated here and still not initialized."""
    missing: dict[int, str] = {}
    for root in roots:
        for name, module in root.named_modules():
            for kind, d in zip(("parameter", "buffer"), _dicts(module), strict=True):
                for key, t in d.items():
                    if t is None or id(t) not in replaced or id(t) in missing:
                        continue
                    if _unwritten(t, versions.get(id(t))):
                        where = f"{name}.{key}" if name else key
                        if root is not roots[0]:
                            where = f"{key} of {type(module).__name__} (not the model's)"
                        missing[id(t)] = f"{where} ({type(module).__name__} {kind})"
    if missing:
        listed = list(missing.values())
        shown = ", ".join(listed[:8]) + (f" and {len(listed) - 8} more" if len(listed) > 8 else "")
        raise ConfigError(
            f"the model was built on the meta device, and these tensors were allocated but "
            f"not initialized: {shown}. Their modules have no reset_parameters() (or it leaves "
            "them partly unset); pass init_weights=fn to the Pipeline, where fn(name, module) "
            "sets them (it is called for every module holding a tensor of this rank's stages). "
            "Buffers computed in __init__ (a causal mask, rotary inv_freq) hold garbage after "
            "allocation too: fn must compute them again"
        )


def _check_skippable(touched: Iterable[tuple[str, nn.Module]]) -> None:
    """Under ``"skip"``, raises ConfigError for non-persistent buffers: no checkpoint holds them."""
    found = [
        f"{name}.{key}" if name else key
        for name, module in touched
        for key in module._non_persistent_buffers_set
        if module._buffers.get(key) is not None
    ]
    if found:
        raise ConfigError(
            f"init_weights='skip' leaves tensors for a checkpoint load, but the non-persistent "
            f"buffers {found} are in no checkpoint (state_dict leaves them out) and would hold "
            "garbage; pass init_weights=fn instead, where fn(name, module) computes them (and "
            "the load overwrites the parameters it initializes)"
        )


def _resets(module: nn.Module) -> list[Callable[[], Any]]:
    """The module's own reset methods: ``reset_parameters`` (or ``_reset_parameters``, as
    ``nn.MultiheadAttention`` names it) and ``reset_running_stats``."""
    found = []
    for names in (("reset_parameters", "_reset_parameters"), ("reset_running_stats",)):
        method = next((m for n in names if callable(m := getattr(module, n, None))), None)
        if method is not None:
            found.append(method)
    return found


def _module_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def materialize_stages(
    stages: Sequence[nn.Module],
    own: Sequence[int],
    devices: Sequence[torch.device],
    model: nn.Module,
    init_weights: InitWeights,
    seed: int,
) -> Materialized:
    """Allocates and initializes stages ``own`` of a meta-device model, each on its device.

    The model and every stage module hold the new tensors when it returns;
    any other holder of the model's tensors (the Pipeline) applies
    :attr:`Materialized.swaps` to itself.

    Args:
        stages: every stage module (the others stay on meta).
        own: the indices of the stages this process runs.
        devices: each stage's device.
        model: the model.
        init_weights, seed: see :func:`materialize`.

    Returns:
        What ``"skip"`` left for a load (empty otherwise), and what replaced what.
    """
    left: dict[int, tuple[str, torch.Tensor]] = {}
    swaps = Swaps()
    for s in own:
        stage = stages[s]
        # A traced stage holds the model's tensors through their owners (and its constants)
        # and through the layers it calls as modules (a BatchNorm).
        traced: Sequence[nn.Module] | None = getattr(stage, "owners", None)
        found = [*traced, *stage.modules()] if traced is not None else list(stage.modules())
        owners = list({id(m): m for m in found}.values())
        for name, t in materialize(
            owners, model, devices[s], init_weights, seed, holders=stages, record=swaps
        ):
            left.setdefault(id(t), (name, t))
    return Materialized(Unloaded(model, list(left.values())), swaps)


class Swaps:
    """Which tensor replaced which while a model was materialized, for its other holders.

    Each entry keeps the tensor it replaces alive, so its ``id`` names no
    other tensor until every holder has applied the replacement. A tensor
    replaced again (allocated, then assigned anew by ``init_weights``) maps
    straight to the last one.
    """

    def __init__(self) -> None:
        self._by_old: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._old_of: dict[int, int] = {}  # id(a replacement) -> id(the tensor it replaced)

    def add(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Records that ``new`` replaced ``old`` (itself perhaps a replacement)."""
        if new is old:
            return
        first = self._old_of.pop(id(old), None)
        if first is not None:  # a replacement replaced: the first tensor maps to the last
            self._by_old[first] = (self._by_old[first][0], new)
        else:
            first = id(old)
            self._by_old.setdefault(first, (old, new))
        self._old_of[id(new)] = first

    def __len__(self) -> int:
        return len(self._by_old)

    def apply(self, holder: nn.Module) -> None:
        """In every module of ``holder``, each replaced tensor replaced by its last replacement."""
        _swap([holder], {k: new for k, (_, new) in self._by_old.items()})


@dataclass(frozen=True, eq=False)
class Materialized:
    """What :func:`materialize_stages` did.

    Args:
        unloaded: what ``init_weights="skip"`` left for a load.
        swaps: which tensor replaced which, for the model's other holders.
    """

    unloaded: Unloaded
    swaps: Swaps


@dataclass(eq=False)
class Unloaded:
    """The tensors ``init_weights="skip"`` allocated, until a load has written every one.

    Why: ``"skip"`` leaves memory as allocated for a checkpoint load; a run
    that forgets the load would train on whatever the memory held (denormals
    like 6.9e-310, a loss of exactly ln 4), silently. A tensor counts as
    loaded once it was written in place (its version counter moved: every
    ``load_state_dict``, ``load_model`` and checkpoint load copies into it) or
    the model holds another tensor in its place (``load_state_dict(assign=True)``).
    Once all are loaded the record is empty and checking it costs nothing.

    Args:
        model: the model, whose current tensors are looked up by name.
        tensors: each tensor left for a load, with its name in the model.
    """

    model: nn.Module
    tensors: list[tuple[str, torch.Tensor]]
    versions: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.versions = [t._version for _, t in self.tensors]

    def check(self, call: str) -> None:
        """Raises ConfigError naming the tensors no load has written yet, before ``call`` runs."""
        if not self.tensors:
            return
        held: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        held.update(self.model.named_buffers(remove_duplicate=False))
        left = [
            (name, t, v)
            for (name, t), v in zip(self.tensors, self.versions, strict=True)
            if held.get(name) is t and t._version == v
        ]
        self.tensors = [(name, t) for name, t, _ in left]
        self.versions = [v for _, _, v in left]
        if not left:
            return
        names = [name for name, _, _ in left]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise ConfigError(
            f"{call} ran before the weights were loaded: the model was built with "
            f"init_weights='skip', which leaves its tensors as allocated for a checkpoint "
            f"load, and {len(names)} of them were never written ({shown}). Load first "
            "(acc.load(path), pipesched.train.load_model(pipe, path) or "
            "pipe.load_state_dict(state)), or build the Pipeline with init_weights=None "
            "(each layer's reset_parameters) or init_weights=fn"
        )
