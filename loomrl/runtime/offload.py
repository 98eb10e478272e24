"""Offloading frozen roles to host memory between their calls.

A frozen role (reference, reward: no optimizer state) on devices that other roles' calls also use is
offloaded by the plan (:meth:`loomrl.plan.ExecutionPlan.offloaded_roles`): its device memory goes to the
calls running in between. Its weights never change, so one host copy made at start-up serves every reload:
offloading releases the device storage of every parameter (the same ``resize_(0)`` that frees a trained
role's copies), reloading takes the storage back and copies the host values in, asynchronously from pinned
memory on CUDA. Parameters stay the same tensors, so DTensor (tensor-parallel) and pipeline-stage models
need nothing special: only the local shard a device holds moves.

On a CPU device the "host" is the device itself: offloading would free nothing, so the worker does not
offload there (the mechanism is still exercised by the unit tests on CPU).
"""

from __future__ import annotations

import torch

__all__ = ["HostCopy"]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard, or the parameter itself."""
    return param.to_local() if hasattr(param, "to_local") else param


class HostCopy:
    """A frozen model's parameters in host memory, to release and restore its device copy around calls."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        pin = any(_local(p).is_cuda for p in model.parameters())
        self.host = {name: _local(p).detach().to("cpu", copy=True) for name, p in model.named_parameters()}
        if pin:
            self.host = {name: t.pin_memory() for name, t in self.host.items()}
        self.resident = True

    def release(self) -> None:
        """Free the device storage of every parameter (the host copy keeps the values)."""
        for param in self.model.parameters():
            _local(param).untyped_storage().resize_(0)
        self.resident = False

    def restore(self) -> None:
        """Take the device storage back and copy the host values in (a no-op when resident)."""
        if self.resident:
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                local = _local(param)
                local.untyped_storage().resize_(local.numel() * local.element_size())
                local.copy_(self.host[name], non_blocking=True)
        self.resident = True

    def device_bytes(self) -> int:
        """Bytes of device storage the parameters hold now (0 when released)."""
        return sum(_local(p).untyped_storage().size() for p in self.model.parameters())
