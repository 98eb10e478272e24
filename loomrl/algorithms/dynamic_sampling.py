"""Dynamic sampling (DAPO, ``algo.dynamic_sampling``): keep only groups that carry a learning signal, and generate
more prompts in waves until the batch is full.

A group whose responses all got the same reward has zero advantage under GRPO and RLOO: it costs a training step
and teaches nothing. Each iteration therefore runs as waves (:class:`Waves`): a wave's prompts are generated and
scored (the calls that make ``score``, :func:`loomrl.plan.schedule.split_for_sampling`), the group filter keeps
some groups, and while fewer than ``rollout.prompts_per_iter`` are kept another wave follows, of
``ceil(missing / estimate)`` prompts, ``estimate`` being a running estimate of the kept fraction. After
``max_waves`` waves the batch is used as it is: dropped groups fill it in the order they were generated. The rest
of the iteration (reference and critic inference, advantages, training) runs on exactly the configured number of
groups, kept groups first in generation order; a kept group beyond them is discarded.

:class:`DynamicSampler` holds what crosses iterations, the prompt cursor and the estimate; it is checkpointed
with the run and resumes exactly. Every executor runs the same waves on the same prompts (sample ids come from the
cursor), so the run computes what the reference executor computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from loomrl.config.schema import DynamicSamplingConfig
from loomrl.data.reward_functions import load_reward_fn
from loomrl.errors import DataError
from loomrl.workflow.batch import Batch
from loomrl.workflow.graph import REWARD_KEY

__all__ = ["DynamicSampler", "GroupFilter", "Waves", "equal_rewards", "group_filter"]

GroupFilter = Callable[[list[float]], bool]
"""Given a group's rewards (one per sample, in order), whether to keep the group."""

PRODUCER = "reward_inf"
"""The call whose output the filter reads."""
SCORE_KEY = REWARD_KEY
"""The column the filter reads: each sample's reward (before overlong shaping)."""
EQUAL_TOLERANCE = 1e-6
"""Rewards closer than this count as equal (an executor's reward model may differ from another's by rounding)."""
ESTIMATE_DECAY = 0.5
"""Weight of the old estimate against a wave's kept fraction."""


def equal_rewards(rewards: list[float]) -> bool:
    """DAPO's filter: keep a group unless its rewards are all equal."""
    return max(rewards) - min(rewards) > EQUAL_TOLERANCE


def group_filter(spec: str) -> GroupFilter:
    """The filter named by ``algo.dynamic_sampling.filter``; a user function's errors become one line naming it."""
    if spec == "equal_rewards":
        return equal_rewards
    try:
        fn = load_reward_fn(spec)
    except DataError as err:
        raise DataError(f"algo.dynamic_sampling.filter: {err}".replace("reward function ", "")) from None

    def checked(rewards: list[float]) -> bool:
        try:
            keep = fn(rewards)
        except Exception as exc:  # noqa: BLE001 - user code: any failure is reported in one line
            raise DataError(
                f"algo.dynamic_sampling.filter '{spec}' raised {type(exc).__name__}: {exc} (rewards {rewards})"
            ) from None
        if not isinstance(keep, bool):
            raise DataError(
                f"algo.dynamic_sampling.filter '{spec}' returned {type(keep).__name__} {keep!r}; it must "
                "return True (keep the group) or False"
            )
        return keep

    return checked


class DynamicSampler:
    """The prompt cursor and the kept-fraction estimate of a run, across iterations (module docstring)."""

    def __init__(
        self,
        settings: DynamicSamplingConfig,
        prompts_per_iter: int,
        group_size: int,
        make_wave: Callable[[int, int], Batch],
        keep: GroupFilter | None = None,
    ):
        self.settings, self.prompts, self.group = settings, prompts_per_iter, group_size
        self.make_wave = make_wave
        """``make_wave(cursor, prompts)``: the batch of ``prompts`` prompts from data position ``cursor``."""
        self.keep = keep or group_filter(settings.filter)
        self.cursor = 0
        self.estimate = 1.0

    def state_dict(self) -> dict[str, float]:
        return {"cursor": self.cursor, "estimate": self.estimate}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.cursor, self.estimate = int(state["cursor"]), float(state["estimate"])

    def wave_prompts(self, missing: int) -> int:
        """Prompts of a wave that should keep ``missing`` more groups, at the estimated kept fraction."""
        cap = math.ceil(self.settings.max_wave_factor * self.prompts)
        return max(1, min(math.ceil(missing / max(self.estimate, 1e-9)), cap))

    def waves(self) -> Waves:
        """The waves of the next iteration."""
        return Waves(self)


class Waves:
    """One iteration's waves: :meth:`first` is the first wave's batch; :meth:`offer` takes a wave's rewards and
    gives the next wave's batch, or None once the batch is full or the waves are spent; then :meth:`kept` is the
    sample ids that train, in order, and :meth:`stats` what the metrics say of the waves."""

    producer = PRODUCER
    key = SCORE_KEY

    def __init__(self, sampler: DynamicSampler):
        self.sampler = sampler
        self.kept_groups: list[list[int]] = []
        self.dropped_groups: list[list[int]] = []
        self.count = 0
        self.generated = 0
        self.expected: list[int] = []

    def _next(self, missing: int) -> Batch:
        s = self.sampler
        n = s.wave_prompts(missing)
        batch = s.make_wave(s.cursor, n)
        s.cursor += n
        self.count += 1
        self.expected = list(batch.ids)
        return batch

    def first(self) -> Batch:
        return self._next(self.sampler.prompts)

    def offer(self, ids: Sequence[int], scores: Sequence[float]) -> Batch | None:
        s, g = self.sampler, self.sampler.group
        if list(ids) != self.expected or len(scores) != len(ids):
            raise RuntimeError(
                f"wave {self.count}: rewards for {len(scores)} samples {list(ids)[:4]}..., expected "
                f"the wave's {len(self.expected)}"
            )
        kept = 0
        for start in range(0, len(ids), g):
            group = list(ids[start : start + g])
            if s.keep([float(x) for x in scores[start : start + g]]):
                self.kept_groups.append(group)
                kept += 1
            else:
                self.dropped_groups.append(group)
        groups = len(ids) // g
        self.generated += groups
        s.estimate = ESTIMATE_DECAY * s.estimate + (1 - ESTIMATE_DECAY) * kept / groups
        missing = s.prompts - len(self.kept_groups)
        if missing <= 0 or self.count >= s.settings.max_waves:
            return None
        return self._next(missing)

    def kept(self) -> list[int]:
        """The ids of the samples that train: kept groups in generation order, filled with dropped ones."""
        n = self.sampler.prompts
        groups = (self.kept_groups + self.dropped_groups)[:n]
        return [i for group in groups for i in group]

    def stats(self) -> dict[str, float]:
        n = self.sampler.prompts
        return {
            "sampling/waves": float(self.count),
            "sampling/prompts": float(self.generated),
            "sampling/kept_fraction": len(self.kept_groups) / max(self.generated, 1),
            "sampling/estimate": self.sampler.estimate,
            "sampling/filled_groups": float(max(n - len(self.kept_groups), 0)),
            "sampling/discarded_groups": float(max(len(self.kept_groups) - n, 0)),
        }
