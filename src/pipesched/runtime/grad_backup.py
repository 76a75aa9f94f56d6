"""Copies of the gradients pending before a step, held off the device so the step adds in place.

Why: a step that fails must change nothing, so what ``.grad`` held before it
must survive it. Set aside on the device (``grad_backup="device"``) it costs
a second gradient buffer during every step of a window after the first;
copied here it costs one copy per such step and no device memory:
``"host"`` copies CUDA gradients into pinned host memory, ``"disk"`` writes
every gradient to a temporary file. Both are read back only when a step fails.
"""

from __future__ import annotations

import ctypes
import io
import tempfile

import torch

from pipesched.errors import GradientBackupError

__all__ = ["BACKUPS", "DiskCopies", "HostCopies", "copies_for", "in_place", "read_back"]

BACKUPS = ("device", "host", "disk")
"""Where a step keeps the gradients pending before it (``Pipeline(grad_backup=...)``)."""


def in_place(backup: str, grad: torch.Tensor) -> bool:
    """Whether ``grad`` is copied under ``backup`` (then written into in place).

    Sparse gradients, tensor subclasses (a sharded stage's DTensor shards, a
    1/dp part) and under ``"host"`` tensors already in host memory are set
    aside as under ``"device"``.
    """
    if backup == "device" or grad.layout != torch.strided or type(grad) is not torch.Tensor:
        return False
    return backup == "disk" or grad.device.type != "cpu"


class HostCopies:
    """Each gradient copied into pinned host memory, waited for before the step adds.

    Args:
        grads: the gradients, on CUDA devices.
    """

    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.copies = []
        for grad in grads:
            copy = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
            copy.copy_(grad, non_blocking=True)
            self.copies.append(copy)
        # The stages' streams are not the copies' stream: wait here, before any adds.
        for device in {grad.device for grad in grads}:
            torch.cuda.current_stream(device).synchronize()

    def put_back(self, grads: list[torch.Tensor]) -> None:
        """Writes the copies back into ``grads`` (the same tensors, in order)."""
        with torch.no_grad():
            for grad, copy in zip(grads, self.copies, strict=True):
                grad.copy_(copy)

    def close(self) -> None:
        """Frees the copies (torch's pinned-memory cache keeps them for the next step)."""
        self.copies = []


class DiskCopies:
    """Each gradient's bytes written in order to an anonymous temporary file.

    The file lives in ``tempfile.gettempdir()`` (``TMPDIR``) and is deleted
    when closed. A contiguous CPU gradient is written and read back from its
    own memory; any other is staged through one host tensor at a time.

    Args:
        grads: the gradients.
    """

    def __init__(self, grads: list[torch.Tensor]) -> None:
        # Open across the step (closed by commit or put-back), not in a with block.
        file = tempfile.TemporaryFile(prefix="pipesched-grads-")  # noqa: SIM115
        self.file: io.BufferedRandom | None = file
        for grad in grads:
            host = _host(grad)
            self.file.write(_bytes(host))
        self.file.flush()

    def put_back(self, grads: list[torch.Tensor]) -> None:
        """Reads the file back into ``grads`` (the same tensors, in order)."""
        if self.file is None:  # pipesched's own order: a put-back always precedes close
            raise RuntimeError("the gradient backup was put back after it was closed")
        self.file.seek(0)
        with torch.no_grad():
            for grad in grads:
                direct = grad.device.type == "cpu" and grad.is_contiguous()
                target = grad if direct else torch.empty(grad.shape, dtype=grad.dtype)
                view = _bytes(target)
                if self.file.readinto(view) != view.nbytes:
                    raise RuntimeError(
                        f"the gradient backup in {self.file.name!r} was cut short: it was "
                        "changed or truncated while the step ran"
                    )
                if not direct:
                    grad.copy_(target)

    def close(self) -> None:
        """Deletes the file."""
        if self.file is not None:
            self.file.close()
            self.file = None


def copies_for(
    backup: str, tensors: list[torch.Tensor], what: str
) -> HostCopies | DiskCopies | None:
    """The copies ``backup`` keeps of ``tensors`` (None when there are none).

    Raises:
        GradientBackupError: they could not be made (``what`` names them); nothing
            was changed.
    """
    if not tensors:
        return None
    try:
        return DiskCopies(tensors) if backup == "disk" else HostCopies(tensors)
    except (OSError, RuntimeError) as err:
        raise GradientBackupError(
            f"grad_backup={backup!r} could not copy {what} ({err}); nothing changed: free "
            f"space in TMPDIR (or host memory), or use grad_backup='device'"
        ) from err


def read_back(copies: HostCopies | DiskCopies, tensors: list[torch.Tensor], lost: str) -> None:
    """Writes ``copies`` back into ``tensors`` and drops them.

    Raises:
        GradientBackupError: they could not be read back; ``lost`` says what is lost
            and what to do.
    """
    try:
        copies.put_back(tensors)
    except (OSError, RuntimeError) as err:
        raise GradientBackupError(f"a copy could not be read back ({err}): {lost}") from err
    finally:
        copies.close()


def _host(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a contiguous CPU tensor (itself where it is one)."""
    return grad.detach().to("cpu").contiguous()


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, not copied (numpy is not a dependency)."""
    size = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")
