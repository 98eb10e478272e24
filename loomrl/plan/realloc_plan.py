"""Parameter reallocation planner (ReaLHF): which device sends which piece of which parameter to whom.

Moving a trainable model from one layout (its training layout) to another (e.g. its generation layout) is a
set of :class:`Transfer` pieces. Each piece is a half-open interval of one parameter's row-major flat index
space (see :mod:`loomrl.plan.shards`), obtained by cutting the source and destination shard intervals at
every boundary, so a piece lies inside one source shard interval and one destination shard interval. Pieces
that keep the same sender and receivers over adjacent ranges are merged back.

Each piece has one sender among the source devices holding it, chosen per receiver in this order:

1. the receiver itself, when it holds the piece in the source layout: a local copy, listed (``local``) but
   costing no bandwidth;
2. a holder on the receiver's node (the least loaded of them);
3. the least loaded holder anywhere.

"Load" is the number of elements already assigned to a device to send, ties broken by device id, so the
senders of replicated shards take turns. Receivers on one node share a sender, and all receivers given the
same sender for a piece get it in one broadcast (``receivers`` holds them all).

A destination shard that is one contiguous span of the device's source shard (the source shard itself, a
pipeline stage's whole parameters, or a row block of a replicated weight split along dim 0 by TP) is not
copied at all: the executor hands back a view of the source tensor (the plan calls it *aliased*). Every other
destination shard is a new buffer, and returning to the training layout only frees those
(:attr:`ReallocPlan.free_after`): the source shards were never given up.

Pure Python: the cost model prices plans with it and the executor (:mod:`loomrl.parallel.realloc_exec`)
runs them. Build the plan from the same inputs on every rank (or build it once and ship it): the executor's
communication order follows the plan's order.

Planning costs O(pieces): a parameter split along dim 1 (o/down projections) has one interval per row, so
its pieces grow with its rows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from loomrl.plan.allocation import Allocation
from loomrl.plan.shards import Interval, interval_table, pp_stages, shard_intervals, shard_numel, tp_dim


@dataclass(frozen=True)
class Transfer:
    """Elements ``[start, end)`` of ``param``'s flat index space, sent by ``sender`` to every receiver."""

    param: str
    start: int
    end: int
    sender: int
    """Global device id of the source device that sends the piece."""
    receivers: tuple[int, ...]
    """Global device ids that receive it, sorted; ``(sender,)`` for a local copy."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def local(self) -> bool:
        """The receiver already holds the piece in the source layout: a copy within one device."""
        return self.receivers == (self.sender,)


@dataclass(frozen=True)
class ShardBuffer:
    """The destination shard of one parameter on one device."""

    device: int
    param: str
    numel: int
    alias_offset: int | None
    """Where the shard starts in the device's flat source shard when it is one contiguous span of it: the
    destination shard is then a view of the source shard (no new memory, no copy); None otherwise."""

    @property
    def aliased(self) -> bool:
        return self.alias_offset is not None


@dataclass(frozen=True)
class ReallocPlan:
    """Transfers taking every parameter from the ``src`` allocation to the ``dst`` allocation."""

    transfers: tuple[Transfer, ...]
    shapes: Mapping[str, tuple[int, ...]] = field(repr=False)
    """Full shape of every parameter, in the planning order."""
    num_layers: int
    src: Allocation
    dst: Allocation
    state: bool
    """Whether the tensors moved are optimizer state (Adam's moments, master weights), divided over the
    data-parallel ranks as each allocation keeps them (:meth:`Allocation.dp_split`), rather than weights."""
    nodes: Mapping[int, Hashable] = field(repr=False)
    """Node of every device of either mesh."""
    dst_buffers: tuple[ShardBuffer, ...] = field(repr=False)
    tied: bool = False
    """Whether the model's output head shares its input embedding (held by the first and the last pipeline
    stage: :func:`loomrl.plan.shards.pp_stages`)."""

    @property
    def free_after(self) -> tuple[ShardBuffer, ...]:
        """Destination-only buffers: what returning to the source (training) layout releases."""
        return tuple(buf for buf in self.dst_buffers if not buf.aliased)

    @cached_property
    def _aliased(self) -> dict[tuple[int, str], int]:
        return {(b.device, b.param): b.alias_offset for b in self.dst_buffers if b.alias_offset is not None}

    def aliased(self, device: int, param: str) -> bool:
        """Whether ``device``'s destination shard of ``param`` is a view of its source shard."""
        return (device, param) in self._aliased

    def alias_offset(self, device: int, param: str) -> int | None:
        """Where ``device``'s aliased destination shard of ``param`` starts in its flat source shard (None:
        not aliased)."""
        return self._aliased.get((device, param))

    def src_intervals(self, device: int, param: str) -> list[Interval]:
        """Flat intervals of ``param`` that ``device`` holds in the source layout (empty if none)."""
        return _intervals(self.src, self.state, device, param, self.shapes[param], self.num_layers, self.tied)

    def dst_intervals(self, device: int, param: str) -> list[Interval]:
        """Flat intervals of ``param`` that ``device`` holds in the destination layout (empty if none)."""
        return _intervals(self.dst, self.state, device, param, self.shapes[param], self.num_layers, self.tied)

    def bytes_moved(self, bytes_per_elem: int) -> int:
        """Bytes crossing devices: every non-local piece counts once per receiver."""
        return sum(t.numel * len(t.receivers) for t in self.transfers if not t.local) * bytes_per_elem

    def bytes_local(self, bytes_per_elem: int) -> int:
        """Bytes copied within a device (local pieces into new buffers; aliased shards copy nothing)."""
        return (
            sum(t.numel for t in self.transfers if t.local and (t.sender, t.param) not in self._aliased)
            * bytes_per_elem
        )

    def cross_node_bytes(self, bytes_per_elem: int) -> int:
        """The part of :meth:`bytes_moved` received from another node."""
        return (
            sum(t.numel for t in self.transfers for r in t.receivers if self.nodes[r] != self.nodes[t.sender])
            * bytes_per_elem
        )

    def send_bytes(self, bytes_per_elem: int) -> dict[int, int]:
        """Bytes each device sends (a broadcast counts once at its sender); devices sending nothing are absent."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            if not t.local:
                out[t.sender] += t.numel * bytes_per_elem
        return dict(out)

    def recv_bytes(self, bytes_per_elem: int) -> dict[int, int]:
        """Bytes each device receives from other devices; devices receiving nothing are absent."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            if not t.local:
                for r in t.receivers:
                    out[r] += t.numel * bytes_per_elem
        return dict(out)

    def broadcast_groups(self) -> list[tuple[int, ...]]:
        """Sorted device sets (sender and receivers) of the multi-receiver pieces, in a fixed order."""
        return sorted({tuple(sorted((t.sender, *t.receivers))) for t in self.transfers if len(t.receivers) > 1})


def _intervals(
    alloc: Allocation, state: bool, device: int, param: str, shape: Sequence[int], num_layers: int, tied: bool
) -> list[Interval]:
    if device not in alloc.mesh:
        return []
    rank = alloc.devices.index(device)
    return shard_intervals(param, shape, alloc.layout, rank, num_layers, alloc.dp_split(state), tied)


def plan_reallocation(
    params: Mapping[str, Sequence[int]],
    num_layers: int,
    src: Allocation,
    dst: Allocation,
    nodes_of: Callable[[int], Hashable],
    state: bool = False,
    tied: bool = False,
) -> ReallocPlan:
    """Plan moving ``params`` (name → full shape) from allocation ``src`` to allocation ``dst``.

    What each device holds on either side is its shard of the allocation's layout, divided over its
    data-parallel ranks as :meth:`Allocation.dp_split` says (FSDP rows; with ``state``, ZeRO-1's flat blocks of
    optimizer state); micro-batches and recompute play no part. ``nodes_of`` maps a device id to its node (any
    hashable), e.g. ``ClusterSpec.node_of``. The order of ``params`` is the order pieces are planned and sent in.
    ``tied``: the output head shares the input embedding, which the first and last pipeline stages then both hold.

    Raises ValueError when the layers do not divide into the pipeline stages.
    """
    shapes = {name: tuple(int(n) for n in shape) for name, shape in params.items()}
    nodes = {device: nodes_of(device) for device in sorted({*src.mesh, *dst.mesh})}
    load: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    buffers: list[ShardBuffer] = []
    # Parameters of one kind (split dim, stage, shape: e.g. every layer's q_proj in one stage) have the same
    # shards and hence the same segments and route options; only the senders' loads differ between them.
    intervals: dict[tuple, dict[int, list[Interval]]] = {}
    segments: dict[tuple, list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]] = {}
    options: dict[tuple, _RouteOptions] = {}
    for name, shape in shapes.items():
        keys = tuple(
            (side, tp_dim(name), pp_stages(name, num_layers, p.layout.pp, tied), shape)
            for side, p in (("src", src), ("dst", dst))
        )
        for key, placement in zip(keys, (src, dst)):
            if key not in intervals:
                intervals[key] = _intervals_by_device(placement, state, name, shape, num_layers, tied)
        held, needed = intervals[keys[0]], intervals[keys[1]]
        buffers.extend(
            ShardBuffer(device, name, shard_numel(ivs), _alias_offset(held.get(device), ivs))
            for device, ivs in needed.items()
        )
        if keys not in segments:
            segments[keys] = [seg for seg in _segments(held, needed) if seg[3]]
        pieces: list[Transfer] = []
        for start, end, holders, needers in segments[keys]:
            if not holders:
                raise ValueError(f"{name}: elements [{start}, {end}) are held by no source device")
            route = (holders, needers)
            if route not in options:
                options[route] = _route_options(holders, needers, nodes)
            for sender, receivers in _choose_senders(options[route], load, end - start):
                pieces.append(Transfer(name, start, end, sender, receivers))
        transfers.extend(_merge_adjacent(pieces))
    return ReallocPlan(tuple(transfers), shapes, num_layers, src, dst, state, nodes, tuple(buffers), tied)


def _alias_offset(held: list[Interval] | None, needed: list[Interval]) -> int | None:
    """Offset of a destination shard (``needed``) in the same device's flat source shard (the concatenation
    of ``held``) when it is one contiguous span of it — each needed interval inside a held one, each starting
    where the previous one ends in the source shard; None otherwise."""
    if not held:
        return None
    starts, offsets = interval_table(held)
    first = end = None
    for lo, hi in needed:
        i = bisect_right(starts, lo) - 1
        if i < 0 or hi > held[i][1]:
            return None
        local = offsets[i] + lo - held[i][0]
        if end is not None and local != end:
            return None
        first = local if first is None else first
        end = local + hi - lo
    return first


def _intervals_by_device(
    alloc: Allocation, state: bool, name: str, shape: tuple[int, ...], num_layers: int, tied: bool
) -> dict[int, list[Interval]]:
    """Non-empty shard intervals of ``name`` per device of ``alloc``, in device order. Ranks of other pipeline
    stages hold nothing, and ranks differing only in their data-parallel rank hold the same intervals (unless
    they divide the shard): each distinct shard is computed once (pricing plans many large meshes)."""
    layout, split = alloc.layout, alloc.dp_split(state)
    stages = pp_stages(name, num_layers, layout.pp, tied)
    known: dict[tuple[int, int], list[Interval]] = {}
    out = {}
    for rank, device in enumerate(alloc.devices):
        pp_rank, dp_rank, tp_rank = layout.coords(rank)
        if pp_rank not in stages:
            continue
        key = (dp_rank if split != "none" else 0, tp_rank)
        if key not in known:
            known[key] = shard_intervals(name, shape, layout, rank, num_layers, split, tied)
        if known[key]:
            out[device] = known[key]
    return out


def _segments(
    held: Mapping[int, list[Interval]], needed: Mapping[int, list[Interval]]
) -> Iterator[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """Sweep every boundary: ``(start, end, holders, needers)`` of each range where neither set changes."""
    events: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # point → (side, device, +1 | -1)
    for side, by_device in enumerate((held, needed)):
        for device, intervals in by_device.items():
            for lo, hi in intervals:
                events[lo].append((side, device, 1))
                events[hi].append((side, device, -1))
    active: tuple[set[int], set[int]] = (set(), set())
    points = sorted(events)
    for point, following in zip(points, points[1:] + [None]):
        for side, device, delta in events[point]:
            (active[side].add if delta > 0 else active[side].discard)(device)
        if following is not None and (active[0] or active[1]):
            yield point, following, tuple(sorted(active[0])), tuple(sorted(active[1]))


class _RouteOptions(NamedTuple):
    """What sender choice needs of a range's holders and needers, independent of the senders' loads."""

    local: list[tuple[int, tuple[int, ...]]]
    """``(device, (device,))`` for each needer that holds the range: a local copy."""
    groups: list[tuple[list[int], list[int]]]
    """Per node of the other needers, in the order of its lowest one: (its needers, candidate senders: the
    holders on that node, else all holders)."""


def _route_options(holders: tuple[int, ...], needers: tuple[int, ...], nodes: Mapping[int, Hashable]) -> _RouteOptions:
    holder_set = set(holders)
    by_node: dict[Hashable, list[int]] = {}
    for device in needers:
        if device not in holder_set:
            by_node.setdefault(nodes[device], []).append(device)
    groups = [(group, [h for h in holders if nodes[h] == node] or list(holders)) for node, group in by_node.items()]
    return _RouteOptions([(device, (device,)) for device in needers if device in holder_set], groups)


def _choose_senders(options: _RouteOptions, load: dict[int, int], numel: int) -> list[tuple[int, tuple[int, ...]]]:
    """``(sender, receivers)`` for one range: local copies first, then one sender per node of receivers, the
    least loaded of its candidates (ties: the lowest id)."""
    out = list(options.local)
    chosen: dict[int, list[int]] = {}
    for group, candidates in options.groups:
        sender = min(candidates, key=lambda h: (load[h], h))
        if sender not in chosen:  # a broadcast leaves its sender once, however many receive it
            load[sender] += numel
            chosen[sender] = []
        chosen[sender].extend(group)
    out.extend((sender, tuple(sorted(group))) for sender, group in sorted(chosen.items()))
    return out


def _merge_adjacent(pieces: list[Transfer]) -> list[Transfer]:
    """Join pieces of one parameter with the same sender and receivers whose ranges touch."""
    merged: list[Transfer] = []
    last: dict[tuple[int, tuple[int, ...]], int] = {}  # (sender, receivers) → index of its latest piece
    for piece in pieces:
        key = (piece.sender, piece.receivers)
        index = last.get(key)
        if index is not None and merged[index].end == piece.start:
            prev = merged[index]
            merged[index] = Transfer(prev.param, prev.start, piece.end, prev.sender, prev.receivers)
        else:
            last[key] = len(merged)
            merged.append(piece)
    return merged
