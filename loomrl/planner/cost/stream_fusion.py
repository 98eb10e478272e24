"""Pricing a fused stage (RLHFuse's inter-stage fusion): generation streamed into the inference calls, the
long tail migrated onto a few replicas.

What :func:`price_stream_fusion` models is what the runtime runs (:mod:`loomrl.runtime.stream_fusion`,
:mod:`loomrl.runtime.migration`), event by event, on the workload's response-length distribution:

- **Generation.** The batch's samples take lengths from the distribution (its quantiles in a length-blind order,
  :func:`~loomrl.planner.cost.decode.admission_order`), dealt to the generation replicas in turn. A replica prefills
  its prompts, then decodes its live samples step by step; a sample of length ``L`` finishes at step ``L``. Step
  costs come from the cost model (:meth:`~loomrl.planner.cost.model.CostModel.decode_segment_terms`), corrected like
  generation.
- **Migration.** While a migration is pending the replicas step together (they agree on the unfinished count
  after every step), so a step lasts as long as its slowest replica. After the first step ``t*`` at which at
  most ``migrate_at × batch`` samples are unfinished, the ``migrate_to`` replicas with the most decoding left
  keep their samples and receive the others' (re-prefilled over prompt + ``t*`` tokens, then decoding from step
  ``t*``); the other replicas stop. Without a migration each replica decodes on its own until it is done.
- **Chunks.** A replica hands its finished samples on ``chunk`` at a time (the last ones when it stops).
- **Inference.** Each member call runs on the ready samples on the data-parallel replicas of its allocation
  whose devices are neither generating nor busy, split evenly, one call per replica, each priced like an
  inference call over those samples (corrected, with its per-call overhead). Members share devices in turn.

The stage lasts until its last part ends; the parts are returned for the timeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from loomrl.plan.allocation import Allocation
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.schedule import Step
from loomrl.planner.cost import decode as D
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.cost.workload import Workload
from loomrl.workflow import MFCKind

__all__ = [
    "MIGRATE_AT_CANDIDATES",
    "GenerationFloor",
    "Generations",
    "StreamFusionModel",
    "StreamFusionPrice",
    "best_migrate_at",
    "generation_floor",
    "price_stream_fusion",
]

MIGRATE_AT_CANDIDATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
"""The thresholds ``migrate_at: auto`` chooses among (RLHFuse found about 0.2 best at scale)."""

Part = tuple[str, int, float, float]
"""``(label, device, start, end)``, seconds from the stage's start."""

Generations = dict[tuple, tuple]
"""Priced generations of stages, by (role, allocation, threshold, migrate_to, chunk): a search prices many stages
around one generation, so the cost model keeps one of these and passes it to every pricing."""


class StreamFusionModel(Protocol):
    """What pricing a stream-fusion stage asks of the cost model (:class:`~loomrl.planner.cost.model.CostModel`)."""

    workload: Workload
    corrections: Corrections

    @property
    def shapes(self) -> Mapping[str, ModelShape | None]:
        """Role → its model's shape (None for a role with no model: a rule)."""
        ...

    @property
    def system_factor(self) -> float:
        """The factor every time the model gives is scaled by (the hardware profile's ``system_factor``)."""
        ...

    def decode_segment_terms(self, role: str, alloc: Allocation, segments: list[D.Segment]) -> dict[str, float]:
        """Uncorrected terms of decoding ``segments`` of the occupancy on one replica of ``alloc``."""
        ...

    def prefill_terms(self, role: str, alloc: Allocation, samples: float, context: float) -> dict[str, float]:
        """Uncorrected terms of prefilling ``samples`` samples of ``context`` tokens on one replica."""
        ...

    def inference_terms(
        self, role: str, alloc: Allocation, samples: float | None = None, lengths: tuple[int, ...] | None = None
    ) -> dict[str, float]:
        """Uncorrected terms of one forward pass over ``samples`` samples of response ``lengths``."""
        ...


@dataclass(frozen=True)
class StreamFusionPrice:
    """A fused stage's predicted time and what each device runs in it."""

    seconds: float
    parts: tuple[Part, ...]
    migrate_at: float
    """The threshold priced (``auto`` resolved)."""


def best_migrate_at(cost: StreamFusionModel, step: Step, generations: Generations | None = None) -> float:
    """The candidate threshold with the shortest predicted stage (the lowest on ties)."""
    generations = {} if generations is None else generations
    return min(MIGRATE_AT_CANDIDATES, key=lambda r: (price_stream_fusion(cost, step, r, generations).seconds, r))


@dataclass(frozen=True)
class GenerationFloor:
    """What no fused stage's generation on one allocation beats (:mod:`loomrl.planner.search.bounds` uses it)."""

    ready: tuple[tuple[float, float], ...]
    """``(seconds, fraction)`` pairs: the ``fraction`` of the batch with the longest responses is handed on no
    sooner than ``seconds`` (its shortest sample decoded alone)."""
    device_seconds: float
    """The least device-seconds the generation occupies."""


def generation_floor(cost: StreamFusionModel, role: str, alloc: Allocation) -> GenerationFloor:
    """Lower bounds on a fused stage's generation on ``alloc``, whatever its migration threshold and chunks.

    - **Ready times.** The runtime deals the batch evenly over the ``dp`` replicas and migration only gathers
      samples onto fewer, so the ``c`` samples of length at least ``k`` leave some replica holding at least
      ``⌈c / dp⌉`` of them through ``k`` decode steps, after prefilling at least ``⌊batch / dp⌋`` prompts (a
      step with more samples live costs no less; migration re-prefills and skips no step). So those samples
      are ready no sooner than that, for each length ``k`` of the distribution.
    - **Work.** A decode step's cost per replica is a maximum of terms affine in its live samples (weights and KV
      read, matmuls), plus fixed parts, so the replicas' steps at one step index cost together at least one
      replica's step with every live sample of the batch (the sum of maxima is at least the maximum of sums).
      The generation so occupies at least a replica's devices for the whole batch decoded on one replica.

    Both are corrected like generation, the per-call overhead included once."""
    w, dp = cost.workload, alloc.layout.dp
    lengths = sorted(D.admission_order(w.response_lengths, w.batch))
    prefill = cost.prefill_terms(role, alloc, max(1, len(lengths) // dp), w.prompt_len)
    ready = []
    for index, k in enumerate(lengths):
        if index and k == lengths[index - 1]:
            continue
        live = math.ceil((len(lengths) - index) / dp)
        terms = dict(prefill)
        for name, seconds in cost.decode_segment_terms(
            role, alloc, [D.Segment(0, k, live, live * w.prompt_len)]
        ).items():
            terms[name] = terms.get(name, 0.0) + seconds
        ready.append((_corrected(cost, MFCKind.GENERATE, terms), (len(lengths) - index) / len(lengths)))
    whole = cost.decode_segment_terms(role, alloc, D.continuous_segments(lengths, len(lengths), w.prompt_len))
    replica = alloc.layout.tp * alloc.layout.pp
    return GenerationFloor(tuple(ready), replica * _corrected(cost, MFCKind.GENERATE, whole))


def price_stream_fusion(
    cost: StreamFusionModel, step: Step, migrate_at: float | None = None, generations: Generations | None = None
) -> StreamFusionPrice:
    """The stream-fusion stage ``step`` on ``cost``'s workload (module docstring); ``migrate_at`` overrides the
    plan's; ``generations`` holds the generations priced so far (the cost model's, shared by its pricings)."""
    runs = {} if generations is None else generations
    fusion = step.fusion
    assert fusion is not None  # a stream-fusion stage carries the plan's settings
    value = fusion.migrate_at if migrate_at is None else migrate_at
    if isinstance(value, str):
        return price_stream_fusion(cost, step, best_migrate_at(cost, step, runs), runs)
    gen = step.members[0]
    key = (gen.role, gen.alloc, value, fusion.migrate_to, fusion.chunk)
    if key not in runs:
        generation = _Generation(cost, step, value)
        runs[key] = (*generation.run(), tuple(generation.parts))
    ready, gen_until, gen_parts = runs[key]
    parts = list(gen_parts)
    parts += _serve(cost, step, ready, gen_until)
    return StreamFusionPrice(max((end for *_, end in parts), default=0.0), tuple(parts), value)


class _Generation:
    """The generation replicas of a fused stage and when each of their samples is handed on."""

    def __init__(self, cost: StreamFusionModel, step: Step, migrate_at: float):
        assert step.fusion is not None  # a stream-fusion stage carries the plan's settings
        self.cost, self.gen, self.fusion = cost, step.members[0], step.fusion
        w = cost.workload
        self.replicas = self.gen.allocation.replicas()
        lengths = D.admission_order(w.response_lengths, w.batch)
        self.lengths = [sorted(lengths[r :: len(self.replicas)]) for r in range(len(self.replicas))]
        self.prompt = w.prompt_len
        self.threshold = math.floor(migrate_at * w.batch)
        self.migrating = self.threshold > 0 and self.fusion.migrate_to < len(self.replicas)
        share = max(1, w.batch // len(self.replicas))
        self.chunk = self.fusion.chunk or max(1, share // 4)
        self.parts: list[Part] = []
        self.overhead = _corrected(cost, MFCKind.GENERATE, {})  # the call's fixed seconds, paid once

    def _seconds(self, terms: dict[str, float]) -> float:
        return _corrected(self.cost, MFCKind.GENERATE, terms) - self.overhead

    def _decoded(self, lengths: list[int], points: set[int] | list[int], context: float) -> dict[int, float]:
        """Seconds a replica decoding ``lengths`` from a context of ``context`` tokens spends on its first ``n``
        steps, for each ``n`` of ``points``: one sweep over the occupancy segments, a point inside a segment
        priced as the segments before it plus that segment cut at the point."""
        out, done = {}, 0.0
        segments = iter(D.continuous_segments(lengths, len(lengths), context))
        seg = next(segments, None)
        for n in sorted(points):
            while seg is not None and seg.end <= n:
                done += self._seconds(self.cost.decode_segment_terms(self.gen.model_role, self.gen.allocation, [seg]))
                seg = next(segments, None)
            partial = 0.0
            if seg is not None and seg.start < n:
                cut = D.Segment(seg.start, n, seg.live, seg.ctx_base)
                partial = self._seconds(self.cost.decode_segment_terms(self.gen.model_role, self.gen.allocation, [cut]))
            out[n] = done + partial
        return out

    def _prefill(self, samples: float, context: float) -> float:
        if samples <= 0:
            return 0.0
        return self._seconds(self.cost.prefill_terms(self.gen.model_role, self.gen.allocation, samples, context))

    def run(self) -> tuple[list[tuple[float, tuple[int, ...]]], dict[int, float]]:
        """(time, response lengths) of every hand-over, and when each generating device stops."""
        overhead = self.overhead
        starts = [overhead + self._prefill(len(ls), self.prompt) for ls in self.lengths]
        curves = [self._decoded(ls, set(ls), self.prompt) for ls in self.lengths]
        if not self.migrating:
            finish = [[(starts[r] + curves[r][n], n) for n in ls] for r, ls in enumerate(self.lengths)]
            ends = [max((t for t, _ in f), default=starts[r]) for r, f in enumerate(finish)]
            return self._handed(finish, ends), self._stops(ends)
        every = sorted(n for ls in self.lengths for n in ls)
        step = next(n for n in every if sum(1 for m in every if m > n) <= self.threshold)
        points = sorted({n for n in every if n <= step})
        decoded = [self._decoded(ls, points, self.prompt) for ls in self.lengths]
        clock = {n: max(s + d[n] for s, d in zip(starts, decoded)) for n in points}
        moment = clock[step]
        tail = {r: [n - step for n in ls if n > step] for r, ls in enumerate(self.lengths)}
        dests = sorted(sorted(tail), key=lambda r: -sum(tail[r]))[: self.fusion.migrate_to]
        moving = sorted((n for r in tail if r not in dests for n in tail[r]), reverse=True)
        kept = {r: list(tail[r]) for r in dests}
        for n in moving:  # the longest first, to the least loaded destination, as the runtime assigns them
            kept[min(dests, key=lambda r: (sum(kept[r]), r))].append(n)
        finish = [[(clock[n], n) for n in ls if n <= step] for ls in self.lengths]
        ends = [moment] * len(self.replicas)
        for r in dests:
            arrived = len(kept[r]) - len(tail[r])
            begin = moment + self._prefill(arrived, self.prompt + step)
            curve = self._decoded(kept[r], set(kept[r]), self.prompt + step) if kept[r] else {}
            finish[r] += [(begin + curve[n], n + step) for n in kept[r]]
            ends[r] = max([moment, *(t for t, _ in finish[r])])
        for device in (d for r, rep in enumerate(self.replicas) for d in rep):
            self.parts.append(("migrate", device, moment, moment))
        return self._handed(finish, ends), self._stops(ends)

    def _handed(self, finish: list[list[tuple[float, int]]], ends: list[float]) -> list[tuple[float, tuple[int, ...]]]:
        """Each replica's samples (when each finishes, its response length), handed on ``chunk`` at a time, the
        rest when it stops: (time, the chunk's response lengths)."""
        out = []
        for done, end in zip(finish, ends):
            done = sorted(done)
            for k in range(0, len(done), self.chunk):
                group = done[k : k + self.chunk]
                out.append((group[-1][0] if len(group) == self.chunk else end, tuple(n for _, n in group)))
        return out

    def _stops(self, ends: list[float]) -> dict[int, float]:
        stops = {}
        for replica, end in zip(self.replicas, ends):
            for device in replica:
                stops[device] = end
                self.parts.append((self.gen.id, device, 0.0, end))
        return stops


def _serve(
    cost: StreamFusionModel, step: Step, ready: list[tuple[float, tuple[int, ...]]], gen_until: dict[int, float]
) -> list[Part]:
    """The members' calls, each on its free replicas as samples become ready (module docstring)."""
    members = step.members[1:]
    events = sorted(ready, key=lambda event: event[0])
    waiting: dict[str, list[int]] = {m.id: [] for m in members}
    busy: dict[int, float] = {}
    parts: list[Part] = []
    wakeups: list[float] = sorted(set(gen_until.values()))
    now, k = 0.0, 0
    while k < len(events) or any(waiting.values()):
        if k < len(events) and events[k][0] <= now + 1e-12:
            for m in members:
                waiting[m.id] += events[k][1]
            k += 1
            continue
        for m in members:
            free = [
                r
                for r in m.allocation.replicas()
                if all(gen_until.get(d, 0.0) <= now + 1e-12 and busy.get(d, 0.0) <= now + 1e-12 for d in r)
            ]
            if not waiting[m.id] or not free:
                continue
            ordered = sorted(waiting[m.id])  # dealt in turn: each replica gets a like mix of lengths
            for index, replica in enumerate(free):
                share = ordered[index :: len(free)]
                if not share:
                    continue
                seconds = _inference(cost, m, tuple(share))
                for device in replica:
                    busy[device] = now + seconds
                    parts.append((m.id, device, now, now + seconds))
            waiting[m.id] = []
        later = [t for t in [*busy.values(), *wakeups] if t > now + 1e-12]
        if k < len(events):
            later.append(events[k][0])
        if not later:
            break
        now = min(later)
    return parts


def _inference(cost: StreamFusionModel, member: Step, lengths: tuple[int, ...]) -> float:
    """Seconds of one call of ``member`` over samples of response ``lengths`` on one replica of its allocation
    (its per-call overhead alone for a role the cost model has no model of: a rule)."""
    role = member.model_role
    terms = (
        {}
        if role not in cost.shapes or cost.shapes[role] is None
        else cost.inference_terms(role, member.allocation, float(len(lengths)), lengths)
    )
    return _corrected(cost, MFCKind.INFERENCE, terms)


def _corrected(cost: StreamFusionModel, kind: MFCKind, terms: dict[str, float]) -> float:
    """Seconds of ``terms`` as the cost model gives a call's: corrected, its per-call overhead included, times the
    profile's stated system factor (:meth:`~loomrl.planner.cost.model.CostModel.mfc_time`)."""
    return cost.corrections.apply_terms(kind, terms) * cost.system_factor
