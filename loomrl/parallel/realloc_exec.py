"""Parameter reallocation executor: runs a :class:`ReallocPlan` with torch.distributed.

Every device of either mesh calls :func:`execute_reallocation` with the same plan at the same time. Pieces
travel in one byte buffer per route, a route being a sender and its receivers:

- single-receiver routes go through one ``dist.batch_isend_irecv`` call;
- multi-receiver routes are ``dist.broadcast`` calls over subgroups of the route's devices, issued in one
  sorted order by every rank, so no two ranks wait on each other's later broadcast;
- local pieces are copied within the device, and a destination shard that is one contiguous span of the
  device's source shard is a view of the source tensor (the plan calls it aliased): no copy, no memory.

An entry (a parameter's pieces on one route) of at least :data:`DIRECT_MIN_NUMEL` elements (large weights) that lies in one
contiguous span of the sender's source shard or of every receiver's destination shard travels *directly*, in
its own message: sent from the source shard where its elements are contiguous there, and received into the
destination shard where they are contiguous there. A side where they are not (a row-split weight's columns)
stages them in a buffer of the entry's own: gathered before sending, or scattered after arriving. So a large
entry costs at most one copy beyond the wire, where packing it into the route buffer would cost two (on CPU
devices, where the wire itself is a memory copy, that halves the time). Every participant derives the same
decision from the plan alone.

The plan is compiled once per device into a :class:`ReallocSchedule` (:func:`compile_schedule`, cached by
plan identity for as long as the plan lives). It groups a route's pieces by parameter into *entries*, and
describes where an entry's elements lie in the device's flat source or destination shard as a few strided
runs (pieces of one length at a constant step: the rows of a row-split weight) or, when the pieces are too
irregular for that, as an int64 index tensor. Packing, unpacking and local copies then take one strided
``copy_`` per run, or one ``index_select`` / ``index_copy_`` per entry, however many pieces it has. A call
then binds the caller's tensors to the schedule: flat views, messages and the copies of each phase (packing,
local pieces, each message's landing), run as one ``torch._foreach_copy_`` per phase. The schedule keeps the
last binding and reuses it while the same tensors come back (the runtime passes its parameters every
iteration), so a repeated call makes no views and loops over no entries in Python.

A route's buffer is raw bytes, so parameters of different dtypes share it: optionally a float64 header of
``(sum, sum of squares)`` per entry for verification (direct entries included, after the packed ones), then
the packed entries, grouped by element size (largest first, so every entry starts aligned for its dtype). Sender and receivers derive the same buffer layout from
the plan; nothing but the bytes is exchanged. The schedule keeps its route buffers between calls (they hold
nothing once a call returns); :func:`clear_schedules` drops them.

Subgroups must be created collectively by every rank of the world, in the same order, before the transfer:
:func:`build_broadcast_groups` does it; build once per plan and keep the result, as creating groups is slow.
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from loomrl.plan.realloc_plan import ReallocPlan, Transfer
from loomrl.plan.shards import Interval, interval_table, shard_numel, shard_shape

Route = tuple[int, tuple[int, ...]]
"""``(sender, receivers)`` of a set of pieces that travel in one buffer."""
DtypeOf = Callable[[str], torch.dtype]
"""Parameter name → its dtype."""

_CHECKSUM_BYTES = 16  # float64 sum and sum of squares per entry
_RTOL = 1e-9
"""Relative tolerance of checksums: both sides sum the same values in the same order, so any slack is spare."""
_MAX_RUNS = 8
"""Most strided runs an entry side is always copied by (a Python call each)."""
DIRECT_MIN_NUMEL = 1 << 20
"""Entries this large (and contiguous on at least one side) travel directly: their own message then costs
less than packing and unpacking them (one or two copies of every byte). Measured with 4 gloo processes on 2 cores
(benchmarks/realloc.py, 2026-11-22): a message costs ~160 µs, and at 64K elements sending entries directly
made a tp4 → dp4 copy-back 2.4× slower (65 ms vs 27 ms); at a million fp32 elements the two copies saved
(8 MB at a few GB/s) outweigh a message several times over."""
_MIN_RUN_NUMEL = 4096
"""Beyond ``_MAX_RUNS`` runs, the least mean elements per run worth a call each; shorter runs are copied with
an index tensor (8 bytes per element, kept with the schedule) instead."""


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
            self._tables[param] = interval_table(self._intervals_of(self._device, param))
        starts, offsets = self._tables[param]
        i = bisect_right(starts, index) - 1
        return offsets[i] + index - starts[i]


# --------------------------------------------------------------------------------------------- the schedule
class _Run(NamedTuple):
    """``count`` pieces of ``length`` elements, ``stride`` apart from ``offset`` in a flat shard, that sit
    at positions ``[pos, pos + count * length)`` of their entry."""

    pos: int
    count: int
    length: int
    offset: int
    stride: int


class _Side:
    """Where an entry's elements lie, in entry order, in one device's flat (source or destination) shard."""

    def __init__(self, spans: Sequence[tuple[int, int]]):
        merged: list[list[int]] = []  # [offset, length] with touching spans joined
        for offset, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1][1] += length
            else:
                merged.append([offset, length])
        self.runs = _runs(merged)
        self._index: dict[torch.device, torch.Tensor] = {}
        numel = sum(length for _, length in merged)
        if len(self.runs) > _MAX_RUNS and numel < len(self.runs) * _MIN_RUN_NUMEL:
            starts, lengths = (torch.tensor(column, dtype=torch.int64) for column in zip(*merged))
            positions = torch.cumsum(lengths, 0) - lengths
            shift = torch.repeat_interleave(starts - positions, lengths)
            self._index[torch.device("cpu")] = shift + torch.arange(numel)
            self.runs = ()

    @property
    def contiguous(self) -> bool:
        return len(self.runs) == 1 and self.runs[0].count == 1

    def index(self, device: torch.device) -> torch.Tensor | None:
        """Element offsets on ``device``, or None when the side is copied by runs."""
        if not self._index:
            return None
        if device not in self._index:
            self._index[device] = self._index[torch.device("cpu")].to(device)
        return self._index[device]


def _runs(spans: Sequence[Sequence[int]]) -> tuple[_Run, ...]:
    """Group increasing, non-touching ``(offset, length)`` spans into runs of one length and one step."""
    runs: list[_Run] = []
    pos = 0
    for offset, length in spans:
        last = runs[-1] if runs else None
        if last is not None and last.length == length and (
                offset == last.offset + last.count * last.stride if last.count > 1
                else offset - last.offset >= length):
            runs[-1] = last._replace(count=last.count + 1, stride=offset - last.offset if last.count == 1
                                     else last.stride)
        else:
            runs.append(_Run(pos, 1, length, offset, length))
        pos += length
    return tuple(runs)


@dataclass(frozen=True)
class _Entry:
    """The pieces of one parameter on one route (or copied locally), in plan order."""

    param: str
    sender: int
    numel: int
    pieces: int
    span: Interval
    """Lowest start and highest end of the pieces (for messages)."""
    src: _Side | None
    """Where the elements lie in the sender's source shard (None on receivers)."""
    dst: _Side | None
    """Where they go in the receiver's destination shard (None on the sender)."""

    @property
    def mine(self) -> _Side:
        """This device's side: the source side on the sender, the destination side on a receiver."""
        return self.src if self.src is not None else self.dst


@dataclass
class _Placed:
    """An entry in a route buffer: ``values`` is the typed view of the buffer that holds its elements."""

    entry: _Entry
    values: torch.Tensor
    index: torch.Tensor | None
    """This device's side of the entry as element offsets, on the buffer's device; or None, and then:"""
    chunks: tuple[tuple[torch.Tensor, _Run], ...]
    """``(count, length)`` views of ``values``, one per run of this device's side."""


@dataclass
class _RouteBuffer:
    buffer: torch.Tensor
    placed: list[_Placed]
    """The packed entries, in buffer order."""
    direct: tuple[_Entry, ...] = ()
    """The route's direct entries, in message order (their checksums follow the packed entries')."""
    staged: dict[int, torch.Tensor] = field(default_factory=dict)
    """Direct entry index → its staging buffer, for the entries not contiguous on this device's side."""
    sums: torch.Tensor | None = None
    """float64 ``(sum, sum of squares)`` rows of every entry when verifying: packed ones, then direct ones."""


@dataclass(eq=False)
class ReallocSchedule:
    """What one device does for one plan, precomputed: see :func:`compile_schedule`."""

    device: int
    src_numel: dict[str, int]
    """Elements of every source shard the device holds (non-empty ones)."""
    dst_shapes: tuple[tuple[str, tuple[int, ...], int | None], ...]
    """``(param, local shape, alias offset)`` of every destination shard of the device (the offset in the flat
    source shard where an aliased one starts; None for the others)."""
    routes: dict[Route, tuple[_Entry, ...]]
    """The packed entries of every route the device sends or receives (maybe none)."""
    direct: dict[Route, tuple[_Entry, ...]]
    """The direct entries of every route the device sends or receives, in message order."""
    local: tuple[_Entry, ...]
    """Pieces copied within the device into new (not aliased) destination shards, per parameter."""
    _buffers: tuple[tuple, dict[Route, _RouteBuffer]] | None = field(default=None, repr=False)
    _bound: _Bound | None = field(default=None, repr=False)
    """The last call's tensors bound to this schedule, reused while the same tensors come back."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def buffers(self, dtype_of: DtypeOf, verify: bool, device: torch.device) -> dict[Route, _RouteBuffer]:
        """The route buffers for these dtypes, allocated on the first call and kept while the key holds."""
        key = (tuple(dtype_of(e.param) for entries in self.routes.values() for e in entries), verify, device)
        if self._buffers is None or self._buffers[0] != key:
            self._buffers = key, _bind(self.routes, self.direct, dtype_of, verify, device)
        return self._buffers[1]


_SCHEDULES: dict[tuple[int, int], tuple[weakref.ref, ReallocSchedule]] = {}


def compile_schedule(plan: ReallocPlan, my_device: int) -> ReallocSchedule:
    """``my_device``'s schedule of ``plan``: built on the first call, then cached while the plan lives."""
    key = (id(plan), my_device)
    hit = _SCHEDULES.get(key)
    if hit is not None and hit[0]() is plan:
        return hit[1]
    schedule = _compile(plan, my_device)
    _SCHEDULES[key] = weakref.ref(plan, lambda _, key=key: _SCHEDULES.pop(key, None)), schedule
    return schedule


def clear_schedules() -> None:
    """Forget every cached schedule and its route buffers (they are rebuilt when next needed)."""
    _SCHEDULES.clear()


def _compile(plan: ReallocPlan, me: int) -> ReallocSchedule:
    by_route: dict[Route, dict[str, list[Transfer]]] = defaultdict(dict)
    local: dict[str, list[Transfer]] = {}
    for t in plan.transfers:
        if t.local:
            if t.sender == me and not plan.aliased(me, t.param):
                local.setdefault(t.param, []).append(t)
        elif t.sender == me or me in t.receivers:
            by_route[(t.sender, t.receivers)].setdefault(t.param, []).append(t)
    src_at, dst_at = _Locators(plan.src_intervals, me), _Locators(plan.dst_intervals, me)
    routes, direct = {}, {}
    for route, params in by_route.items():
        entries = [(_entry(pieces, src_at if route[0] == me else None, None if route[0] == me else dst_at),
                    _travels_directly(plan, route, pieces)) for pieces in params.values()]
        routes[route] = tuple(e for e, is_direct in entries if not is_direct)
        direct[route] = tuple(sorted((e for e, is_direct in entries if is_direct), key=lambda e: e.param))
    src_numel = {name: n for name in plan.shapes if (n := shard_numel(plan.src_intervals(me, name)))}
    dst_shapes = []
    if me in plan.dst.mesh:
        rank = plan.dst.mesh.index(me)
        for name, shape in plan.shapes.items():
            local_shape = shard_shape(name, shape, plan.dst.layout, rank, plan.num_layers)
            if local_shape is not None:
                dst_shapes.append((name, local_shape, plan.alias_offset(me, name)))
    local_entries = tuple(_entry(pieces, src_at, dst_at) for pieces in local.values())
    return ReallocSchedule(me, src_numel, tuple(dst_shapes), routes, direct, local_entries)


def _travels_directly(plan: ReallocPlan, route: Route, pieces: Sequence[Transfer]) -> bool:
    """Whether an entry is sent from and received into its shards as is (see the module docstring): decided
    from the plan alone, so every participant agrees."""
    if sum(t.numel for t in pieces) < DIRECT_MIN_NUMEL:
        return False
    sender, receivers = route

    def contiguous(at: _Locators) -> bool:
        first = at.offset(pieces[0].param, pieces[0].start)
        return all(at.offset(t.param, t.start) == first + sum(p.numel for p in pieces[:i])
                   for i, t in enumerate(pieces))

    return contiguous(_Locators(plan.src_intervals, sender)) or all(
        contiguous(_Locators(plan.dst_intervals, r)) for r in receivers)


def _entry(pieces: Sequence[Transfer], src_at: _Locators | None, dst_at: _Locators | None) -> _Entry:
    """One parameter's pieces on one route; sides only for the locators given."""
    first = pieces[0]

    def side(at: _Locators | None) -> _Side | None:
        return None if at is None else _Side([(at.offset(t.param, t.start), t.numel) for t in pieces])

    return _Entry(first.param, first.sender, sum(t.numel for t in pieces), len(pieces),
                  (first.start, pieces[-1].end), side(src_at), side(dst_at))


def _bind(routes: Mapping[Route, Sequence[_Entry]], direct: Mapping[Route, Sequence[_Entry]], dtype_of: DtypeOf,
          verify: bool, device: torch.device) -> dict[Route, _RouteBuffer]:
    """A byte buffer per route: checksums of every entry (if verifying), then the packed entries, largest
    elements first."""
    out = {}
    for route, entries in routes.items():
        # Largest elements first: each dtype group then starts aligned, and alignment below is a no-op.
        ordered = sorted(entries, key=lambda e: -dtype_of(e.param).itemsize)
        directs = tuple(direct.get(route, ()))
        staged = {i: torch.empty(e.numel, dtype=dtype_of(e.param), device=device)
                  for i, e in enumerate(directs) if not e.mine.contiguous}
        sums_count = len(ordered) + len(directs)
        offset, offsets = _CHECKSUM_BYTES * sums_count if verify else 0, []
        for entry in ordered:
            size = dtype_of(entry.param).itemsize
            offset = -(-offset // size) * size
            offsets.append(offset)
            offset += entry.numel * size
        if offset == 0:  # only direct entries and no checksums: no buffer travels
            out[route] = _RouteBuffer(torch.empty(0, dtype=torch.uint8, device=device), [], directs, staged)
            continue
        buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        placed = [_place(entry, buffer, start, dtype_of(entry.param)) for entry, start in zip(ordered, offsets)]
        sums = buffer[:_CHECKSUM_BYTES * sums_count].view(torch.float64).view(-1, 2) if verify else None
        out[route] = _RouteBuffer(buffer, placed, directs, staged, sums)
    return out


def _place(entry: _Entry, buffer: torch.Tensor, start: int, dtype: torch.dtype) -> _Placed:
    """The entry at byte ``start`` of a route buffer, with views for this device's side (sender or receiver)."""
    values = buffer[start:start + entry.numel * dtype.itemsize].view(dtype)
    side = entry.mine
    chunks = tuple((values[run.pos:run.pos + run.count * run.length].view(run.count, run.length), run)
                   for run in side.runs)
    return _Placed(entry, values, side.index(buffer.device), chunks)


# ---------------------------------------------------------------------------------------------- execution
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
                         device: torch.device | str = "cpu", verify: bool = False,
                         out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Run ``plan`` on ``my_device``; return its destination shards (parameter name → local tensor).

    ``src_tensors``: this device's source shards as it holds them (plain local tensors, e.g. a DTensor's
    ``to_local()``, flat under FSDP); needed for every parameter the device holds in the source layout.
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
    object reuse (see :func:`compile_schedule`).
    """
    dtype_of = _dtype_lookup(dtypes)
    if groups is None:
        groups = build_broadcast_groups(plan, rank_of)
    schedule = compile_schedule(plan, my_device)
    device = torch.device(device)
    if schedule._lock.acquire(blocking=False):
        try:
            buffers = schedule.buffers(dtype_of, verify, device)
            bound = _bound(schedule, buffers, src_tensors, out, dtype_of, device)
            _transfer(schedule, buffers, bound, rank_of, groups, verify)
        finally:
            schedule._lock.release()
    else:  # another thread runs this plan on this device: its buffers are busy, so use new ones
        buffers = _bind(schedule.routes, schedule.direct, dtype_of, verify, device)
        bound = _bind_tensors(schedule, buffers, src_tensors, out, dtype_of, device)
        _transfer(schedule, buffers, bound, rank_of, groups, verify)
    return dict(bound.out)


class _Copies:
    """Copies to run together: pairs of same-shaped views, run by one ``torch._foreach_copy_`` (a single
    dispatch, where a Python loop pays about a microsecond per copy: an executor call makes hundreds), and the
    copies that need more than a view (index copies, two-step copies) as calls."""

    __slots__ = ("dsts", "srcs", "calls")

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
    buffers: Mapping[Route, _RouteBuffer]
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


def _bound(schedule: ReallocSchedule, buffers: Mapping[Route, _RouteBuffer], src_tensors: Mapping[str, torch.Tensor],
           out: Mapping[str, torch.Tensor] | None, dtype_of: DtypeOf, device: torch.device) -> _Bound:
    """The schedule's bound call for these tensors: the kept one if the same tensors came back, else a new one,
    kept when it may be (every destination shard is the caller's or a view: new ones must be new each call,
    and every source shard is contiguous, so its flat view shares the given tensor's storage)."""
    key = _identity(schedule, src_tensors, out)
    kept = schedule._bound
    if key is not None and kept is not None and kept.key == key and kept.buffers is buffers:
        return kept
    bound = _bind_tensors(schedule, buffers, src_tensors, out, dtype_of, device, key)
    if key is not None:
        schedule._bound = bound  # its views keep the storages alive, so no other storage takes their addresses
    return bound


def _identity(schedule: ReallocSchedule, src_tensors: Mapping[str, torch.Tensor],
              out: Mapping[str, torch.Tensor] | None) -> tuple | None:
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


def _bind_tensors(schedule: ReallocSchedule, buffers: Mapping[Route, _RouteBuffer],
                  src_tensors: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor] | None,
                  dtype_of: DtypeOf, device: torch.device, key: tuple | None = None) -> _Bound:
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
    early = {route: [m for m in msgs if m[0] > 0 and m[0] - 1 not in buffers[route].staged]
             for route, msgs in sends.items()}
    late = {route: [m for m in msgs if m[0] == 0 or m[0] - 1 in buffers[route].staged] for route, msgs in sends.items()}
    return _Bound(key, buffers, src_flat, dst_flat, dst, sends, recvs, early, late, pack, local, land)


def _transfer(schedule: ReallocSchedule, buffers: Mapping[Route, _RouteBuffer], bound: _Bound,
              rank_of: Mapping[int, int] | None, groups: Mapping[tuple[int, ...], dist.ProcessGroup],
              verify: bool) -> None:
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


def _messages(rb: _RouteBuffer, flat: Mapping[str, torch.Tensor], view) -> list[Message]:
    """A route's messages on this device: its buffer when it holds anything, then its direct entries (each
    its staging buffer, or its view of ``flat``)."""
    out: list[Message] = [(0, rb.buffer)] if rb.buffer.numel() else []
    return out + [(i + 1, rb.staged[i] if i in rb.staged else view(flat, entry)) for i, entry in enumerate(rb.direct)]


def _src_view(src_flat: Mapping[str, torch.Tensor], entry: _Entry) -> torch.Tensor:
    """The sender's elements of an unstaged direct entry, contiguous in its source shard."""
    start = entry.src.runs[0].offset
    return src_flat[entry.param][start:start + entry.numel].contiguous()


def _dst_view(dst_flat: Mapping[str, torch.Tensor], entry: _Entry) -> torch.Tensor:
    """Where an unstaged direct entry lands, contiguous in the receiver's destination shard."""
    start = entry.dst.runs[0].offset
    return dst_flat[entry.param][start:start + entry.numel]


def _rank(rank_of: Mapping[int, int] | None, device: int) -> int:
    return device if rank_of is None else rank_of[device]


def _dtype_lookup(dtypes: torch.dtype | Mapping[str, torch.dtype]) -> DtypeOf:
    if isinstance(dtypes, torch.dtype):
        return lambda name: dtypes
    return lambda name: dtypes[name]


def _source_views(schedule: ReallocSchedule, src_tensors: Mapping[str, torch.Tensor],
                  dtype_of: DtypeOf) -> dict[str, torch.Tensor]:
    """Flat views of this device's source shards, checked against the plan's source layout."""
    out = {}
    for name, numel in schedule.src_numel.items():
        if name not in src_tensors:
            raise ValueError(f"{name}: device {schedule.device} holds a source shard but src_tensors has none")
        tensor = src_tensors[name].detach()
        if tensor.numel() != numel or tensor.dtype != dtype_of(name):
            raise ValueError(f"{name}: the source shard of device {schedule.device} should have {numel} "
                             f"elements of {dtype_of(name)}, got {tensor.numel()} of {tensor.dtype}")
        out[name] = tensor.reshape(-1)
    return out


def _destination(schedule: ReallocSchedule, src_flat: Mapping[str, torch.Tensor], dtype_of: DtypeOf,
                 device: torch.device | str, given: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """This device's destination shards: a view of the source shard where aliased, else the caller's tensor
    (checked against the plan) or, without ``given``, a new uninitialised one."""
    out: dict[str, torch.Tensor] = {}
    for name, local_shape, alias_offset in schedule.dst_shapes:
        if alias_offset is not None:
            out[name] = src_flat[name][alias_offset:alias_offset + math.prod(local_shape)].view(local_shape)
        elif given is None:
            out[name] = torch.empty(local_shape, dtype=dtype_of(name), device=device)
        else:
            out[name] = _checked_target(schedule, name, local_shape, dtype_of(name), given.get(name))
    return out


def _checked_target(schedule: ReallocSchedule, name: str, local_shape: tuple[int, ...], dtype: torch.dtype,
                    tensor: torch.Tensor | None) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{name}: device {schedule.device} has a destination shard but out has no tensor")
    if tuple(tensor.shape) != tuple(local_shape) or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(f"{name}: out holds a {tuple(tensor.shape)} {tensor.dtype} tensor (contiguous: "
                         f"{tensor.is_contiguous()}); the destination shard of device {schedule.device} is a "
                         f"contiguous {tuple(local_shape)} {dtype} tensor")
    return tensor.detach()


# ------------------------------------------------------------------------------------------ moving values
def _strided(flat: torch.Tensor, run: _Run) -> torch.Tensor:
    """The run's elements of a flat shard (a 1-D tensor, maybe a strided view), as a ``(count, length)`` view."""
    step = flat.stride(0)
    start = flat.storage_offset() + run.offset * step
    return flat.as_strided((run.count, run.length), (run.stride * step, step), start)


def _gather(flat: torch.Tensor, side: _Side, out: torch.Tensor) -> None:
    """Copy the side's elements of ``flat``, in entry order, into the contiguous 1-D ``out``."""
    copies = _Copies()
    _gather_into(copies, flat, side, out)
    copies.run()


def _scatter(flat: torch.Tensor, side: _Side, values: torch.Tensor) -> None:
    """Write ``values`` (1-D, entry order) to the side's elements of ``flat``."""
    copies = _Copies()
    _scatter_into(copies, flat, side, values)
    copies.run()


def _gather_into(copies: _Copies, flat: torch.Tensor, side: _Side, out: torch.Tensor) -> None:
    """Add to ``copies`` what :func:`_gather` does."""
    index = side.index(flat.device)
    if index is not None:
        copies.call(_index_select, flat, index, out)
        return
    for run in side.runs:
        copies.copy(out[run.pos:run.pos + run.count * run.length].view(run.count, run.length), _strided(flat, run))


def _scatter_into(copies: _Copies, flat: torch.Tensor, side: _Side, values: torch.Tensor) -> None:
    """Add to ``copies`` what :func:`_scatter` does."""
    index = side.index(flat.device)
    if index is not None:
        copies.call(flat.index_copy_, 0, index, values)
        return
    for run in side.runs:
        copies.copy(_strided(flat, run), values[run.pos:run.pos + run.count * run.length].view(run.count, run.length))


def _index_select(flat: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(flat, 0, index, out=out)


def _pack(rb: _RouteBuffer, src_flat: Mapping[str, torch.Tensor]) -> None:
    """Fill the buffers of one route this device sends: every packed entry, every staged direct entry, and the
    checksums (if verifying) of every entry, direct ones included."""
    copies = _Copies()
    _pack_into(copies, rb, src_flat)
    copies.run()
    _sum_sent(rb, src_flat)


def _pack_into(copies: _Copies, rb: _RouteBuffer, src_flat: Mapping[str, torch.Tensor]) -> None:
    """Add to ``copies`` the packing of one route this device sends (its packed and staged entries)."""
    for item in rb.placed:
        flat = src_flat[item.entry.param]
        if item.index is not None:
            copies.call(_index_select, flat, item.index, item.values)
        for view, run in item.chunks:
            copies.copy(view, _strided(flat, run))
    for i, staging in rb.staged.items():
        _gather_into(copies, src_flat[rb.direct[i].param], rb.direct[i].src, staging)


def _sum_sent(rb: _RouteBuffer, src_flat: Mapping[str, torch.Tensor]) -> None:
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
before it) is done, to be landed by :func:`_land`."""


def _start_point_to_point(sends: Mapping[Route, Sequence[Message]], recvs: Mapping[Route, Sequence[Message]],
                          rank_of: Mapping[int, int] | None) -> Started:
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


def _start_broadcasts(sends: Mapping[Route, Sequence[Message]], recvs: Mapping[Route, Sequence[Message]],
                      rank_of: Mapping[int, int] | None, groups: Mapping[tuple[int, ...], dist.ProcessGroup]
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


def _copy_local(entries: Sequence[_Entry], src_flat: Mapping[str, torch.Tensor],
                dst_flat: Mapping[str, torch.Tensor]) -> None:
    """Copy the pieces this device already holds into its new destination shards."""
    copies = _Copies()
    _local_into(copies, entries, src_flat, dst_flat)
    copies.run()


def _local_into(copies: _Copies, entries: Sequence[_Entry], src_flat: Mapping[str, torch.Tensor],
                dst_flat: Mapping[str, torch.Tensor]) -> None:
    """Add to ``copies`` what :func:`_copy_local` does."""
    for entry in entries:
        src, dst = src_flat[entry.param], dst_flat[entry.param]
        if entry.src.contiguous:
            start = entry.src.runs[0].offset
            _scatter_into(copies, dst, entry.dst, src[start:start + entry.numel])
        elif entry.dst.contiguous:
            start = entry.dst.runs[0].offset
            _gather_into(copies, src, entry.src, dst[start:start + entry.numel])
        else:  # through a temporary, gathered then scattered
            copies.call(_gather_scatter, src, entry.src, dst, entry.dst, entry.numel)


def _gather_scatter(src: torch.Tensor, src_side: _Side, dst: torch.Tensor, dst_side: _Side, numel: int) -> None:
    values = torch.empty(numel, dtype=src.dtype, device=src.device)
    _gather(src, src_side, values)
    _scatter(dst, dst_side, values)


def _land(rb: _RouteBuffer, dst_flat: Mapping[str, torch.Tensor], tag: int) -> None:
    """Put a received message's elements in place: unpack the route buffer (tag 0), or scatter a staged
    direct entry (an unstaged one was received in place); check the packed entries (if verifying)."""
    _landing(rb, dst_flat, tag).run()
    if tag == 0:
        _check_packed(rb, dst_flat)


def _landing(rb: _RouteBuffer, dst_flat: Mapping[str, torch.Tensor], tag: int) -> _Copies:
    """The copies that put a received message's elements in place (see :func:`_land`)."""
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


def _check_packed(rb: _RouteBuffer, dst_flat: Mapping[str, torch.Tensor]) -> None:
    """Check a received route's packed entries, where they landed, against the sender's sums (if verifying)."""
    if rb.sums is None:
        return
    for index, item in enumerate(rb.placed):
        landed = torch.empty_like(item.values)
        _gather(dst_flat[item.entry.param], item.entry.dst, landed)  # read back what landed, in the sender's order
        _check(item.entry, rb.sums[index], _checksum(landed))


def _check_direct(rb: _RouteBuffer, dst_flat: Mapping[str, torch.Tensor]) -> None:
    """Check a received route's direct entries, where they landed, against the sender's sums."""
    for i, entry in enumerate(rb.direct):
        if i in rb.staged:  # read back what landed, in the sender's order
            landed = torch.empty_like(rb.staged[i])
            _gather(dst_flat[entry.param], entry.dst, landed)
        else:
            landed = _dst_view(dst_flat, entry)
        _check(entry, rb.sums[len(rb.placed) + i], _checksum(landed))


def _check(entry: _Entry, expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Raise unless the receiver's (sum, sum of squares) of an entry matches its sender's."""
    exp_sum, exp_sq = expected.tolist()
    got_sum, got_sq = actual.tolist()
    scale = (entry.numel * abs(exp_sq)) ** 0.5  # bounds the sum of |values|
    if not (_close(got_sum, exp_sum, _RTOL * scale) and _close(got_sq, exp_sq, _RTOL * abs(exp_sq))):
        lo, hi = entry.span
        raise ReallocVerificationError(
            f"{entry.param}: {entry.numel} elements in {entry.pieces} piece(s) within [{lo}, {hi}) from device "
            f"{entry.sender} fail verification (sum {got_sum!r} vs {exp_sum!r}, sum of squares {got_sq!r} vs "
            f"{exp_sq!r})")


def _close(got: float, expected: float, tol: float) -> bool:
    # Equal infinities or NaNs (a source already holding them) are a faithful copy, not a corruption.
    return got == expected or abs(got - expected) <= tol or (math.isnan(got) and math.isnan(expected))
