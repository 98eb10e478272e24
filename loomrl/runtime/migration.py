"""A generation replica's part in a fused stage: chunking its finished samples, and the tail's migration.

Every replica of a fused stage's generation runs :class:`MigrationControl` as its op's
:class:`~loomrl.algorithms.context.StreamControl`. After each decode step the replicas sum their unfinished
samples (one all-reduce over the generation mesh, each replica counted once); when at most ``threshold`` are
left, they agree on a migration (RLHFuse's, at R_t): the ``migrate_to`` replicas with the most decoding left
keep generating and the others abort their unfinished samples, hand them over with the tokens generated so far,
and stop, freeing their devices for the stage's inference calls. A migrated sample is resubmitted with its
prefix (re-prefilled over prompt + prefix) and continues at the step it had reached from its own random stream,
so it ends as it would have where it started. Every rank of the mesh takes the same decisions from the same
gathered facts, so tensor-parallel ranks of a replica stay in step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loomrl.rollout import Request, RolloutEngine

__all__ = ["MigrationControl", "StreamSpec", "assign_tail"]


@dataclass(frozen=True)
class StreamSpec:
    """What the controller tells each generation replica of a fused stage."""

    threshold: int
    """Migrate once at most this many samples of the whole batch are unfinished (0: never)."""
    migrate_to: int
    """Replicas the tail moves onto."""
    chunk: int
    max_prompt: int
    max_budget: int
    slots: int


def assign_tail(samples: dict[int, list[tuple[int, int]]], migrate_to: int) -> tuple[list[int], dict[int, int]]:
    """Where the tail goes. ``samples``: replica → its unfinished (sample id, decoding left). The destinations are
    the ``migrate_to`` replicas with the most decoding left (ties: the lower replica), which keep their own
    samples; every other replica's samples move, the longest first, each to the destination with the least work
    so far. Returns the destinations and each moving sample's destination."""
    left = {replica: sum(n for _, n in items) for replica, items in samples.items()}
    dests = sorted(sorted(left), key=lambda r: -left[r])[:migrate_to]
    moving = [m for replica, items in samples.items() if replica not in dests for m in items]
    load = {r: left[r] for r in dests}
    where = {}
    for sample, n in sorted(moving, key=lambda m: (-m[1], m[0])):
        dest = min(dests, key=lambda r: (load[r], r))
        where[sample] = dest
        load[dest] += n
    return sorted(dests), where


class MigrationControl:
    """One rank's :class:`~loomrl.algorithms.context.StreamControl` in a fused stage (module docstring)."""

    def __init__(self, spec: StreamSpec, group, replica: int, counts: bool, replicas: int, device: torch.device):
        self.chunk, self.max_prompt, self.max_budget, self.slots = (
            spec.chunk,
            spec.max_prompt,
            spec.max_budget,
            spec.slots,
        )
        self.spec, self.group, self.replica, self.counts, self.device = spec, group, replica, counts, device
        self.in_step = spec.threshold > 0 and spec.migrate_to < replicas and group is not None
        self.migrated_at: float | None = None
        """When this replica took part in a migration (seconds since the epoch), for the stage's trace."""

    def after_step(self, engine: RolloutEngine) -> bool:
        if not self.in_step:
            return False
        unfinished = len(engine.live) + len(engine.waiting)
        count = torch.tensor([unfinished if self.counts else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, group=self.group)
        if int(count.item()) > self.spec.threshold:
            return False
        self.in_step = False
        return self._migrate(engine)

    def _migrate(self, engine: RolloutEngine) -> bool:
        self.migrated_at = time.time()
        requests = {lv.request.sample_id: (lv.request, lv.budget - len(lv.tokens)) for lv in engine.live}
        for req in engine.waiting:
            requests[req.sample_id] = (req, (req.max_new_tokens or engine.params.max_new_tokens) - len(req.prefix))
        mine = (self.replica, [(sid, n) for sid, (_, n) in requests.items()]) if self.counts else None
        facts = _gather(mine, self.group)
        dests, where = assign_tail({replica: items for replica, items in facts}, self.spec.migrate_to)
        leaving = self.replica not in dests
        handed = []
        if leaving:
            stopped = {c.sample_id: c for c in engine.abort(list(requests))}
            handed = [_resumed(requests[sid][0], stopped[sid]) for sid in requests] if self.counts else []
        arriving = [r for part in _gather(handed, self.group) for r in part]
        if not leaving:
            engine.submit(r for r in arriving if where[r.sample_id] == self.replica)
        return leaving


def _gather(value, group) -> list:
    """Every rank's ``value`` (None ones dropped), the same list on every rank."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return [v for v in out if v is not None]


def _resumed(request: Request, stopped) -> Request:
    """The request again, carrying what it generated so far (its prefix and their log-probs)."""
    return Request(
        request.sample_id,
        request.prompt,
        request.key,
        request.max_new_tokens,
        list(stopped.tokens),
        list(stopped.logps),
    )
