"""The controller's side of a fused stage (RLHFuse's inter-stage fusion; :mod:`loomrl.plan.schedule`).

Generation runs on every device of its allocation as a Ray streaming call: each replica hands its finished
samples on in chunks (references to their output shards and their token counts, never tokens), and its stream
ends once all its samples are done or it has handed its tail over in a migration (:mod:`loomrl.runtime.migration`).
Each inference member (reference, reward, critic) then runs on the samples that are ready, on the data-parallel
replicas of its own allocation whose devices are neither generating nor busy: on separate devices from the first
chunk on, on generation's devices once their replica has finished or migrated its tail. Every sample reaches every
member exactly once. The stage ends when generation has ended and every member has run on every sample.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import ray

from loomrl.plan.schedule import Step
from loomrl.runtime.executor import StepTrace
from loomrl.runtime.migration import StreamSpec
from loomrl.runtime.spec import SHARD_FOLLOWS, CallData
from loomrl.workflow.minibatches import split_by_tokens

__all__ = ["StreamFusionStage", "is_stream", "take_shard"]


class _Driver(Protocol):
    """What a fused stage asks of the controller that drives it (:class:`~loomrl.runtime.controller.Controller`,
    which imports this module, so the stage names only what it uses)."""

    workers: Sequence[Any]

    def payloads(self, step: Step, state: Any) -> dict[int, CallData]:
        """Per device of ``step``: its call's data for the iteration ``state``."""
        ...

    def inputs_of(self, keys: Sequence[str], rows: Sequence[int], state: Any) -> tuple:
        """Object references of the output shards holding ``keys`` of any of ``rows``."""
        ...


class StreamFusionStage:
    """One fused stage of one iteration, driven by its controller's event loop
    (:meth:`~loomrl.runtime.controller.Controller.run_steps`): :meth:`start` sends generation; every reply the
    loop receives for the stage goes to :meth:`on_reply`, which sends the members' calls that became possible;
    :attr:`done` when all ran."""

    def __init__(self, controller: _Driver, step: Step, state: Any, migrate_at: float):
        self.control, self.step, self.state = controller, step, state
        self.gen, self.members = step.members[0], step.members[1:]
        self.rows = len(state.ids)
        self.threshold = math.floor(migrate_at * self.rows)
        self.generating: set[int] = set(self.gen.devices)
        self.busy: set[int] = set()
        self.ready: dict[str, list[int]] = {m.id: [] for m in self.members}
        self.served: dict[str, int] = {m.id: 0 for m in self.members}
        self.calls: dict[int, dict] = {}
        """Sub-call number → its member, rows, payloads and the devices' replies so far."""
        self.parts: list[tuple[str, int, float, float]] = []
        """(label, device, start, end) of everything the stage ran: generation, migration, member calls."""
        self.numbers = itertools.count()
        self.began = time.time()

    @property
    def done(self) -> bool:
        return not self.generating and not self.calls and all(n == self.rows for n in self.served.values())

    def start(self, pending: dict, routed: dict) -> None:
        gen, fusion = self.gen, self.step.fusion
        payloads = self.control.payloads(gen, self.state)
        share = max(1, self.rows // gen.alloc.layout.dp)
        spec = StreamSpec(
            self.threshold,
            fusion.migrate_to,
            fusion.chunk or max(1, share // 4),
            max(self.state.tokens[s] for s in self.state.ids),
            self.state.max_budget,
            min(256, self.rows),
        )
        for device in gen.devices:
            stream = self.control.workers[device].run_stream.remote(gen.id, payloads[device], spec)
            pending[stream] = (f"MFC '{gen.id}'", gen.role, device)
            routed[stream] = (self, ("gen", device, payloads[device].publish))

    def on_reply(self, key: tuple, meta: dict, waitable: Any, pending: dict, routed: dict) -> None:
        if key[0] == "gen":
            self._on_generated(key, meta, waitable, pending, routed)
        else:
            self._on_member(key, meta)
        self._send(pending, routed)

    def _on_generated(self, key: tuple, meta: dict, stream: Any, pending: dict, routed: dict) -> None:
        _, device, publish = key
        if meta.get("done"):
            self.generating.discard(device)
            self.parts.append((self.gen.id, device, meta["start"], meta["end"]))
            if meta.get("migrated_at") is not None:
                self.parts.append(("migrate", device, meta["migrated_at"], meta["migrated_at"]))
            return
        pending[stream] = (f"MFC '{self.gen.id}'", self.gen.role, device)  # more to come
        routed[stream] = (self, key)
        if publish:
            rows = tuple(meta["rows"])
            for out in self.gen.mfc.outputs:
                self.state.where.setdefault(out, []).append((rows, meta["shard"][0]))
            self.state.tokens.update({int(k): v for k, v in meta.get("tokens", {}).items()})
            for member in self.members:
                self.ready[member.id] += rows

    def _on_member(self, key: tuple, meta: dict) -> None:
        _, number, device = key
        call = self.calls[number]
        call["replies"][device] = meta
        self.parts.append((call["member"].id, device, meta["start"], meta["end"]))
        if len(call["replies"]) < len(call["payloads"]):
            return
        del self.calls[number]
        member = call["member"]
        for dev, reply in call["replies"].items():
            data = call["payloads"][dev]
            if data.publish and "shard" in reply:
                for out in member.mfc.outputs:
                    self.state.where.setdefault(out, []).append((data.sample_ids, reply["shard"][0]))
        self.busy -= set(call["payloads"])

    def _send(self, pending: dict, routed: dict) -> None:
        """Each member's ready rows to its free replicas (balanced by tokens), one sub-call per replica."""
        for member in self.members:
            rows = self.ready[member.id]
            free = [r for r in member.alloc.replicas() if not set(r) & (self.generating | self.busy)]
            if not rows or not free:
                continue
            self.ready[member.id] = []
            self.served[member.id] += len(rows)
            counts = [self.state.tokens[s] for s in rows]
            for replica, part in zip(free, split_by_tokens(range(len(rows)), counts, len(free))):
                if part:
                    self._call(member, replica, tuple(rows[i] for i in part), pending, routed)

    def _call(self, member: Step, replica: tuple[int, ...], rows: tuple[int, ...], pending: dict, routed: dict) -> None:
        number = next(self.numbers)
        inputs = self.control.inputs_of(member.mfc.inputs, rows, self.state)
        payloads = {d: CallData(self.state.iteration, rows, inputs, (), member.alloc.publishes(d)) for d in replica}
        self.calls[number] = {"member": member, "payloads": payloads, "replies": {}}
        self.busy |= set(replica)
        for device in replica:
            ref = self.control.workers[device].run_step.remote(member.id, payloads[device])
            pending[ref] = (f"MFC '{member.id}'", member.role, device)
            routed[ref] = (self, ("member", number, device))

    def trace(self, iteration: int, phase: str) -> StepTrace:
        """The stage's trace: on each device, from the first to the last thing it ran for the stage (a device
        it reserved but never used: from the stage's start to its end), with every part."""
        ended = max((end for *_, end in self.parts), default=time.time())
        starts, ends = [], []
        for device in self.step.devices:
            mine = [(s, e) for _, d, s, e in self.parts if d == device]
            starts.append(min((s for s, _ in mine), default=self.began))
            ends.append(max((e for _, e in mine), default=ended))
        return StepTrace(
            iteration,
            self.step.id,
            self.step.kind.value,
            None,
            None,
            self.step.devices,
            tuple(starts),
            tuple(ends),
            phase,
            tuple(sorted(self.parts, key=lambda p: p[2])),
            {"migrate": "migrate"} | {m.id: m.mfc.kind.value for m in self.step.members},
        )


def is_stream(waitable: Any) -> bool:
    """Whether a waitable is a streaming call's generator (its items are fetched with ``next``)."""
    return isinstance(waitable, ray.ObjectRefGenerator)


def take_shard(stream: Any, item: Any) -> Any:
    """A streamed item whose shard follows it (:data:`~loomrl.runtime.spec.SHARD_FOLLOWS`) with the reference
    to that next item of the stream, which the controller owns, as its ``shard``; any other item as it is."""
    if isinstance(item, dict) and item.get("shard") == SHARD_FOLLOWS:
        return item | {"shard": (next(stream),)}
    return item
