"""Parameter reallocation executor: runs a :class:`ReallocPlan` with torch.distributed.

Every device of either mesh calls :func:`execute_reallocation` with the same plan at the same time. Pieces
travel in one byte buffer per route, a route being a sender and its receivers:

- single-receiver routes go through one ``dist.batch_isend_irecv`` call;
- multi-receiver routes are ``dist.broadcast`` calls over subgroups of the route's devices, issued in one
  sorted order by every rank, so no two ranks wait on each other's later broadcast;
- local pieces are copied within the device, and a destination shard identical to the source shard is the
  source tensor itself (the plan calls it aliased).

A route's buffer is raw bytes, so parameters of different dtypes share it: optionally a float64 header of
``(sum, sum of squares)`` per piece for verification, then the pieces, grouped by element size (largest
first, so every piece starts aligned for its dtype). Sender and receivers derive the same buffer layout
from the plan; nothing but the bytes is exchanged.

Subgroups must be created collectively by every rank of the world, in the same order, before the transfer:
:func:`build_broadcast_groups` does it; build once per plan and keep the result, as creating groups is slow.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from loomrl.plan.realloc_plan import ReallocPlan, Transfer
from loomrl.plan.shards import Interval, shard_numel, shard_shape

Route = tuple[int, tuple[int, ...]]
"""``(sender, receivers)`` of a set of pieces that travel in one buffer."""
DtypeOf = Callable[[str], torch.dtype]
"""Parameter name → its dtype."""

_CHECKSUM_BYTES = 16  # float64 sum and sum of squares per piece
_RTOL = 1e-9
"""Relative tolerance of checksums: both sides sum the same values in the same order, so any slack is spare."""


class ReallocVerificationError(RuntimeError):
    """A destination shard differs from what its sender sent (checked with ``verify=True``)."""


class _Locators:
    """Maps a full flat index of a parameter to its offset in one device's local flat shard.

    The local shard is the concatenation of the device's intervals, and every piece lies inside one of them.
    """

    def __init__(self, intervals_of: Callable[[int, str], list[Interval]], device: int):
        self._intervals_of, self._device = intervals_of, device
        self._tables: dict[str, tuple[list[int], list[int]]] = {}  # param → (interval starts, local offsets)

    def offset(self, param: str, index: int) -> int:
        if param not in self._tables:
            intervals = self._intervals_of(self._device, param)
            starts = [lo for lo, _ in intervals]
            offsets = [0]
            for lo, hi in intervals[:-1]:
                offsets.append(offsets[-1] + hi - lo)
            self._tables[param] = starts, offsets
        starts, offsets = self._tables[param]
        i = bisect_right(starts, index) - 1
        return offsets[i] + index - starts[i]


def build_broadcast_groups(plan: ReallocPlan, rank_of: Mapping[int, int] | None = None
                           ) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One process group per device set of the plan's broadcasts, keyed by that sorted device tuple.

    Collective over the whole world: every rank, in a mesh of the plan or not, must call it with the same plan.
    ``rank_of`` maps a device id to its torch.distributed rank (the identity when None).
    """
    groups = {}
    for devices in plan.broadcast_groups():
        groups[devices] = dist.new_group(sorted(_rank(rank_of, d) for d in devices))
    return groups


def execute_reallocation(plan: ReallocPlan, src_tensors: Mapping[str, torch.Tensor], my_device: int, *,
                         rank_of: Mapping[int, int] | None = None,
                         groups: Mapping[tuple[int, ...], dist.ProcessGroup] | None = None,
                         dtypes: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
                         device: torch.device | str = "cpu", verify: bool = False) -> dict[str, torch.Tensor]:
    """Run ``plan`` on ``my_device``; return its destination shards (parameter name → local tensor).

    ``src_tensors``: this device's source shards as it holds them (plain local tensors, e.g. a DTensor's
    ``to_local()``, flat under FSDP); needed for every parameter the device holds in the source layout.
    ``dtypes``: every parameter's dtype, which its source shards must have (all ranks must agree: a receiver
    may hold no source tensor to learn it from). ``groups``: from :func:`build_broadcast_groups`; built here
    (a world-wide collective) when None. ``device``: where new destination shards and buffers live.
    ``verify``: compare every received piece with checksums computed by its sender, raising
    :class:`ReallocVerificationError` naming the parameter.

    Destination shards the plan marks aliased are views of the source tensors; all others are new tensors,
    which :attr:`ReallocPlan.free_after` lists for release when returning to the source layout.
    """
    dtype_of = _dtype_lookup(dtypes)
    if groups is None:
        groups = build_broadcast_groups(plan, rank_of)
    src_flat = _source_views(plan, src_tensors, my_device, dtype_of)
    out = _allocate_destination(plan, src_tensors, my_device, dtype_of, device)
    dst_flat = {name: tensor.view(-1) for name, tensor in out.items()}
    routes = _my_routes(plan, my_device)
    sends = {route: _pack(plan, pieces, src_flat, my_device, dtype_of, verify, device)
             for route, pieces in routes.items() if route[0] == my_device}
    recvs = {route: torch.empty(_layout(pieces, dtype_of, verify)[1], dtype=torch.uint8, device=device)
             for route, pieces in routes.items() if route[0] != my_device}
    works = _start_point_to_point(sends, recvs, rank_of)
    works += _start_broadcasts(sends, recvs, rank_of, groups)
    local = [t for t in plan.transfers if t.local and t.sender == my_device and not plan.aliased(my_device, t.param)]
    _copy_local(plan, local, src_flat, dst_flat, my_device)
    for work in works:
        work.wait()
    for route, buffer in recvs.items():
        _unpack(plan, routes[route], buffer, dst_flat, my_device, dtype_of, verify)
    return out


def _rank(rank_of: Mapping[int, int] | None, device: int) -> int:
    return device if rank_of is None else rank_of[device]


def _dtype_lookup(dtypes: torch.dtype | Mapping[str, torch.dtype]) -> DtypeOf:
    if isinstance(dtypes, torch.dtype):
        return lambda name: dtypes
    return lambda name: dtypes[name]


def _source_views(plan: ReallocPlan, src_tensors: Mapping[str, torch.Tensor], my_device: int,
                  dtype_of: DtypeOf) -> dict[str, torch.Tensor]:
    """Flat views of this device's source shards, checked against the plan's source layout."""
    out = {}
    for name in plan.shapes:
        numel = shard_numel(plan.src_intervals(my_device, name))
        if numel == 0:
            continue
        if name not in src_tensors:
            raise ValueError(f"{name}: device {my_device} holds a source shard but src_tensors has none")
        tensor = src_tensors[name].detach()
        if tensor.numel() != numel or tensor.dtype != dtype_of(name):
            raise ValueError(f"{name}: the source shard of device {my_device} should have {numel} elements of "
                             f"{dtype_of(name)}, got {tensor.numel()} of {tensor.dtype}")
        out[name] = tensor.reshape(-1)
    return out


def _allocate_destination(plan: ReallocPlan, src_tensors: Mapping[str, torch.Tensor], my_device: int,
                          dtype_of: DtypeOf, device: torch.device | str) -> dict[str, torch.Tensor]:
    """This device's destination shards: the source tensor where aliased, else new (uninitialised) tensors."""
    out: dict[str, torch.Tensor] = {}
    if my_device not in plan.dst.mesh:
        return out
    rank = plan.dst.mesh.index(my_device)
    for name, shape in plan.shapes.items():
        local_shape = shard_shape(name, shape, plan.dst.layout, rank, plan.num_layers)
        if local_shape is None:
            continue
        if plan.aliased(my_device, name):
            out[name] = src_tensors[name].detach().reshape(local_shape)
        else:
            out[name] = torch.empty(local_shape, dtype=dtype_of(name), device=device)
    return out


def _my_routes(plan: ReallocPlan, my_device: int) -> dict[Route, list[Transfer]]:
    """The non-local pieces this device sends or receives, per route, in plan order."""
    routes: dict[Route, list[Transfer]] = defaultdict(list)
    for t in plan.transfers:
        if not t.local and (t.sender == my_device or my_device in t.receivers):
            routes[(t.sender, t.receivers)].append(t)
    return dict(routes)


def _layout(pieces: Sequence[Transfer], dtype_of: DtypeOf, verify: bool
            ) -> tuple[list[tuple[Transfer, int]], int]:
    """``(piece, byte offset)`` in buffer order, and the buffer's size in bytes; the same on both ends."""
    offset = _CHECKSUM_BYTES * len(pieces) if verify else 0
    placed = []
    # Largest elements first: each dtype group then starts aligned, and alignment below is a no-op.
    for piece in sorted(pieces, key=lambda t: -dtype_of(t.param).itemsize):
        size = dtype_of(piece.param).itemsize
        offset = -(-offset // size) * size
        placed.append((piece, offset))
        offset += piece.numel * size
    return placed, offset


def _pack(plan: ReallocPlan, pieces: Sequence[Transfer], src_flat: Mapping[str, torch.Tensor], my_device: int,
          dtype_of: DtypeOf, verify: bool, device: torch.device | str) -> torch.Tensor:
    """The byte buffer of one route this device sends: checksums (if verifying), then every piece."""
    placed, nbytes = _layout(pieces, dtype_of, verify)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sums = buffer[:_CHECKSUM_BYTES * len(pieces)].view(torch.float64).view(-1, 2) if verify else None
    src_at = _Locators(plan.src_intervals, my_device)
    for index, (piece, offset) in enumerate(placed):
        start = src_at.offset(piece.param, piece.start)
        values = src_flat[piece.param][start:start + piece.numel]
        dtype = dtype_of(piece.param)
        buffer[offset:offset + piece.numel * dtype.itemsize].view(dtype).copy_(values)
        if sums is not None:
            sums[index] = _checksum(values)
    return buffer


def _checksum(values: torch.Tensor) -> torch.Tensor:
    wide = values.to(torch.float64)
    return torch.stack([wide.sum(), (wide * wide).sum()])


def _start_point_to_point(sends: Mapping[Route, torch.Tensor], recvs: Mapping[Route, torch.Tensor],
                          rank_of: Mapping[int, int] | None) -> list:
    """Start every single-receiver route in one batch; returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, buffer, _rank(rank_of, receivers[0]))
           for (_, receivers), buffer in sends.items() if len(receivers) == 1]
    ops += [dist.P2POp(dist.irecv, buffer, _rank(rank_of, sender))
            for (sender, receivers), buffer in recvs.items() if len(receivers) == 1]
    return list(dist.batch_isend_irecv(ops)) if ops else []


def _start_broadcasts(sends: Mapping[Route, torch.Tensor], recvs: Mapping[Route, torch.Tensor],
                      rank_of: Mapping[int, int] | None, groups: Mapping[tuple[int, ...], dist.ProcessGroup]
                      ) -> list:
    """Start this device's multi-receiver routes, in the sorted route order every rank shares."""
    buffers = {route: buf for route, buf in (*sends.items(), *recvs.items()) if len(route[1]) > 1}
    works = []
    for route in sorted(buffers):
        sender, receivers = route
        group = groups[tuple(sorted((sender, *receivers)))]
        works.append(dist.broadcast(buffers[route], src=_rank(rank_of, sender), group=group, async_op=True))
    return works


def _copy_local(plan: ReallocPlan, pieces: Sequence[Transfer], src_flat: Mapping[str, torch.Tensor],
                dst_flat: Mapping[str, torch.Tensor], my_device: int) -> None:
    """Copy the pieces this device already holds into its new destination shards."""
    src_at = _Locators(plan.src_intervals, my_device)
    dst_at = _Locators(plan.dst_intervals, my_device)
    for piece in pieces:
        src_start, dst_start = src_at.offset(piece.param, piece.start), dst_at.offset(piece.param, piece.start)
        dst_flat[piece.param][dst_start:dst_start + piece.numel].copy_(
            src_flat[piece.param][src_start:src_start + piece.numel])


def _unpack(plan: ReallocPlan, pieces: Sequence[Transfer], buffer: torch.Tensor,
            dst_flat: Mapping[str, torch.Tensor], my_device: int, dtype_of: DtypeOf, verify: bool) -> None:
    """Place a received route's pieces in the destination shards, checking them against the sender's sums."""
    placed, _ = _layout(pieces, dtype_of, verify)
    sums = buffer[:_CHECKSUM_BYTES * len(pieces)].view(torch.float64).view(-1, 2) if verify else None
    dst_at = _Locators(plan.dst_intervals, my_device)
    for index, (piece, offset) in enumerate(placed):
        start = dst_at.offset(piece.param, piece.start)
        dtype = dtype_of(piece.param)
        target = dst_flat[piece.param][start:start + piece.numel]
        target.copy_(buffer[offset:offset + piece.numel * dtype.itemsize].view(dtype))
        if sums is not None:
            _check(piece, sums[index], _checksum(target))


def _check(piece: Transfer, expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Raise unless the receiver's (sum, sum of squares) of a piece matches its sender's."""
    exp_sum, exp_sq = expected.tolist()
    got_sum, got_sq = actual.tolist()
    scale = (piece.numel * abs(exp_sq)) ** 0.5  # bounds the sum of |values|
    if not (_close(got_sum, exp_sum, _RTOL * scale) and _close(got_sq, exp_sq, _RTOL * abs(exp_sq))):
        raise ReallocVerificationError(
            f"{piece.param}: elements [{piece.start}, {piece.end}) from device {piece.sender} fail verification "
            f"(sum {got_sum!r} vs {exp_sum!r}, sum of squares {got_sq!r} vs {exp_sq!r})")


def _close(got: float, expected: float, tol: float) -> bool:
    # Equal infinities or NaNs (a source already holding them) are a faithful copy, not a corruption.
    return got == expected or abs(got - expected) <= tol or (math.isnan(got) and math.isnan(expected))
