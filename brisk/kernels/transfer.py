"""A step's small host-made inputs onto the model's device."""

from __future__ import annotations

import torch


def to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step's small host-made input as a tensor on device. To an accelerator it goes through
    pinned memory with a non-blocking copy: a copy from pageable memory makes the host wait for
    the GPU's queue, which would serialize building the next inputs with the step before it."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_many(columns: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Several int64 lists as tensors on device, in one transfer: each copy to a GPU costs some
    microseconds of launch whatever its size, and a step has about eight such inputs."""
    if device.type == "cpu":
        return [torch.tensor(column, dtype=torch.long) for column in columns]
    flat = to_device([value for column in columns for value in column], torch.long, device)
    return list(flat.split([len(column) for column in columns]))
