"""The compiled schedule of a parameter reallocation: what one device does for one plan, precomputed.

:func:`compile_program` turns a :class:`~loomrl.plan.ReallocPlan` into a :class:`TransferProgram` for one
device, cached by plan identity for as long as the plan lives. It groups a route's pieces (a route being a
sender and its receivers) by parameter into *entries*, and describes where an entry's elements lie in the
device's flat source or destination shard as a few strided runs (pieces of one length at a constant step: the
rows of a row-split weight) or, when the pieces are too irregular for that, as an int64 index tensor. An
entry of at least :data:`DIRECT_MIN_NUMEL` elements that is contiguous on either side travels directly, in a
message of its own (every participant derives that from the plan alone).

A route's buffer is raw bytes, so parameters of different dtypes share it: optionally a float64 header of
``(sum, sum of squares)`` per entry for verification (direct entries included, after the packed ones), then
the packed entries, grouped by element size (largest first, so every entry starts aligned for its dtype).
Sender and receivers derive the same buffer layout from the plan; nothing but the bytes is exchanged. The
schedule keeps its route buffers between calls (:meth:`TransferProgram.buffers`); :func:`clear_programs`
drops them. :mod:`loomrl.parallel.realloc_exec` runs the schedule.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from loomrl.plan.realloc_plan import ReallocPlan, Transfer
from loomrl.plan.shards import Interval, interval_table, shard_numel, shard_shape

__all__ = ["DIRECT_MIN_NUMEL", "DtypeOf", "TransferProgram", "Route", "clear_programs", "compile_program"]

Route = tuple[int, tuple[int, ...]]
"""``(sender, receivers)`` of a set of pieces that travel in one buffer."""
DtypeOf = Callable[[str], torch.dtype]
"""Parameter name → its dtype."""

_CHECKSUM_BYTES = 16  # float64 sum and sum of squares per entry
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


class StridedRun(NamedTuple):
    """``count`` pieces of ``length`` elements, ``stride`` apart from ``offset`` in a flat shard, that sit
    at positions ``[pos, pos + count * length)`` of their entry."""

    pos: int
    count: int
    length: int
    offset: int
    stride: int


class Side:
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


def _runs(spans: Sequence[Sequence[int]]) -> tuple[StridedRun, ...]:
    """Group increasing, non-touching ``(offset, length)`` spans into runs of one length and one step."""
    runs: list[StridedRun] = []
    pos = 0
    for offset, length in spans:
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.length == length
            and (offset == last.offset + last.count * last.stride if last.count > 1 else offset - last.offset >= length)
        ):
            runs[-1] = last._replace(
                count=last.count + 1, stride=offset - last.offset if last.count == 1 else last.stride
            )
        else:
            runs.append(StridedRun(pos, 1, length, offset, length))
        pos += length
    return tuple(runs)


@dataclass(frozen=True)
class Entry:
    """The pieces of one parameter on one route (or copied locally), in plan order."""

    param: str
    sender: int
    numel: int
    pieces: int
    span: Interval
    """Lowest start and highest end of the pieces (for messages)."""
    src: Side | None
    """Where the elements lie in the sender's source shard (None on receivers)."""
    dst: Side | None
    """Where they go in the receiver's destination shard (None on the sender)."""

    @property
    def mine(self) -> Side:
        """This device's side: the source side on the sender, the destination side on a receiver."""
        return self.src if self.src is not None else self.dst


@dataclass
class _Placed:
    """An entry in a route buffer: ``values`` is the typed view of the buffer that holds its elements."""

    entry: Entry
    values: torch.Tensor
    index: torch.Tensor | None
    """This device's side of the entry as element offsets, on the buffer's device; or None, and then:"""
    chunks: tuple[tuple[torch.Tensor, StridedRun], ...]
    """``(count, length)`` views of ``values``, one per run of this device's side."""


@dataclass
class RouteBuffer:
    buffer: torch.Tensor
    placed: list[_Placed]
    """The packed entries, in buffer order."""
    direct: tuple[Entry, ...] = ()
    """The route's direct entries, in message order (their checksums follow the packed entries')."""
    staged: dict[int, torch.Tensor] = field(default_factory=dict)
    """Direct entry index → its staging buffer, for the entries not contiguous on this device's side."""
    sums: torch.Tensor | None = None
    """float64 ``(sum, sum of squares)`` rows of every entry when verifying: packed ones, then direct ones."""


@dataclass(eq=False)
class TransferProgram:
    """What one device does for one plan, precomputed: see :func:`compile_program`."""

    device: int
    src_numel: dict[str, int]
    """Elements of every source shard the device holds (non-empty ones)."""
    dst_shapes: tuple[tuple[str, tuple[int, ...], int | None], ...]
    """``(param, local shape, alias offset)`` of every destination shard of the device (the offset in the flat
    source shard where an aliased one starts; None for the others)."""
    routes: dict[Route, tuple[Entry, ...]]
    """The packed entries of every route the device sends or receives (maybe none)."""
    direct: dict[Route, tuple[Entry, ...]]
    """The direct entries of every route the device sends or receives, in message order."""
    local: tuple[Entry, ...]
    """Pieces copied within the device into new (not aliased) destination shards, per parameter."""
    _buffers: tuple[tuple, dict[Route, RouteBuffer]] | None = field(default=None, repr=False)
    binding: object = field(default=None, repr=False)
    """The executor's binding of the last call's tensors to this program (:mod:`loomrl.parallel.realloc_exec`),
    reused while the same tensors come back; opaque here."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def buffers(self, dtype_of: DtypeOf, verify: bool, device: torch.device) -> dict[Route, RouteBuffer]:
        """The route buffers for these dtypes, allocated on the first call and kept while the key holds."""
        key = (tuple(dtype_of(e.param) for entries in self.routes.values() for e in entries), verify, device)
        if self._buffers is None or self._buffers[0] != key:
            self._buffers = key, bind_buffers(self.routes, self.direct, dtype_of, verify, device)
        return self._buffers[1]


_PROGRAMS: dict[tuple[int, int], tuple[weakref.ref, TransferProgram]] = {}


def compile_program(plan: ReallocPlan, my_device: int) -> TransferProgram:
    """``my_device``'s schedule of ``plan``: built on the first call, then cached while the plan lives."""
    key = (id(plan), my_device)
    hit = _PROGRAMS.get(key)
    if hit is not None and hit[0]() is plan:
        return hit[1]
    schedule = _compile(plan, my_device)
    _PROGRAMS[key] = weakref.ref(plan, lambda _, key=key: _PROGRAMS.pop(key, None)), schedule
    return schedule


def clear_programs() -> None:
    """Forget every cached schedule and its route buffers (they are rebuilt when next needed)."""
    _PROGRAMS.clear()


def _compile(plan: ReallocPlan, me: int) -> TransferProgram:
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
        entries = [
            (
                _entry(pieces, src_at if route[0] == me else None, None if route[0] == me else dst_at),
                _travels_directly(plan, route, pieces),
            )
            for pieces in params.values()
        ]
        routes[route] = tuple(e for e, is_direct in entries if not is_direct)
        direct[route] = tuple(sorted((e for e, is_direct in entries if is_direct), key=lambda e: e.param))
    src_numel = {name: n for name in plan.shapes if (n := shard_numel(plan.src_intervals(me, name)))}
    dst_shapes = []
    if me in plan.dst.mesh:
        rank, split = plan.dst.devices.index(me), plan.dst.dp_split(plan.state)
        for name, shape in plan.shapes.items():
            local_shape = shard_shape(name, shape, plan.dst.layout, rank, plan.num_layers, split, plan.tied)
            if local_shape is not None:
                dst_shapes.append((name, local_shape, plan.alias_offset(me, name)))
    local_entries = tuple(_entry(pieces, src_at, dst_at) for pieces in local.values())
    return TransferProgram(me, src_numel, tuple(dst_shapes), routes, direct, local_entries)


def _travels_directly(plan: ReallocPlan, route: Route, pieces: Sequence[Transfer]) -> bool:
    """Whether an entry is sent from and received into its shards as is (see the module docstring): decided
    from the plan alone, so every participant agrees."""
    if sum(t.numel for t in pieces) < DIRECT_MIN_NUMEL:
        return False
    sender, receivers = route

    def contiguous(at: _Locators) -> bool:
        first = at.offset(pieces[0].param, pieces[0].start)
        return all(
            at.offset(t.param, t.start) == first + sum(p.numel for p in pieces[:i]) for i, t in enumerate(pieces)
        )

    return contiguous(_Locators(plan.src_intervals, sender)) or all(
        contiguous(_Locators(plan.dst_intervals, r)) for r in receivers
    )


def _entry(pieces: Sequence[Transfer], src_at: _Locators | None, dst_at: _Locators | None) -> Entry:
    """One parameter's pieces on one route; sides only for the locators given."""
    first = pieces[0]

    def side(at: _Locators | None) -> Side | None:
        return None if at is None else Side([(at.offset(t.param, t.start), t.numel) for t in pieces])

    return Entry(
        first.param,
        first.sender,
        sum(t.numel for t in pieces),
        len(pieces),
        (first.start, pieces[-1].end),
        side(src_at),
        side(dst_at),
    )


def bind_buffers(
    routes: Mapping[Route, Sequence[Entry]],
    direct: Mapping[Route, Sequence[Entry]],
    dtype_of: DtypeOf,
    verify: bool,
    device: torch.device,
) -> dict[Route, RouteBuffer]:
    """A byte buffer per route: checksums of every entry (if verifying), then the packed entries, largest
    elements first."""
    out = {}
    for route, entries in routes.items():
        # Largest elements first: each dtype group then starts aligned, and alignment below is a no-op.
        ordered = sorted(entries, key=lambda e: -dtype_of(e.param).itemsize)
        directs = tuple(direct.get(route, ()))
        staged = {
            i: torch.empty(e.numel, dtype=dtype_of(e.param), device=device)
            for i, e in enumerate(directs)
            if not e.mine.contiguous
        }
        sums_count = len(ordered) + len(directs)
        offset, offsets = _CHECKSUM_BYTES * sums_count if verify else 0, []
        for entry in ordered:
            size = dtype_of(entry.param).itemsize
            offset = -(-offset // size) * size
            offsets.append(offset)
            offset += entry.numel * size
        if offset == 0:  # only direct entries and no checksums: no buffer travels
            out[route] = RouteBuffer(torch.empty(0, dtype=torch.uint8, device=device), [], directs, staged)
            continue
        buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        placed = [_place(entry, buffer, start, dtype_of(entry.param)) for entry, start in zip(ordered, offsets)]
        sums = buffer[: _CHECKSUM_BYTES * sums_count].view(torch.float64).view(-1, 2) if verify else None
        out[route] = RouteBuffer(buffer, placed, directs, staged, sums)
    return out


def _place(entry: Entry, buffer: torch.Tensor, start: int, dtype: torch.dtype) -> _Placed:
    """The entry at byte ``start`` of a route buffer, with views for this device's side (sender or receiver)."""
    values = buffer[start : start + entry.numel * dtype.itemsize].view(dtype)
    side = entry.mine
    chunks = tuple(
        (values[run.pos : run.pos + run.count * run.length].view(run.count, run.length), run) for run in side.runs
    )
    return _Placed(entry, values, side.index(buffer.device), chunks)
