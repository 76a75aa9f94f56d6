"""Random operations routed to pipesched, and only they: its kernels at CustomRNGKeyId.

Why: torch reserves the dispatch key CustomRNGKeyId for out-of-tree generators: below
autograd and Python, above every backend, and in stock torch no operation has a kernel of
its own there. Every operation tagged ``nondeterministic_seeded`` gets a kernel at that
key, every other one a fallthrough (the dispatcher then skips the key at no cost), and a
thread turns the key on in its own dispatch state while it seeds. The kernel is C++
(``rng_kernel.cpp``, :mod:`~pipesched.runtime.compat.native_rng`) where it can be built:
it keys and seeds a CPU draw by the thread's ``Keys`` (:func:`keys_here`) and hands
every other draw to the Python kernel (the :data:`RandomHandler`), which is the whole
kernel where it cannot. A private torch API like those of
:mod:`~pipesched.runtime.compat.internals`, probed and switched off the same way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.library
import torch.utils.checkpoint
from torch._ops import OpOverload

from pipesched.errors import NativeKernelWarning, warn_user
from pipesched.runtime.compat import native_rng
from pipesched.runtime.compat.internals import _missing, _probe

__all__ = [
    "RandomHandler",
    "keys_here",
    "native_draws",
    "native_module",
    "route_random_ops",
    "route_random_ops_here",
    "walking_native",
]

RandomHandler = Callable[[OpOverload, tuple[Any, ...], dict[str, Any], Callable[..., Any]], Any]
"""Called for each random operation while routing is on: ``(op, args, kwargs, run)``, where
``run(*args, **kwargs)`` runs the operation's kernels below the key. It runs two Python frames
below the operation's caller (the kernel's, then its own): ``sys._getframe(2)`` there is the
caller's frame."""

_RNG_KEY: Any = None  # torch._C.DispatchKey.CustomRNGKeyId (not named in torch's Python enum)
_rng_libraries: dict[str, Any] = {}  # namespace -> torch.library.Library holding our kernels
_rng_names: set[str] = set()  # the operations (qualified names) looked at already
_rng_handler: RandomHandler | None = None
_rng_state: dict[str, bool] = {}  # "supported", "walk": the probes' verdicts
_rng_seen: dict[str, tuple[int, int]] = {"fingerprint": (-1, -1)}
_native: dict[str, Any] = {}  # "module": the C++ kernel's (native_rng), while it routes
_native_names: set[str] = set()  # the operations routed through it


def _rng_fingerprint() -> tuple[int, int]:
    """Grows when operations are defined: from Python (``torch.library``, ``custom_op``) or
    by a library loaded through ``torch.ops.load_library``. Cheap: read at every step."""
    return len(getattr(torch.library, "_defs", ())), len(getattr(torch.ops, "loaded_libraries", ()))


def _rng_kernel(op: OpOverload) -> Callable[..., Any]:
    """The Python kernel of one random operation: the handler runs with the key excluded, so
    the random operations the operation's own kernel calls (native_dropout's bernoulli_)
    and those the handler makes (drawing a seed) are not routed again."""
    key = _RNG_KEY
    exclude = torch._C._dispatch_tls_set_dispatch_key_excluded
    redispatch = op._handle.redispatch_boxed  # OpOverload.redispatch without its Python frame

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        run = functools.partial(redispatch, keyset.remove(key))
        handler = _rng_handler
        if handler is None:
            return run(*args, **kwargs)
        exclude(key, True)  # (it was not: the dispatcher would not have come here)
        try:
            return handler(op, args, kwargs, run)
        finally:
            exclude(key, False)

    return kernel


def _load_native() -> Any:
    """The C++ kernel's module (:mod:`~pipesched.runtime.compat.native_rng`); None (with one
    warning where it failed) for the Python kernel."""
    try:
        return native_rng.load()
    except Exception as error:
        warn_user(
            f"pipesched's C++ kernel for random operations could not be built or loaded "
            f"({type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}); random "
            f"operations take its Python kernel: the same numbers, about 20 us more per draw. "
            f"Install a C++ compiler and ninja, or set PIPESCHED_NATIVE_RNG=0 to silence this.",
            NativeKernelWarning,
        )
        return None


def _rng_register() -> None:
    """Routes the operations registered since the last call (a library may add some)."""
    from torch.library import Library, fallthrough_kernel

    _rng_seen["fingerprint"] = _rng_fingerprint()
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    has_computed = torch._C._dispatch_has_computed_kernel_for_dispatch_key
    seeded = torch.Tag.nondeterministic_seeded
    if "_" not in _rng_libraries:  # operations with no kernel at the key skip it
        fallback = _rng_libraries["_"] = Library("_", "IMPL")  # type: ignore[no-untyped-call]
        fallback.fallback(fallthrough_kernel, dispatch_key="CustomRNGKeyId")  # type: ignore[no-untyped-call]
    if "module" not in _native:
        _native["module"] = _load_native()
    for name in torch._C._dispatch_get_all_op_names():
        if name in _rng_names:
            continue
        _rng_names.add(name)
        namespace, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
        except Exception:  # a name torch.ops cannot resolve: never called from Python either
            continue
        if seeded in op.tags:
            kernel: Any = _rng_kernel(op)
            native = _native.get("module")
            if native is not None and native.route(f"{namespace}::{op_name}", overload, kernel):
                _native_names.add(name)
                continue  # the C++ kernel, the Python one behind it
        elif has_computed(name, "CustomRNGKeyId") and not has_kernel(name, "BackendSelect"):
            # A composite kernel torch put at every backend key: skipped, as at the CPU's.
            # (BackendSelect kernels recompute the keys without the per-operation
            # fallthrough mask: those keep the composite, the kernel their backends run.)
            kernel = fallthrough_kernel
        else:
            continue
        library = _rng_libraries.get(namespace)
        if library is None:
            library = _rng_libraries[namespace] = Library(namespace, "IMPL")  # type: ignore[no-untyped-call]
        library.impl(rest, kernel, "CustomRNGKeyId", with_keyset=kernel is not fallthrough_kernel)


def _check_random_ops() -> bool:
    """Routing sees each random operation once, with the key on only, and changes no number."""
    global _rng_handler
    seen: list[str] = []

    def handler(op: OpOverload, args: Any, kwargs: Any, run: Callable[..., Any]) -> Any:
        seen.append(str(op))
        return run(*args, **kwargs)

    x = torch.linspace(-1.0, 1.0, 12, requires_grad=True)
    plain = [x.div(3.0), x.to(torch.float64), torch.linspace(x[0], x[1], 3)]
    _rng_handler = handler
    try:
        torch.empty(3).bernoulli_(0.5)  # the key is off: not routed
        was = route_random_ops_here(True)
        try:
            y = torch.nn.functional.dropout(x, 0.5)
            torch.ops.aten.native_dropout.default(x.detach(), 0.5, True)
            again = [x.div(3.0), x.to(torch.float64), torch.linspace(x[0], x[1], 3)]
        finally:
            route_random_ops_here(was)
        y.sum().backward()  # type: ignore[no-untyped-call]
    finally:
        _rng_handler = None
    return (
        seen == ["aten.bernoulli_.float", "aten.native_dropout.default"]
        and all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))
        and x.grad is not None
        and torch.equal(x.grad != 0, y != 0)
    )


def _check_native() -> bool:
    """The C++ kernel seeds a CPU draw as a generator given its ``Keys``' seed would, and
    hands a draw to the Python kernel where the keys say so (a pass that learns)."""
    global _rng_handler
    native = _native["module"]
    handled: list[str] = []

    def handler(op: OpOverload, args: Any, kwargs: Any, run: Callable[..., Any]) -> Any:
        handled.append(str(op))
        return run(*args, **kwargs)

    code = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__
    names = native.Names([], [12345], [0], 0, code)
    fast, twin = native.Keys(names, 3, 77, None), native.Keys(names, 3, 77, None)
    fast.learns, fast.known = False, 1234
    _rng_handler = handler
    previous = native.keys_here(fast)
    was = route_random_ops_here(True)
    try:
        drawn = torch.empty(64).bernoulli_(0.5)
        fast.learns = True
        torch.empty(3).bernoulli_(0.5)  # the Python kernel's
    finally:
        route_random_ops_here(was)
        native.keys_here(previous)
        _rng_handler = None
    seed, _ = twin.seed_for(None, 1234, False)
    expected = torch.empty(64).bernoulli_(0.5, generator=torch.Generator().manual_seed(seed))
    return torch.equal(drawn, expected) and handled == ["aten.bernoulli_.float"]


def native_module() -> Any:
    """The C++ kernel's module while it routes (its ``Keys`` and ``Names``: see
    ``rng_kernel.cpp``); None where the Python kernel routes, or nothing does."""
    return _native.get("module") if _rng_state.get("supported") else None


def walking_native(check: Callable[[Any], bool]) -> Any:
    """:func:`native_module`, where its walk of the call stack passes ``check`` (given the
    module; run once per process, one ``TorchInternalsWarning`` where it fails); None
    where it does not route, or the walk failed."""
    native = native_module()
    if native is None:
        return None
    agrees = _rng_state.get("walk")
    if agrees is None:
        agrees = _rng_state["walk"] = _probe(lambda: check(native))
        if not agrees:
            _missing(
                "pipesched's C++ kernel's walk of the call stack (its probe)",
                "every random operation takes the Python kernel (about 35 us more per draw)",
            )
    return native if agrees else None


def keys_here(keys: Any) -> Any:
    """Sets the ``Keys`` the C++ kernel seeds this thread's CPU draws by (None: it hands them
    all to the :data:`RandomHandler`); returns the previous ones. Only where
    :func:`native_module` is not None."""
    return _native["module"].keys_here(keys)


def native_draws() -> tuple[int, int] | None:
    """(draws the C++ kernel seeded, draws it handed to the handler) in this process; None
    where it does not route."""
    native = _native.get("module")
    return None if native is None else tuple(native.draws())


def _drop_native() -> None:
    """The C++ kernel off: the operations it routed get the Python kernel."""
    _native["module"].unroute()
    _native["module"] = None
    _rng_names.difference_update(_native_names)
    _native_names.clear()
    _rng_register()


def route_random_ops(handler: RandomHandler, *, refresh: bool = False) -> bool:
    """Routes every random operation to ``handler`` where a thread turns routing on.

    Installs the kernels on the first call (about 0.2 s, and the C++ kernel's build the
    first time on a machine) and probes them; a later
    call routes the operations defined since (seen by :func:`_rng_fingerprint`, or
    all with ``refresh``). Called where no stage runs (the dispatcher's tables change).

    Args:
        handler: called for each random operation (:data:`RandomHandler`).
        refresh: look for operations registered since the last call whatever the
            fingerprint says (a C++ extension imported as a Python module); a few
            milliseconds.

    Returns whether routing works here; False: it is off for good (one warning), and
    the caller seeds with a ``TorchDispatchMode`` instead.
    """
    global _RNG_KEY, _rng_handler
    supported = _rng_state.get("supported")
    if supported is False:
        return False
    if supported is None or refresh or _rng_fingerprint() != _rng_seen["fingerprint"]:
        try:
            if _RNG_KEY is None:
                _RNG_KEY = torch._C._parse_dispatch_key("CustomRNGKeyId")
            _rng_register()
        except Exception:
            _rng_state["supported"] = False
        if "supported" not in _rng_state:
            _rng_state["supported"] = _probe(_check_random_ops)
            if _native.get("module") is not None and not _probe(_check_native):
                _drop_native()
                _missing(
                    "pipesched's C++ kernel for random operations (its probe)",
                    "random operations take its Python kernel (about 20 us more per draw)",
                )
        if not _rng_state["supported"]:
            for library in _rng_libraries.values():
                library._destroy()
            _rng_libraries.clear()
            if _native.get("module") is not None:
                _native["module"].unroute()
                _native["module"] = None
            _missing(
                "the dispatch key CustomRNGKeyId",
                "random operations are seeded by a TorchDispatchMode (a Python call per operation)",
            )
            return False
    _rng_handler = handler
    return True


def route_random_ops_here(on: bool) -> bool:
    """Turns routing on or off in this thread (its dispatch state); returns whether it was on.

    Only after :func:`route_random_ops` returned True. The autograd engine carries the
    state into the backward it runs (recomputations included).
    """
    was = torch._C._dispatch_tls_is_dispatch_key_included(_RNG_KEY)
    torch._C._dispatch_tls_set_dispatch_key_included(_RNG_KEY, on)
    return was
