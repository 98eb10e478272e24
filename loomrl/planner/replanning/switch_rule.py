"""When a run in progress should switch plans (dynamic placement, G-Core): the switch rule, as plain data.

Each check (after an iteration) brings :class:`Telemetry`: the predicted seconds per iteration of the plan in
force and of the best other plan, both for the workload the run observes now, and the priced cost of switching
(moving every role's state, refilling shadows). :class:`SwitchPolicy` switches only when all of these hold:

- **gain beats cost**: over the next ``window`` iterations (fewer when the run ends sooner) the candidate saves
  more than the switch costs plus ``margin_s``;
- **relative gain** (hysteresis band): the candidate is at least ``min_gain`` faster per iteration; switching
  back needs the same gain the other way, so two plans within ``min_gain`` of each other never trade places;
- **confirmation** (hysteresis in time): the check above held on ``confirm`` consecutive checks, so one noisy
  measurement does not move the run;
- **dwell**: the plan in force has run at least ``dwell`` iterations.

Every check returns a :class:`Decision` with the figures it compared and the reason, which the trainer logs to
the metrics and ``RUN_DIR/placement.jsonl`` and ``loomrl timeline`` shows per iteration. Nothing here knows
about plans beyond their text; :mod:`loomrl.planner.replanning.replanning` computes the telemetry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CheckBudget", "Decision", "SwitchPolicy", "SwitchRule", "Telemetry"]


@dataclass(frozen=True)
class SwitchRule:
    """The thresholds of the switch rule (``runtime.dynamic``, where they are documented and checked)."""

    window: int
    """Iterations over which a candidate's per-iteration gain is counted against the switch cost."""
    margin_s: float
    """Seconds the gain over the window must exceed the switch cost by."""
    min_gain: float
    """Least relative gain per iteration: 0.1 means the candidate must take at most 90% of the current time."""
    confirm: int
    """Consecutive checks the candidate must win before the run switches."""
    dwell: int
    """Least iterations a plan runs before the run may switch away from it."""


@dataclass(frozen=True)
class Telemetry:
    """What one check compares: predictions for the workload observed so far, and where the run stands."""

    iteration: int
    """The iteration just finished; a switch takes effect at the next one."""
    current_s: float
    """Predicted seconds per iteration of the plan in force."""
    candidate_s: float
    """Predicted seconds per iteration of the best other plan (``current_s`` when there is none)."""
    switch_s: float
    """Priced seconds of switching to it."""
    remaining: int
    """Iterations left in the run after this one."""
    current: str = ""
    """The plan in force (its plan string)."""
    candidate: str = ""
    """The best other plan (its plan string)."""


@dataclass(frozen=True)
class Decision:
    """One check's outcome, with everything it compared (JSON-ready through :meth:`to_dict`)."""

    iteration: int
    switch: bool
    reason: str
    current_s: float
    candidate_s: float
    predicted_gain_s: float
    """Seconds the candidate is predicted to save over the horizon (negative when it is slower)."""
    switch_cost_s: float
    horizon: int
    """Iterations the gain is counted over: the window, or what is left of the run."""
    streak: int
    """Consecutive checks the candidate has won, this one included."""
    plan: str
    """The plan in force from the next iteration on."""
    candidate: str

    def metrics(self) -> dict[str, float]:
        """The decision as numbers for the metrics log."""
        return {
            "placement/current_s": self.current_s,
            "placement/candidate_s": self.candidate_s,
            "placement/predicted_gain_s": self.predicted_gain_s,
            "placement/switch_cost_s": self.switch_cost_s,
            "placement/switched": float(self.switch),
            "placement/streak": float(self.streak),
        }

    def to_dict(self) -> dict:
        return asdict(self)


class SwitchPolicy:
    """Applies a :class:`SwitchRule` check after check; remembers the streak and when the plan last changed."""

    def __init__(self, rule: SwitchRule, start: int = 0):
        self.rule = rule
        self.streak = 0
        self.since = start
        """First iteration of the plan in force."""

    def decide(self, t: Telemetry) -> Decision:
        rule = self.rule
        horizon = min(rule.window, max(t.remaining, 0))
        gain = horizon * (t.current_s - t.candidate_s)
        relative = 1.0 - t.candidate_s / t.current_s if t.current_s > 0 else 0.0
        ran = t.iteration + 1 - self.since
        if not t.candidate or t.candidate_s >= t.current_s:
            wins, reason = False, "no faster plan"
        elif relative < rule.min_gain:
            wins, reason = False, f"gain {relative:.1%} per iteration is under min_gain {rule.min_gain:.0%}"
        elif gain <= t.switch_s + rule.margin_s:
            wins, reason = (
                False,
                (
                    f"gain {gain:.3g} s over {horizon} iterations does not exceed switch "
                    f"{t.switch_s:.3g} s + margin {rule.margin_s:.3g} s"
                ),
            )
        else:
            wins, reason = True, ""
        self.streak = self.streak + 1 if wins else 0
        switch = False
        if wins and self.streak < rule.confirm:
            reason = f"confirming: {self.streak} of {rule.confirm} checks won"
        elif wins and ran < rule.dwell:
            reason = f"dwell: {ran} of {rule.dwell} iterations under this plan"
        elif wins:
            switch, reason = (
                True,
                (
                    f"gain {gain:.3g} s over {horizon} iterations exceeds switch {t.switch_s:.3g} s"
                    f" + margin {rule.margin_s:.3g} s"
                ),
            )
        decision = Decision(
            t.iteration,
            switch,
            reason,
            t.current_s,
            t.candidate_s,
            gain,
            t.switch_s,
            horizon,
            self.streak,
            t.candidate if switch else t.current,
            t.candidate,
        )
        if switch:
            self.streak, self.since = 0, t.iteration + 1
        return decision


class CheckBudget:
    """Keeps the checks that do not search within ``share`` of the run's iteration time: each iteration adds its
    seconds (:meth:`ran`), each such check its own (:meth:`spent`); a check is allowed while they took less than
    ``share`` of the iterations' (share 0: none). Searches are bounded on their own (``runtime.dynamic.search_s``)."""

    def __init__(self, share: float):
        self.share = share
        self.run_s = 0.0
        self.checks_s = 0.0

    def ran(self, iteration_s: float) -> None:
        self.run_s += iteration_s

    def spent(self, seconds: float) -> None:
        self.checks_s += seconds

    def allows(self) -> bool:
        return self.checks_s < self.share * self.run_s
