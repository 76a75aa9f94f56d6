"""A GradScaler driven once per accumulation window, with one inf check over every stage.

Why not GradScaler's ``unscale_``/``step``: they decide per optimizer, so one stage
could step while another skips. The scaler stays the user's and its scale the
truth; the window reads it, checks all stages once, and sets the next with
``update(new_scale=...)``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipesched.errors import ConfigError
from pipesched.runtime import scaler_device

__all__ = ["LossScale"]


class LossScale:
    """The loss scale of a window: constant inside it, backed off or grown at its end.

    Args:
        scaler: a ``torch.amp.GradScaler``, or None for no scaling.
        devices: the pipeline's devices; the scaler must be made for their type.

    Raises:
        ConfigError: the scaler is for another device type than the pipeline's.
    """

    def __init__(self, scaler: Any, devices: list[torch.device]) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.growth_tracker = 0
        if self.scaler is None:
            return
        device = scaler_device(self.scaler)
        kinds = sorted({d.type for d in devices})
        if kinds != [device]:
            raise ConfigError(
                f"scaler is a GradScaler for device {device!r} but the pipeline runs on "
                f"{kinds}; create it with torch.amp.GradScaler({kinds[0]!r})"
            )
        self._device = torch.device(device)

    def value(self) -> float:
        """The current scale (1.0 without a scaler); initializes the scaler on first use."""
        if self.scaler is None:
            return 1.0
        return float(self.scaler.scale(torch.ones((), device=self._device)))

    def update(self, found_inf: bool) -> None:
        """Ends the window: back off on an inf, grow after ``growth_interval`` clean windows."""
        if self.scaler is None:
            return
        scale = self.value()
        if found_inf:
            scale *= self.scaler.get_backoff_factor()
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.scaler.get_growth_interval():
                scale *= self.scaler.get_growth_factor()
                self.growth_tracker = 0
        self.scaler.update(new_scale=scale)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and our growth tracker."""
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state["scaler"])
            self.growth_tracker = int(state["growth_tracker"])
