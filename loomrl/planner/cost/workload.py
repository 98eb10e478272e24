"""What the cost model prices besides the models (:class:`~loomrl.plan.model_shape.ModelShape`): one iteration's
data, a :class:`Workload`: samples per iteration, prompt length, and a *sample* of the response-length
distribution (not one length: decode cost under continuous batching depends on the whole distribution, the tail
most of all).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist

from loomrl.errors import ConfigError

__all__ = ["DEFAULT_SPREAD", "Workload", "lengths_from_mean_max", "lengths_from_summary"]

DEFAULT_SPREAD = 0.75
"""σ of the log-normal response lengths when only their mean and maximum are known: the 99th percentile about
5.7 times the median before truncation. A stated assumption of the shape, not a measured one: publications
give the mean and the limit, rarely the distribution."""


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name}: {value!r} is not a positive integer")


@dataclass(frozen=True)
class EpisodeShape:
    """What an iteration's episodes are like, on average (given, or measured from a run's ``episode/`` metrics).

    ``Workload.response_lengths`` are an episode's sampled tokens (what it decodes, and what its losses count: a
    run's ``response/length``); its ``observed_tokens`` come on top. Every turn is followed by an environment step
    of ``env_step_s``; each turn after the first prefills its observation (and the last turn's final sampled
    token) over the kept cache. Inference and training passes are priced over prompt and sampled tokens: the observation
    tokens they also read are left out (a pass's share of them is ``observed_tokens`` over the response)."""

    turns: float = 1.0
    """Assistant turns per episode."""
    observed_tokens: float = 0.0
    """Observation tokens per episode."""
    env_step_s: float = 0.0
    """Seconds an environment step takes."""

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> EpisodeShape | None:
        """A run's episodes as one iteration measured them (``episode/turns``, ``episode/observed_tokens`` and
        ``episode/env_s``, the seconds of an episode's steps); None for an iteration without episodes."""
        if "episode/turns" not in metrics:
            return None
        turns = max(1.0, float(metrics["episode/turns"]))
        return cls(turns, float(metrics.get("episode/observed_tokens", 0.0)), metrics.get("episode/env_s", 0.0) / turns)

    def __post_init__(self) -> None:
        for name, low in (("turns", 1.0), ("observed_tokens", 0.0), ("env_step_s", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)) or value < low:
                raise ConfigError(f"workload.episodes.{name}: {value!r} is not a number >= {low:g}")


@dataclass(frozen=True)
class Workload:
    """One iteration's data: how many samples, how long their prompts and responses are."""

    batch: int
    """Samples per iteration (prompts × samples per prompt)."""
    prompt_len: float
    """Mean prompt length in tokens."""
    response_lengths: tuple[int, ...]
    """A sample of the response-length distribution in tokens (e.g. last iteration's lengths); scaled to
    ``batch``, it says how many samples are still decoding at each step."""
    ppo_epochs: int = 1
    """Passes over the batch of a train call, unless the MFC sets its own ``epochs``."""
    minibatches: int = 1
    """Optimizer steps per pass of a train call, unless the MFC sets its own ``minibatches``."""
    decode_slots: int | None = None
    """Samples one generation replica decodes at once (the rollout engine's slots); None: all of its share."""
    rollout_scale: float = 1.0
    """Samples generated and scored per sample trained: above 1 under dynamic sampling, whose waves generate and
    score more prompts than the batch keeps (a run's ``sampling/prompts`` over ``rollout.prompts_per_iter``). The
    generate calls and the call that makes the rewards are priced that many times over (waves run one after
    another, each about a batch or less: linear in the waves, which slightly overprices a memory-bound decode
    whose steps cost little more for more samples)."""
    samples_per_prompt: int = 1
    """Samples sharing each prompt (a GRPO/RLOO group): a runtime that computes a shared prompt once in its
    training and scoring passes (:attr:`~loomrl.planner.cost.system.SystemSettings.shared_prompts`) processes
    ``prompt_len / samples_per_prompt`` prompt tokens per sample there."""
    episodes: EpisodeShape | None = None
    """Multi-turn rollouts (a ``multi_turn`` generate call): turns, observation tokens and environment latency
    per episode; None: one response per prompt."""

    def __post_init__(self) -> None:
        _positive_int("workload", "batch", self.batch)
        _positive_int("workload", "ppo_epochs", self.ppo_epochs)
        _positive_int("workload", "minibatches", self.minibatches)
        _positive_int("workload", "samples_per_prompt", self.samples_per_prompt)
        if self.decode_slots is not None:
            _positive_int("workload", "decode_slots", self.decode_slots)
        scale = self.rollout_scale
        if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 1):
            raise ConfigError(
                f"workload.rollout_scale: {scale!r} is not a number >= 1 (samples generated per sample trained)"
            )
        prompt = self.prompt_len
        if isinstance(prompt, bool) or not (isinstance(prompt, (int, float)) and prompt >= 0 and math.isfinite(prompt)):
            raise ConfigError(f"workload.prompt_len: {self.prompt_len!r} is not a non-negative number")
        lengths = tuple(self.response_lengths)
        if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise ConfigError(
                f"workload.response_lengths: {self.response_lengths!r} is not a non-empty list of positive integers"
            )
        object.__setattr__(self, "response_lengths", lengths)

    @property
    def mean_response(self) -> float:
        return sum(self.response_lengths) / len(self.response_lengths)

    @property
    def max_response(self) -> int:
        return max(self.response_lengths)

    @property
    def mean_seq(self) -> float:
        """Mean tokens of a whole sample (prompt + response), what train and inference calls process."""
        return self.prompt_len + self.mean_response

    @property
    def mean_sq_seq(self) -> float:
        """Mean of the squared sample length; causal attention's FLOPs grow with it."""
        return sum((self.prompt_len + n) ** 2 for n in self.response_lengths) / len(self.response_lengths)


def lengths_from_mean_max(mean: float, longest: int, spread: float = DEFAULT_SPREAD, n: int = 200) -> tuple[int, ...]:
    """``n`` response lengths (the quantiles ``(i + ½)/n``) of a log-normal of log-scale ``spread``, cut at
    ``longest`` (a sample that reaches the limit stops there, as a generation limit does), whose mean is
    ``mean``: the location is found by bisection, since the cut mean grows with it. A mean at or above the
    limit gives every sample the limit."""
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        raise ConfigError(f"workload.response_max: {longest!r} is not a positive integer")
    if not (isinstance(mean, (int, float)) and 1 <= mean and math.isfinite(mean)):
        raise ConfigError(f"workload.response_mean: {mean!r} is not a number of at least 1")
    if not (isinstance(spread, (int, float)) and spread > 0 and math.isfinite(spread)):
        raise ConfigError(f"workload.response_spread: {spread!r} is not a positive number")
    if mean >= longest:
        return (longest,) * n
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]

    def sample(mu: float) -> list[int]:
        return [min(longest, max(1, round(math.exp(mu + spread * q)))) for q in z]

    low, high = -10.0, math.log(longest) + 6 * spread
    for _ in range(100):
        mid = (low + high) / 2
        if sum(sample(mid)) / n < mean:
            low = mid
        else:
            high = mid
    return tuple(sample(high))


def lengths_from_summary(mean: float, p90: float, longest: float, n: int = 100) -> tuple[int, ...]:
    """``n`` response lengths with (about) the given mean, 90th percentile and maximum.

    The top tenth spreads evenly from p90 to the maximum; the rest spreads evenly around whatever mean
    makes the whole sample's mean right, kept within [1, p90].
    """
    top_n = max(1, n // 10)
    longest, p90 = max(1.0, float(longest)), max(1.0, min(float(p90), float(longest)))
    top = [p90 + (longest - p90) * (i + 1) / top_n for i in range(top_n)]
    rest_n = n - top_n
    rest_mean = min(max((n * mean - sum(top)) / rest_n, 1.0), p90) if rest_n else 0.0
    high = min(p90, 2 * rest_mean - 1)
    low = 2 * rest_mean - high
    rest = [low + (high - low) * (i + 0.5) / rest_n for i in range(rest_n)]
    return tuple(max(1, round(x)) for x in rest + top)
