"""Correction factors fitted from measured run traces, never set by hand.

The analytic terms are a roofline: what the hardware could do at its datasheet rates. Real kernels reach a
fraction of that, and a Python runtime adds a fixed cost per call (dispatch, Ray messages, tokenisation).
Per MFC kind the cost model therefore predicts

    seconds = scale[kind] · analytic seconds + overhead_s[kind]

with both numbers fitted by least squares (:func:`fit_corrections`) from observations of measured and
predicted seconds. Without observations every scale is 1 and every overhead 0: the prediction is the
roofline, a lower bound of a real run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from loomrl.errors import ConfigError
from loomrl.workflow import MFCKind

__all__ = ["Corrections", "fit_corrections", "fit_line"]

REALLOC = "realloc"
"""Key of the reallocation factor (not an MFC kind)."""

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

    def to_dict(self) -> dict:
        return {"scale": dict(self.scale), "overhead_s": dict(self.overhead_s),
                "observations": dict(self.observations)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Corrections:
        return cls(dict(data.get("scale", {})), dict(data.get("overhead_s", {})), dict(data.get("observations", {})))

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _key(kind: MFCKind | str) -> str:
    return kind.value if isinstance(kind, MFCKind) else str(kind)


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


def fit_corrections(observations: Iterable[Mapping], predict: Callable[[Mapping], float] | None = None,
                    fit_overhead: bool = True) -> Corrections:
    """Fit per-kind corrections from measured run traces.

    Each observation is a dict with at least ``kind`` and ``seconds`` (measured), and either
    ``predicted_s`` (the uncorrected analytic time) or enough for ``predict`` to compute it (see
    :func:`loomrl.planner.traces.trace_predictor`, which reads the trace format of
    :func:`loomrl.planner.traces.observations_from_metrics`).
    """
    by_kind: dict[str, tuple[list[float], list[float]]] = {}
    for obs in observations:
        predicted = obs.get("predicted_s")
        if predicted is None:
            if predict is None:
                raise ConfigError(f"fit_corrections: observation of {obs.get('mfc', '?')} has no predicted_s "
                                  "and no predict function was given")
            predicted = predict(obs)
        ps, ms = by_kind.setdefault(_key(obs["kind"]), ([], []))
        ps.append(float(predicted))
        ms.append(float(obs["seconds"]))
    scale, overhead, counts = {}, {}, {}
    for kind, (ps, ms) in sorted(by_kind.items()):
        s, o = fit_line(ps, ms) if fit_overhead else _origin(ps, ms)
        scale[kind], overhead[kind], counts[kind] = s, o, len(ps)
    return Corrections(scale, overhead, counts)


def _origin(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """Least-squares ``measured ≈ scale · predicted`` (no overhead)."""
    sum_pp = sum(p * p for p in predicted)
    if sum_pp <= 0:
        raise ConfigError("fit_corrections: needs at least one observation with a positive predicted time")
    return sum(p * m for p, m in zip(predicted, measured)) / sum_pp, 0.0
