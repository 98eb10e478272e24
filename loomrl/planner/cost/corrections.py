"""Correction factors fitted from measured run traces, never set by hand.

The analytic terms are a roofline plus operator launches: what the hardware could do at its datasheet (or
measured) rates. Real kernels reach a fraction of that, a Python runtime adds a fixed cost per call (dispatch,
Ray messages, tokenisation), and tensor-parallel operators (DTensor) cost more to dispatch than plain ones.
Per MFC kind the cost model therefore predicts

    seconds = scale[kind] · roofline terms + scale[kind.launch] · launch terms
              + scale[kind.launch_tp] · tensor-parallel launch terms
              + scale[kind.launch_fsdp] · FSDP collective launch terms
              + scale[kind.launch_fsdp_tp] · the same over tensor-parallel shards + overhead_s[kind]

(the term groups are :func:`term_group`), every coefficient ≥ 0 and fitted by least squares on relative
error, with a weak prior of 1 on each scale (:func:`fit_corrections`), from observations of measured seconds
and predicted terms. A group the observations never exercise keeps scale 1. Without observations every scale
is 1 and every overhead 0: the prediction is the analytic lower bound of a real run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loomrl.errors import ConfigError, DataError
from loomrl.workflow import MFCKind

__all__ = ["ITERATION", "REALLOC", "Corrections", "fit_corrections", "fit_line", "term_group"]

REALLOC = "realloc"
"""Key of the reallocation factor (not an MFC kind)."""
ITERATION = "iteration"
"""Key of the whole-iteration correction: the controller's serial work that no call accounts for (building the
batch, dispatching, metrics), applied to the simulated iteration time (not an MFC kind)."""

GROUPS = ("roofline", "launch", "launch_tp", "launch_fsdp", "launch_fsdp_tp")
"""Term groups, each with its own fitted scale (see :func:`term_group`)."""

_MIN_SPREAD = 1.5
"""An overhead is fitted only when the largest predicted time is at least this multiple of the smallest:
with predictions all alike, scale and overhead cannot be told apart."""


@dataclass(frozen=True)
class Corrections:
    """Per-kind multipliers and per-call overheads; kinds absent keep 1 and 0."""

    scale: Mapping[str, float] = field(default_factory=dict)
    """MFC kind (``generate``, ``inference``, ``train``, ``compute``) or ``realloc`` → measured/predicted."""
    overhead_s: Mapping[str, float] = field(default_factory=dict)
    """MFC kind → fixed seconds per call not explained by the analytic terms."""
    observations: Mapping[str, int] = field(default_factory=dict)
    """MFC kind → observations the fit used (for reports)."""

    def apply(self, kind: MFCKind | str, seconds: float) -> float:
        """The corrected time of a call of ``kind`` whose analytic time is ``seconds``."""
        key = _key(kind)
        return self.scale.get(key, 1.0) * seconds + self.overhead_s.get(key, 0.0)

    def apply_terms(self, kind: MFCKind | str, terms: Mapping[str, float]) -> float:
        """The corrected time of a call of ``kind`` from its uncorrected terms (each group scaled apart)."""
        key = _key(kind)
        sums = group_sums(terms)
        return sum(self.scale.get(_scale_key(key, g), 1.0) * sums[g] for g in GROUPS) + self.overhead_s.get(key, 0.0)

    def to_dict(self) -> dict:
        return {"scale": dict(self.scale), "overhead_s": dict(self.overhead_s), "observations": dict(self.observations)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Corrections:
        return cls(dict(data.get("scale", {})), dict(data.get("overhead_s", {})), dict(data.get("observations", {})))

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def load(cls, path) -> Corrections:
        """Corrections saved by ``loomrl calibrate --from`` (``corrections.json``); one-line errors."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise DataError(f"{path}: cannot read corrections ({err})") from None
        except UnicodeDecodeError:
            raise DataError(f"{path}: cannot read corrections (not UTF-8 text)") from None
        except RecursionError:  # the decoder recurses once per level of nesting
            raise DataError(f"{path}: cannot read corrections (JSON nested too deeply)") from None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("scale", {}), dict)
            or not isinstance(data.get("overhead_s", {}), dict)
        ):
            raise DataError(
                f"{path}: corrections are a JSON object with 'scale' and 'overhead_s' maps "
                "(as `loomrl calibrate --from` writes)"
            )
        for part in ("scale", "overhead_s"):
            for key, value in data.get(part, {}).items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise DataError(f"{path}: {part}.{key} is {value!r}; expected a number >= 0")
        return cls.from_dict(data)


def _key(kind: MFCKind | str) -> str:
    return kind.value if isinstance(kind, MFCKind) else str(kind)


def _scale_key(kind: str, group: str) -> str:
    return kind if group == "roofline" else f"{kind}.{group}"


def term_group(name: str) -> str:
    """The group of a cost term by its name: ``*launch_tp`` (tensor-parallel operator launches),
    ``*launch_fsdp`` (FSDP's per-unit gathers and reduce-scatters: its hooks' Python work, fitted apart like
    DTensor's), ``*launch_fsdp_tp`` (the same over tensor-parallel shards: FSDP2 then handles 2-D DTensors,
    more work per parameter), ``*launch`` (plain operator launches) or ``roofline`` (compute, memory traffic
    and communication)."""
    if name.endswith("launch_fsdp_tp"):
        return "launch_fsdp_tp"
    if name.endswith("launch_tp"):
        return "launch_tp"
    if name.endswith("launch_fsdp"):
        return "launch_fsdp"
    if name.endswith("launch"):
        return "launch"
    return "roofline"


def group_sums(terms: Mapping[str, float]) -> dict[str, float]:
    """Seconds per term group of a call's terms."""
    sums = dict.fromkeys(GROUPS, 0.0)
    for name, seconds in terms.items():
        sums[term_group(name)] += seconds
    return sums


PRIOR_WEIGHT = 1e-8
"""Weight of the prior that each group's scale is 1 (the analytic value), against the squared relative errors
of the observations: a group the observations cannot tell apart from the others (e.g. launches that are the
same in every observed call, so indistinguishable from the per-call overhead) keeps about 1 instead of taking
an arbitrary share; a group they do determine is hardly moved."""


def _nnls_relative(rows: list[list[float]], measured: list[float], prior: list[bool]) -> list[float]:
    """Coefficients ``c ≥ 0`` minimising ``Σ ((rows·c − m) / m)² + PRIOR_WEIGHT · Σ_{prior} (c − 1)²``: the
    best unconstrained least-squares fit over every subset of the columns whose coefficients all come out
    ≥ 0 (left-out columns are 0). Few columns, so the subsets can be enumerated exactly; a dedicated NNLS
    solver would need scipy for four numbers."""
    import itertools

    import numpy as np

    n = len(rows[0])
    a = np.asarray(rows, dtype=float) / np.asarray(measured, dtype=float)[:, None]
    target = np.ones(len(measured))
    weight = math.sqrt(PRIOR_WEIGHT)
    a = np.vstack([a, *(weight * np.eye(n)[[c]] for c in range(n) if prior[c])])
    target = np.concatenate([target, [weight] * sum(prior)])
    best, best_err = [0.0] * n, float(target @ target)  # all coefficients 0
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub) < k:
                continue
            coef, *_ = np.linalg.lstsq(sub, target, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((sub @ coef - target) ** 2).sum())
            if err < best_err - 1e-15:
                full = [0.0] * n
                for c, v in zip(cols, coef):
                    full[c] = float(v)
                best, best_err = full, err
    return best


def fit_line(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """Least-squares ``measured ≈ scale · predicted + overhead`` with ``overhead ≥ 0``.

    Fits through the origin (overhead 0, ``scale = Σmp / Σp²``) when the predictions do not spread enough to
    separate the two, or when the free fit would need a negative overhead.
    """
    n = len(predicted)
    through_origin = _origin(predicted, measured)
    lo, hi = min(predicted), max(predicted)
    if n < 3 or lo <= 0 or hi < _MIN_SPREAD * lo:
        return through_origin
    mean_p, mean_m = sum(predicted) / n, sum(measured) / n
    var_p = sum((p - mean_p) ** 2 for p in predicted)
    scale = sum((p - mean_p) * (m - mean_m) for p, m in zip(predicted, measured)) / var_p
    overhead = mean_m - scale * mean_p
    if scale <= 0 or overhead < 0:
        return through_origin
    return scale, overhead


def fit_corrections(
    observations: Iterable[Mapping],
    predict: Callable[[Mapping], Mapping[str, float]] | None = None,
    fit_overhead: bool = True,
) -> Corrections:
    """Fit per-kind corrections from measured run traces.

    Each observation is a dict with at least ``kind`` and ``seconds`` (measured), and either
    ``predicted_terms`` (the uncorrected terms of the call, by name), ``predicted_s`` (one uncorrected total,
    treated as roofline) or enough for ``predict`` to compute the terms (see
    :func:`loomrl.planner.calibration.traces.trace_predictor`, which reads the trace format of
    :func:`loomrl.planner.calibration.traces.observations_from_metrics`). A kind whose observations exercise only the
    roofline group falls back to :func:`fit_line` (scale and overhead).
    """
    by_kind: dict[str, tuple[list[dict[str, float]], list[float]]] = {}
    for obs in observations:
        terms = obs.get("predicted_terms")
        if terms is None and obs.get("predicted_s") is not None:
            terms = {"roofline": float(obs["predicted_s"])}
        if terms is None:
            if predict is None:
                raise ConfigError(
                    f"fit_corrections: observation of {obs.get('mfc', '?')} has no predicted terms "
                    "and no predict function was given"
                )
            terms = predict(obs)
        groups, ms = by_kind.setdefault(_key(obs["kind"]), ([], []))
        groups.append(group_sums(terms))
        ms.append(float(obs["seconds"]))
    scale, overhead, counts = {}, {}, {}
    for kind, (groups, ms) in sorted(by_kind.items()):
        counts[kind] = len(ms)
        used = [g for g in GROUPS if any(row[g] > 0 for row in groups)]
        if used == ["roofline"] or not used:
            ps = [row["roofline"] for row in groups]
            s, o = fit_line(ps, ms) if fit_overhead else _origin(ps, ms)
            scale[kind], overhead[kind] = s, o
            continue
        rows = [[row[g] for g in used] + ([1.0] if fit_overhead else []) for row in groups]
        coef = _nnls_relative(rows, ms, [True] * len(used) + ([False] if fit_overhead else []))
        for g, c in zip(used, coef):
            scale[_scale_key(kind, g)] = c
        overhead[kind] = coef[-1] if fit_overhead else 0.0
    return Corrections(scale, overhead, counts)


def _origin(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """Least-squares ``measured ≈ scale · predicted`` (no overhead)."""
    sum_pp = sum(p * p for p in predicted)
    if sum_pp <= 0:
        raise ConfigError("fit_corrections: needs at least one observation with a positive predicted time")
    return sum(p * m for p, m in zip(predicted, measured)) / sum_pp, 0.0
