"""A module holding another model's layers under their own names, even names it uses itself.

Why: the Pipeline registers the model's entries on itself so that checkpoints
carry the plain model's names; torch's ``add_module`` refuses a name the
Pipeline uses too (timm's ConvNeXt has ``stages``), so entries go straight into
``_modules``/``_parameters``/``_buffers`` while attribute access keeps meaning
the Pipeline's own attribute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["Shadowing", "register_model", "register_named"]


class Shadowing(nn.Module):
    """An ``nn.Module`` whose own attributes and a held model's entries may share names.

    ``_shadowed`` (in ``__dict__``) holds the names registered by
    :func:`register_named` that are also an attribute of this module: for
    them, ``setattr``/``delattr`` act on the attribute, never on the model's
    entry, and ``get_submodule``/``get_parameter``/``get_buffer`` find the entry.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_shadowed", ()):
            object.__setattr__(self, name, value)  # the attribute; the model's entry stays
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_shadowed", ()):
            object.__delattr__(self, name)
        else:
            super().__delattr__(name)

    def get_submodule(self, target: str) -> nn.Module:
        """The submodule at ``target``, a model's layer first where its name is shadowed."""
        head, _, rest = target.partition(".")
        layer = self._modules.get(head) if head in self.__dict__.get("_shadowed", ()) else None
        if layer is not None:
            return layer.get_submodule(rest) if rest else layer
        return super().get_submodule(target)

    def get_parameter(self, target: str) -> nn.Parameter:
        """The parameter at ``target``, a model's first where its name is shadowed."""
        if target in self.__dict__.get("_shadowed", ()) and target in self._parameters:
            found = self._parameters[target]
            if isinstance(found, nn.Parameter):
                return found
        return super().get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        """The buffer at ``target``, a model's first where its name is shadowed."""
        if target in self.__dict__.get("_shadowed", ()) and target in self._buffers:
            found = self._buffers[target]
            if found is not None:
                return found
        return super().get_buffer(target)


def register_named(
    holder: nn.Module, name: str, value: nn.Module | torch.Tensor, *, persistent: bool = True
) -> None:
    """Registers a model's layer, parameter or buffer on ``holder`` under its own ``name``.

    A free name is registered as torch does (``add_module``,
    ``register_parameter``, ``register_buffer``). A name ``holder`` already
    uses (an attribute of its class or instance, or an earlier entry) goes
    straight into its ``_modules`` / ``_parameters`` / ``_buffers`` in place
    of any earlier entry, and into ``holder._shadowed`` where an attribute
    holds it.

    Args:
        holder: the module to register on (a :class:`Shadowing`).
        name: the name in the model.
        value: the layer, parameter or buffer.
        persistent: for a buffer, whether ``state_dict()`` carries it.
    """
    held = (holder.__dict__, holder._modules, holder._parameters, holder._buffers)
    if not (hasattr(type(holder), name) or any(name in names for names in held)):
        if isinstance(value, nn.Module):
            holder.add_module(name, value)
        elif isinstance(value, nn.Parameter):
            holder.register_parameter(name, value)
        else:
            holder.register_buffer(name, value, persistent=persistent)
        return
    stores: dict[type, dict[str, Any]] = {
        nn.Module: holder._modules,
        nn.Parameter: holder._parameters,
        torch.Tensor: holder._buffers,
    }
    kind = next(k for k in stores if isinstance(value, k))
    for k, store in stores.items():
        if k is not kind:
            store.pop(name, None)
    stores[kind][name] = value
    holder._non_persistent_buffers_set.discard(name)
    if kind is torch.Tensor and not persistent:
        holder._non_persistent_buffers_set.add(name)
    if hasattr(type(holder), name) or name in holder.__dict__:
        holder.__dict__.setdefault("_shadowed", set()).add(name)


def register_model(holder: nn.Module, module: nn.Module) -> None:
    """Registers ``module``'s children, parameters and buffers on ``holder``, under their names."""
    for name, layer in module.named_children():
        register_named(holder, name, layer)
    for name, param in module.named_parameters(recurse=False):
        register_named(holder, name, param)
    for name, buffer in module.named_buffers(recurse=False):
        persistent = name not in module._non_persistent_buffers_set
        register_named(holder, name, buffer, persistent=persistent)
