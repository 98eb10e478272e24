"""Offloading frozen roles to host memory between their calls.

A frozen role (reference, reward: no optimizer state) on devices that other roles' calls also use is
offloaded by the plan (:meth:`loomrl.plan.ExecutionPlan.offloaded_roles`): its device memory goes to the
calls running in between. Its weights never change, so one host copy made at start-up serves every reload:
offloading releases the device storage of every parameter (the same ``resize_(0)`` that frees a trained
role's copies), reloading takes the storage back and copies the host values in, asynchronously from pinned
memory on CUDA. Parameters stay the same tensors, so DTensor (tensor-parallel) and pipeline-stage models
need nothing special: only the local shard a device holds moves.

A *trained* role the plan offloads (:class:`TrainingState`) puts its whole training state in host memory while
a generation runs on its devices: every storage its weights, gradients and optimizer hold (fp32 masters and
Adam's moments included) is copied out whole and freed, then taken back and refilled. Its values change every
step, so it is copied out at each offload rather than kept; working on storages rather than tensors covers
views and tensors sharing one storage (ZeRO's masters of fp32 weights) without knowing how they share it.

On a CPU device the "host" is the device itself: offloading would free nothing, so the worker does not
offload there (the mechanism is still exercised by the unit tests on CPU).
"""

from __future__ import annotations

import torch

from loomrl.models.lora import moving_parameters
from loomrl.parallel.data_parallel import local_shard

__all__ = ["HostCopy", "TrainingState", "bind_view", "reclaim", "release_storage"]


def release_storage(
    model: torch.nn.Module, views: frozenset[str] | set[str] = frozenset(), moving_only: bool = False
) -> None:
    """Free the device storage of every parameter's local shard; the parameters stay the same tensors.
    ``moving_only``: only of the parameters that move (a LoRA model's adapters, :mod:`loomrl.models.lora`; all
    of another model), the frozen base staying resident.

    Parameters named in ``views`` were bound to a view of another tensor (:func:`bind_view`): their storage
    is not theirs to free, so they are pointed at a one-element placeholder instead (keeping their shape)."""
    with torch.no_grad():
        for name, param in moving_parameters(model) if moving_only else model.named_parameters():
            if name in views:
                local = _stored(param)
                local.set_(torch.empty((1,) * local.dim(), dtype=local.dtype, device=local.device).expand(local.shape))
            else:
                local_shard(param).untyped_storage().resize_(0)


def bind_view(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make a parameter's local shard ``view`` itself (sharing its storage): a reallocated copy whose shard is
    a contiguous span of the training shard on the same device costs no copy and no memory. Release it with
    :func:`release_storage` naming it in ``views``, never by resizing its storage."""
    with torch.no_grad():
        _stored(param).set_(view.detach())


def _stored(param: torch.Tensor) -> torch.Tensor:
    """The tensor object holding a parameter's local shard: a DTensor's own local tensor (``to_local()`` returns
    a new tensor sharing its storage, enough to resize that storage but not to point the shard elsewhere)."""
    return getattr(param, "_local_tensor", param)


def reclaim(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard with memory of its own, taken back if :func:`release_storage` freed it, or
    given anew where it was bound to a view and then pointed at a placeholder (the values are undefined until
    written). A copy aliased under one transfer plan may not be under the next, after a plan change."""
    local = local_shard(param).detach()
    storage = local.untyped_storage()
    if storage.size() == 0:
        storage.resize_(local.numel() * local.element_size())
    elif not local.is_contiguous() or storage.size() < local.numel() * local.element_size():
        with torch.no_grad():
            _stored(param).set_(torch.empty(local.shape, dtype=local.dtype, device=local.device))
        local = local_shard(param).detach()
    return local


class HostCopy:
    """A frozen model's parameters in host memory, to release and restore its device copy around calls."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        pin = any(local_shard(p).is_cuda for p in model.parameters())
        self.host = {name: local_shard(p).detach().to("cpu", copy=True) for name, p in model.named_parameters()}
        if pin:
            self.host = {name: t.pin_memory() for name, t in self.host.items()}
        self.resident = True

    def release(self) -> None:
        """Free the device storage of every parameter (the host copy keeps the values)."""
        release_storage(self.model)
        self.resident = False

    def restore(self) -> None:
        """Take the device storage back and copy the host values in (a no-op when resident)."""
        if self.resident:
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                reclaim(param).copy_(self.host[name], non_blocking=True)
        self.resident = True

    def device_bytes(self) -> int:
        """Bytes of device storage the parameters hold now (0 when released)."""
        return sum(local_shard(p).untyped_storage().size() for p in self.model.parameters())


class TrainingState:
    """A trained role's training state moved to host memory and back (see the module docstring): its parameters'
    local shards, their gradients (``grad``, ``main_grad``) and every tensor its optimizer holds (state and
    parameter groups, which are the fp32 masters when they are not the weights themselves). What these are is
    read at each offload: gradients and the optimizer's state appear lazily, at the first backward and step."""

    def __init__(self, model: torch.nn.Module, optimizer: object | None):
        self.model, self.optimizer = model, optimizer
        self.host: dict[int, torch.Tensor] = {}
        self.moved: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []
        self.resident = True

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the state is made of now."""
        out = []
        for param in self.model.parameters():
            out.append(local_shard(param))
            out += [local_shard(g) for g in (param.grad, getattr(param, "main_grad", None)) if g is not None]
        return out + _optimizer_tensors(self.optimizer)

    def release(self) -> None:
        """Copy every distinct storage of the state to host memory (pinned on CUDA) and free it on the device."""
        if not self.resident:
            return
        seen: set[int] = set()
        self.moved = []
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in seen:
                continue
            seen.add(key)
            data = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            host = self.host.get(len(self.moved))
            if host is None or host.numel() != nbytes:  # buffers are kept between offloads
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=tensor.is_cuda)
                self.host[len(self.moved)] = host
            host.copy_(data)
            self.moved.append((storage, nbytes, host))
        for storage, _, _ in self.moved:
            storage.resize_(0)
        self.resident = False

    def restore(self) -> None:
        """Take every storage back at its size and copy its bytes in (a no-op when resident)."""
        if self.resident:
            return
        for storage, nbytes, host in self.moved:
            storage.resize_(nbytes)
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            data.copy_(host, non_blocking=True)
        self.resident = True

    def device_bytes(self) -> int:
        """Bytes of device storage the state holds now (each storage once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors()}
        return sum(storages.values())


def _optimizer_tensors(optimizer: object | None) -> list[torch.Tensor]:
    """Every tensor an optimizer holds: its state's and its parameter groups' (a wrapper such as ZeRO-1's keeps a
    torch optimizer over its fp32 shards as ``inner``)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "inner", optimizer)
    out = [local_shard(p) for group in getattr(inner, "param_groups", ()) for p in group["params"]]
    for state in getattr(inner, "state", {}).values():
        out += [local_shard(t) for t in state.values() if isinstance(t, torch.Tensor)]
    return out
