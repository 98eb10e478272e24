"""Parameter reallocation executor: runs a :class:`ReallocPlan` with torch.distributed.

Every device of either mesh calls :func:`execute_reallocation` with the same plan at the same time. Pieces
travel in one byte buffer per route, a route being a sender and its receivers:

- single-receiver routes go through one ``dist.batch_isend_irecv`` call;
- multi-receiver routes are ``dist.broadcast`` calls over subgroups of the route's devices, issued in one
  sorted order by every rank, so no two ranks wait on each other's later broadcast;
- local pieces are copied within the device, and a destination shard that is one contiguous span of the
  device's source shard is a view of the source tensor (the plan calls it aliased): no copy, no memory.

An entry (a parameter's pieces on one route) of at least
:data:`~loomrl.parallel.realloc_program.DIRECT_MIN_NUMEL` elements (large weights) that lies in one contiguous
span of the sender's source shard or of every receiver's destination shard travels *directly*, in its own
message: sent from the source shard where its elements are contiguous there, and received into the
destination shard where they are contiguous there. A side where they are not (a row-split weight's columns)
stages them in a buffer of the entry's own: gathered before sending, or scattered after arriving. So a large
entry costs at most one copy beyond the wire, where packing it into the route buffer would cost two (on CPU
devices, where the wire itself is a memory copy, that halves the time). Every participant derives the same
decision from the plan alone.

The plan is compiled once per device into a :class:`~loomrl.parallel.realloc_program.TransferProgram`
(:func:`compile_program`: entries, their strided runs or index tensors, the route buffers' layout), so
packing, unpacking and local copies take one strided ``copy_`` per run, or one ``index_select`` /
``index_copy_`` per entry, however many pieces it has. A call then binds the caller's tensors to the
schedule: flat views, messages and the copies of each phase (packing, local pieces, each message's landing),
run as one ``torch._foreach_copy_`` per phase. The schedule keeps the last binding and reuses it while the
same tensors come back (the runtime passes its parameters every iteration), so a repeated call makes no views
and loops over no entries in Python.

Subgroups must be created collectively by every rank of the world, in the same order, before the transfer:
:func:`build_broadcast_groups` does it; build once per plan and keep the result, as creating groups is slow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from loomrl.parallel.realloc_program import (
    DtypeOf,
    Entry,
    Route,
    RouteBuffer,
    Side,
    StridedRun,
    TransferProgram,
    bind_buffers,
    clear_programs,
    compile_program,
)
from loomrl.plan.realloc_plan import ReallocPlan

__all__ = [
    "ReallocVerificationError",
    "build_broadcast_groups",
    "clear_programs",
    "compile_program",
    "execute_reallocation",
]

_RTOL = 1e-9
"""Relative tolerance of checksums: both sides sum the same values in the same order, so any slack is spare."""


class ReallocVerificationError(RuntimeError):
    """A destination shard differs from what its sender sent (checked with ``verify=True``)."""


# ---------------------------------------------------------------------------------------------- execution
def build_broadcast_groups(
    plan: ReallocPlan, rank_of: Mapping[int, int] | None = None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One process group per device set of the plan's broadcasts, keyed by that sorted device tuple.

    Collective over the whole world: every rank, in a mesh of the plan or not, must call it with the same plan.
    ``rank_of`` maps a device id to its torch.distributed rank (the identity when None).
    """
    groups = {}
    for devices in plan.broadcast_groups():
        groups[devices] = dist.new_group(sorted(_rank(rank_of, d) for d in devices))
    return groups


def execute_reallocation(
    plan: ReallocPlan,
    src_tensors: Mapping[str, torch.Tensor],
    my_device: int,
    *,
    rank_of: Mapping[int, int] | None = None,
    groups: Mapping[tuple[int, ...], dist.ProcessGroup] | None = None,
    dtypes: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
    device: torch.device | str = "cpu",
    verify: bool = False,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """StridedRun ``plan`` on ``my_device``; return its destination shards (parameter name → local tensor).

    ``src_tensors``: this device's source shards as it holds them (plain local tensors, e.g. a DTensor's
    ``to_local()``: under FSDP its dim-0 block); needed for every parameter the device holds in the source layout.
    ``dtypes``: every parameter's dtype, which its source shards must have (all ranks must agree: a receiver
    may hold no source tensor to learn it from). ``groups``: from :func:`build_broadcast_groups`; built here
    (a world-wide collective) when None. ``device``: where new destination shards and buffers live.
    ``verify``: compare every received entry (a parameter's pieces on one route) with checksums computed by
    its sender, raising :class:`ReallocVerificationError` naming the parameter.

    Destination shards the plan marks aliased are views of the source tensors; all others are new tensors,
    which :attr:`ReallocPlan.free_after` lists for release when returning to the source layout. Given ``out``
    (parameter name → a contiguous tensor of the destination shard's shape and dtype, e.g. the parameters of
    the model in the destination layout), the other shards are written there instead: no allocation and no
    copy afterwards. Aliased shards are still returned as views (``out`` needs no tensor for them and any it
    holds is left alone): a caller keeping its own copy binds its parameter to the view, as the runtime's
    workers do. The first call
    with a plan compiles this device's schedule and route buffers, which later calls with the same plan
    object reuse (see :func:`compile_program`).
    """
    dtype_of = _dtype_lookup(dtypes)
    if groups is None:
        groups = build_broadcast_groups(plan, rank_of)
    schedule = compile_program(plan, my_device)
    device = torch.device(device)
    if schedule._lock.acquire(blocking=False):
        try:
            buffers = schedule.buffers(dtype_of, verify, device)
            bound = _bound(schedule, buffers, src_tensors, out, dtype_of, device)
            _transfer(schedule, buffers, bound, rank_of, groups, verify)
        finally:
            schedule._lock.release()
    else:  # another thread runs this plan on this device: its buffers are busy, so use new ones
        buffers = bind_buffers(schedule.routes, schedule.direct, dtype_of, verify, device)
        bound = _bind_tensors(schedule, buffers, src_tensors, out, dtype_of, device)
        _transfer(schedule, buffers, bound, rank_of, groups, verify)
    return dict(bound.out)


class _Copies:
    """Copies to run together: pairs of same-shaped views, run by one ``torch._foreach_copy_`` (a single
    dispatch, where a Python loop pays about a microsecond per copy: an executor call makes hundreds), and the
    copies that need more than a view (index copies, two-step copies) as calls."""

    __slots__ = ("calls", "dsts", "srcs")

    def __init__(self) -> None:
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.calls: list[Callable[[], object]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dsts.append(dst)
        self.srcs.append(src)

    def call(self, fn: Callable[..., object], *args: object) -> None:
        self.calls.append(partial(fn, *args))

    def run(self) -> None:
        if self.dsts:
            torch._foreach_copy_(self.dsts, self.srcs)
        for call in self.calls:
            call()


@dataclass(eq=False)
class _Bound:
    """One call's tensors bound to a schedule: flat views, every message and every copy, made once.

    Built per call from the caller's tensors; kept by the schedule (:func:`_bound`) and reused while the caller
    passes the same tensors again (same storages at the same offsets and shapes), as the runtime's workers do
    every iteration, so a call then makes no views and no Python loop over entries."""

    key: tuple | None
    buffers: Mapping[Route, RouteBuffer]
    src_flat: dict[str, torch.Tensor]
    dst_flat: dict[str, torch.Tensor]
    out: dict[str, torch.Tensor]
    sends: dict[Route, list[Message]]
    recvs: dict[Route, list[Message]]
    early_sends: dict[Route, list[Message]]
    """The sends that need no packing (unstaged direct entries), started with the receives on CPU buffers."""
    late_sends: dict[Route, list[Message]]
    """The rest: packed buffers and staged direct entries, started once packed."""
    pack: _Copies
    local: _Copies
    land: dict[tuple[Route, int], _Copies]
    """What to copy once a received message ``(route, tag)`` has arrived."""


def _bound(
    schedule: TransferProgram,
    buffers: Mapping[Route, RouteBuffer],
    src_tensors: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor] | None,
    dtype_of: DtypeOf,
    device: torch.device,
) -> _Bound:
    """The schedule's bound call for these tensors: the kept one if the same tensors came back, else a new one,
    kept when it may be (every destination shard is the caller's or a view: new ones must be new each call,
    and every source shard is contiguous, so its flat view shares the given tensor's storage)."""
    key = _identity(schedule, src_tensors, out)
    kept = schedule.binding
    if key is not None and isinstance(kept, _Bound) and kept.key == key and kept.buffers is buffers:
        return kept
    bound = _bind_tensors(schedule, buffers, src_tensors, out, dtype_of, device, key)
    if key is not None:
        schedule.binding = bound  # its views keep the storages alive, so no other storage takes their addresses
    return bound


def _identity(
    schedule: TransferProgram, src_tensors: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor] | None
) -> tuple | None:
    """What a bound call's views depend on: each given tensor's storage, offset, shape, strides and dtype; None
    when the call may not be kept (a new destination shard to allocate, a non-contiguous source shard)."""
    new_shards = any(alias is None for _, _, alias in schedule.dst_shapes)
    if new_shards and out is None:
        return None
    key = []
    for name in schedule.src_numel:
        tensor = src_tensors.get(name)
        if tensor is None or not tensor.is_contiguous():
            return None
        key.append(_tensor_key(tensor))
    if new_shards:
        for name, _, alias in schedule.dst_shapes:
            if alias is None:
                tensor = out.get(name)
                if tensor is None:
                    return None
                key.append(_tensor_key(tensor))
    return tuple(key)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage()._cdata, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)


def _bind_tensors(
    schedule: TransferProgram,
    buffers: Mapping[Route, RouteBuffer],
    src_tensors: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor] | None,
    dtype_of: DtypeOf,
    device: torch.device,
    key: tuple | None = None,
) -> _Bound:
    """Check the caller's tensors against the schedule and make every view, message and copy of a call."""
    me = schedule.device
    src_flat = _source_views(schedule, src_tensors, dtype_of)
    dst = _destination(schedule, src_flat, dtype_of, device, out)
    dst_flat = {name: tensor.view(-1) for name, tensor in dst.items()}
    pack, local, land = _Copies(), _Copies(), {}
    sends, recvs = {}, {}
    for route, rb in buffers.items():
        if route[0] == me:
            _pack_into(pack, rb, src_flat)
            sends[route] = _messages(rb, src_flat, _src_view)
        else:
            recvs[route] = _messages(rb, dst_flat, _dst_view)
            for tag, _ in recvs[route]:
                land[(route, tag)] = _landing(rb, dst_flat, tag)
    _local_into(local, schedule.local, src_flat, dst_flat)
    early = {
        route: [m for m in msgs if m[0] > 0 and m[0] - 1 not in buffers[route].staged] for route, msgs in sends.items()
    }
    late = {route: [m for m in msgs if m[0] == 0 or m[0] - 1 in buffers[route].staged] for route, msgs in sends.items()}
    return _Bound(key, buffers, src_flat, dst_flat, dst, sends, recvs, early, late, pack, local, land)


def _transfer(
    schedule: TransferProgram,
    buffers: Mapping[Route, RouteBuffer],
    bound: _Bound,
    rank_of: Mapping[int, int] | None,
    groups: Mapping[tuple[int, ...], dist.ProcessGroup],
    verify: bool,
) -> None:
    """Send, copy local pieces while the network works, and unpack each route's buffer once it has arrived.

    A route's messages are its packed buffer (tag 0, when it holds anything) and its direct entries (tags 1,
    2, ... in schedule order). On CPU buffers (gloo), which match a receive with its send by peer and tag
    whenever either is posted, every point-to-point receive and every direct send from a source shard is
    posted first, so no sender waits for a receiver that is still packing; other backends (NCCL) take a
    device's sends and receives in one batch, in one order on both sides.
    """
    early = all(rb.buffer.device.type == "cpu" for rb in buffers.values())
    started: Started = []
    if early:
        started += _start_point_to_point(bound.early_sends, bound.recvs, rank_of)
    bound.pack.run()
    if verify:
        for route in bound.sends:
            _sum_sent(buffers[route], bound.src_flat)
    if early:
        started += _start_point_to_point(bound.late_sends, {}, rank_of)
    else:
        started += _start_point_to_point(bound.sends, bound.recvs, rank_of)
    started += _start_broadcasts(bound.sends, bound.recvs, rank_of, groups)
    bound.local.run()
    failed: ReallocVerificationError | None = None  # raised once every work is done: the buffers are reused
    for arrived, work in started:
        if work is not None:
            work.wait()
        for route, tag in arrived:
            bound.land[(route, tag)].run()
            if verify and tag == 0:
                try:
                    _check_packed(buffers[route], bound.dst_flat)
                except ReallocVerificationError as error:
                    failed = failed or error
    if verify:
        for route in bound.recvs:
            try:
                _check_direct(buffers[route], bound.dst_flat)
            except ReallocVerificationError as error:
                failed = failed or error
    if failed is not None:
        raise failed


Message = tuple[int, torch.Tensor]
"""``(tag, tensor)``: tag 0 is a route's packed buffer, ``i + 1`` its i-th direct entry."""


def _messages(rb: RouteBuffer, flat: Mapping[str, torch.Tensor], view) -> list[Message]:
    """A route's messages on this device: its buffer when it holds anything, then its direct entries (each
    its staging buffer, or its view of ``flat``)."""
    out: list[Message] = [(0, rb.buffer)] if rb.buffer.numel() else []
    return out + [(i + 1, rb.staged[i] if i in rb.staged else view(flat, entry)) for i, entry in enumerate(rb.direct)]


def _src_view(src_flat: Mapping[str, torch.Tensor], entry: Entry) -> torch.Tensor:
    """The sender's elements of an unstaged direct entry, contiguous in its source shard."""
    start = entry.src.runs[0].offset
    return src_flat[entry.param][start : start + entry.numel].contiguous()


def _dst_view(dst_flat: Mapping[str, torch.Tensor], entry: Entry) -> torch.Tensor:
    """Where an unstaged direct entry lands, contiguous in the receiver's destination shard."""
    start = entry.dst.runs[0].offset
    return dst_flat[entry.param][start : start + entry.numel]


def _rank(rank_of: Mapping[int, int] | None, device: int) -> int:
    return device if rank_of is None else rank_of[device]


def _dtype_lookup(dtypes: torch.dtype | Mapping[str, torch.dtype]) -> DtypeOf:
    if isinstance(dtypes, torch.dtype):
        return lambda name: dtypes
    return lambda name: dtypes[name]


def _source_views(
    schedule: TransferProgram, src_tensors: Mapping[str, torch.Tensor], dtype_of: DtypeOf
) -> dict[str, torch.Tensor]:
    """Flat views of this device's source shards, checked against the plan's source layout."""
    out = {}
    for name, numel in schedule.src_numel.items():
        if name not in src_tensors:
            raise ValueError(f"{name}: device {schedule.device} holds a source shard but src_tensors has none")
        tensor = src_tensors[name].detach()
        if tensor.numel() != numel or tensor.dtype != dtype_of(name):
            raise ValueError(
                f"{name}: the source shard of device {schedule.device} should have {numel} "
                f"elements of {dtype_of(name)}, got {tensor.numel()} of {tensor.dtype}"
            )
        out[name] = tensor.reshape(-1)
    return out


def _destination(
    schedule: TransferProgram,
    src_flat: Mapping[str, torch.Tensor],
    dtype_of: DtypeOf,
    device: torch.device | str,
    given: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """This device's destination shards: a view of the source shard where aliased, else the caller's tensor
    (checked against the plan) or, without ``given``, a new uninitialised one."""
    out: dict[str, torch.Tensor] = {}
    for name, local_shape, alias_offset in schedule.dst_shapes:
        if alias_offset is not None:
            out[name] = src_flat[name][alias_offset : alias_offset + math.prod(local_shape)].view(local_shape)
        elif given is None:
            out[name] = torch.empty(local_shape, dtype=dtype_of(name), device=device)
        else:
            out[name] = _checked_target(schedule, name, local_shape, dtype_of(name), given.get(name))
    return out


def _checked_target(
    schedule: TransferProgram, name: str, local_shape: tuple[int, ...], dtype: torch.dtype, tensor: torch.Tensor | None
) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{name}: device {schedule.device} has a destination shard but out has no tensor")
    if tuple(tensor.shape) != tuple(local_shape) or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: out holds a {tuple(tensor.shape)} {tensor.dtype} tensor (contiguous: "
            f"{tensor.is_contiguous()}); the destination shard of device {schedule.device} is a "
            f"contiguous {tuple(local_shape)} {dtype} tensor"
        )
    return tensor.detach()


# ------------------------------------------------------------------------------------------ moving values
def _strided(flat: torch.Tensor, run: StridedRun) -> torch.Tensor:
    """The run's elements of a flat shard (a 1-D tensor, maybe a strided view), as a ``(count, length)`` view."""
    step = flat.stride(0)
    start = flat.storage_offset() + run.offset * step
    return flat.as_strided((run.count, run.length), (run.stride * step, step), start)


def _gather(flat: torch.Tensor, side: Side, out: torch.Tensor) -> None:
    """Copy the side's elements of ``flat``, in entry order, into the contiguous 1-D ``out``."""
    copies = _Copies()
    _gather_into(copies, flat, side, out)
    copies.run()


def _scatter(flat: torch.Tensor, side: Side, values: torch.Tensor) -> None:
    """Write ``values`` (1-D, entry order) to the side's elements of ``flat``."""
    copies = _Copies()
    _scatter_into(copies, flat, side, values)
    copies.run()


def _gather_into(copies: _Copies, flat: torch.Tensor, side: Side, out: torch.Tensor) -> None:
    """Add to ``copies`` what :func:`_gather` does."""
    index = side.index(flat.device)
    if index is not None:
        copies.call(_index_select, flat, index, out)
        return
    for run in side.runs:
        copies.copy(out[run.pos : run.pos + run.count * run.length].view(run.count, run.length), _strided(flat, run))


def _scatter_into(copies: _Copies, flat: torch.Tensor, side: Side, values: torch.Tensor) -> None:
    """Add to ``copies`` what :func:`_scatter` does."""
    index = side.index(flat.device)
    if index is not None:
        copies.call(flat.index_copy_, 0, index, values)
        return
    for run in side.runs:
        copies.copy(_strided(flat, run), values[run.pos : run.pos + run.count * run.length].view(run.count, run.length))


def _index_select(flat: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(flat, 0, index, out=out)


def _pack_into(copies: _Copies, rb: RouteBuffer, src_flat: Mapping[str, torch.Tensor]) -> None:
    """Add to ``copies`` the packing of one route this device sends (its packed and staged entries)."""
    for item in rb.placed:
        flat = src_flat[item.entry.param]
        if item.index is not None:
            copies.call(_index_select, flat, item.index, item.values)
        for view, run in item.chunks:
            copies.copy(view, _strided(flat, run))
    for i, staging in rb.staged.items():
        _gather_into(copies, src_flat[rb.direct[i].param], rb.direct[i].src, staging)


def _sum_sent(rb: RouteBuffer, src_flat: Mapping[str, torch.Tensor]) -> None:
    """Checksum every entry of a packed route this device sends into its buffer's header (if verifying)."""
    if rb.sums is None:
        return
    for index, item in enumerate(rb.placed):
        rb.sums[index] = _checksum(item.values)
    for i, entry in enumerate(rb.direct):
        rb.sums[len(rb.placed) + i] = _checksum(rb.staged[i] if i in rb.staged else _src_view(src_flat, entry))


def _checksum(values: torch.Tensor) -> torch.Tensor:
    wide = values.to(torch.float64)
    return torch.stack([wide.sum(), (wide * wide).sum()])


Started = list[tuple[tuple[tuple[Route, int], ...], "dist.Work | None"]]
"""Works to wait on in order, each with the received ``(route, tag)`` messages complete once it (and every work
before it) is done, to be landed (:func:`_landing`)."""


def _start_point_to_point(
    sends: Mapping[Route, Sequence[Message]],
    recvs: Mapping[Route, Sequence[Message]],
    rank_of: Mapping[int, int] | None,
) -> Started:
    """Start every single-receiver route's messages given, in one batch; a received message is complete (ready
    to land) once its work is."""
    ops, done = [], []
    for route, messages in sends.items():
        if len(route[1]) == 1:
            for tag, tensor in messages:
                ops.append(dist.P2POp(dist.isend, tensor, _rank(rank_of, route[1][0]), tag=tag))
                done.append(())
    for route, messages in recvs.items():
        if len(route[1]) == 1:
            for tag, tensor in messages:
                ops.append(dist.P2POp(dist.irecv, tensor, _rank(rank_of, route[0]), tag=tag))
                done.append(((route, tag),))
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    if len(works) == len(ops):  # a work per operation (gloo)
        return list(zip(done, works))
    routes = tuple(r for d in done for r in d)
    return [((), work) for work in works] + [(routes, None)]  # coalesced (NCCL): done when all are


def _start_broadcasts(
    sends: Mapping[Route, Sequence[Message]],
    recvs: Mapping[Route, Sequence[Message]],
    rank_of: Mapping[int, int] | None,
    groups: Mapping[tuple[int, ...], dist.ProcessGroup],
) -> Started:
    """Start this device's multi-receiver routes' messages, in the sorted route order (then message order)
    every rank shares."""
    messages = {route: msgs for route, msgs in (*sends.items(), *recvs.items()) if len(route[1]) > 1}
    works = []
    for route in sorted(messages):
        sender, receivers = route
        group = groups[tuple(sorted((sender, *receivers)))]
        for tag, tensor in messages[route]:
            work = dist.broadcast(tensor, src=_rank(rank_of, sender), group=group, async_op=True)
            works.append((((route, tag),) if route in recvs else (), work))
    return works


def _local_into(
    copies: _Copies,
    entries: Sequence[Entry],
    src_flat: Mapping[str, torch.Tensor],
    dst_flat: Mapping[str, torch.Tensor],
) -> None:
    """Add to ``copies`` the copies of the pieces this device already holds into its new destination shards."""
    for entry in entries:
        src, dst = src_flat[entry.param], dst_flat[entry.param]
        if entry.src.contiguous:
            start = entry.src.runs[0].offset
            _scatter_into(copies, dst, entry.dst, src[start : start + entry.numel])
        elif entry.dst.contiguous:
            start = entry.dst.runs[0].offset
            _gather_into(copies, src, entry.src, dst[start : start + entry.numel])
        else:  # through a temporary, gathered then scattered
            copies.call(_gather_scatter, src, entry.src, dst, entry.dst, entry.numel)


def _gather_scatter(src: torch.Tensor, src_side: Side, dst: torch.Tensor, dst_side: Side, numel: int) -> None:
    values = torch.empty(numel, dtype=src.dtype, device=src.device)
    _gather(src, src_side, values)
    _scatter(dst, dst_side, values)


def _landing(rb: RouteBuffer, dst_flat: Mapping[str, torch.Tensor], tag: int) -> _Copies:
    """The copies that put a received message's elements in place: unpack the route buffer (tag 0), or scatter a
    staged direct entry (an unstaged one was received in place)."""
    copies = _Copies()
    if tag == 0:
        for item in rb.placed:
            target = dst_flat[item.entry.param]
            if item.index is not None:
                copies.call(target.index_copy_, 0, item.index, item.values)
            for view, run in item.chunks:
                copies.copy(_strided(target, run), view)
    elif tag - 1 in rb.staged:
        entry = rb.direct[tag - 1]
        _scatter_into(copies, dst_flat[entry.param], entry.dst, rb.staged[tag - 1])
    return copies


def _check_packed(rb: RouteBuffer, dst_flat: Mapping[str, torch.Tensor]) -> None:
    """Check a received route's packed entries, where they landed, against the sender's sums (if verifying)."""
    if rb.sums is None:
        return
    for index, item in enumerate(rb.placed):
        landed = torch.empty_like(item.values)
        _gather(dst_flat[item.entry.param], item.entry.dst, landed)  # read back what landed, in the sender's order
        _check(item.entry, rb.sums[index], _checksum(landed))


def _check_direct(rb: RouteBuffer, dst_flat: Mapping[str, torch.Tensor]) -> None:
    """Check a received route's direct entries, where they landed, against the sender's sums."""
    for i, entry in enumerate(rb.direct):
        if i in rb.staged:  # read back what landed, in the sender's order
            landed = torch.empty_like(rb.staged[i])
            _gather(dst_flat[entry.param], entry.dst, landed)
        else:
            landed = _dst_view(dst_flat, entry)
        _check(entry, rb.sums[len(rb.placed) + i], _checksum(landed))


def _check(entry: Entry, expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Raise unless the receiver's (sum, sum of squares) of an entry matches its sender's."""
    exp_sum, exp_sq = expected.tolist()
    got_sum, got_sq = actual.tolist()
    scale = (entry.numel * abs(exp_sq)) ** 0.5  # bounds the sum of |values|
    if not (_close(got_sum, exp_sum, _RTOL * scale) and _close(got_sq, exp_sq, _RTOL * abs(exp_sq))):
        lo, hi = entry.span
        raise ReallocVerificationError(
            f"{entry.param}: {entry.numel} elements in {entry.pieces} piece(s) within [{lo}, {hi}) from device "
            f"{entry.sender} fail verification (sum {got_sum!r} vs {exp_sum!r}, sum of squares {got_sq!r} vs "
            f"{exp_sq!r})"
        )


def _close(got: float, expected: float, tol: float) -> bool:
    # Equal infinities or NaNs (a source already holding them) are a faithful copy, not a corruption.
    return got == expected or abs(got - expected) <= tol or (math.isnan(got) and math.isnan(expected))
