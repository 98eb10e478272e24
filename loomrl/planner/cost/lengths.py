"""Response-length distributions as ``loomrl plan --response-len`` reads them.

Generation time is decided by the tail of the response lengths (a few long samples hold every generation device
while most of the batch is done), so the planner takes a distribution, in one of three forms:

- ``400``: the mean alone (every response that long, unless a limit is given too);
- ``lognormal:mean=400,sigma=1.0,max=4096``: a log-normal of log-scale σ cut at the limit, with that mean
  (:func:`~loomrl.planner.cost.workload.lengths_from_mean_max`);
- a JSONL file of observed lengths: one line per sample, an integer or an object with ``length`` (or
  ``response_length``) or a list ``lengths``; or a run's ``metrics.jsonl`` (or its directory), whose per-iteration
  statistics ``response/length``, ``response/length_p90`` and ``response/length_max`` are turned back into lengths
  (:func:`~loomrl.planner.calibration.traces.lengths_from_summary`), pooled over its iterations.

:func:`length_fields` returns the :class:`~loomrl.planner.describe.RunDescription` fields a form sets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from loomrl.errors import ConfigError
from loomrl.planner.cost.workload import lengths_from_summary

__all__ = ["length_fields", "observed_lengths"]

_LOGNORMAL_KEYS = {"mean": "response_len", "sigma": "response_spread", "max": "response_max"}


def length_fields(text: str) -> dict[str, object]:
    """The run-description fields ``text`` gives (module docstring); a one-line error for anything else."""
    text = str(text).strip()
    try:
        return {"response_len": float(text)}
    except ValueError:
        pass
    if text.startswith("lognormal:"):
        return _lognormal(text)
    path = Path(text)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if path.is_file():
        return {"observed_lengths": list(observed_lengths(path))}
    raise ConfigError(
        f"--response-len: {text!r} is neither a mean (e.g. 400), lognormal:mean=M,sigma=S,max=N, nor "
        "a JSONL file of observed lengths (or a run directory)"
    )


def _lognormal(text: str) -> dict[str, object]:
    fields: dict[str, object] = {}
    for part in text.partition(":")[2].split(","):
        key, sep, value = (p.strip() for p in part.partition("="))
        if not sep or key not in _LOGNORMAL_KEYS:
            raise ConfigError(
                f"--response-len: {part.strip()!r} is not one of mean=M, sigma=S, max=N "
                "(e.g. lognormal:mean=400,sigma=1.0,max=4096)"
            )
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"--response-len: {key}={value!r} is not a number") from None
        fields[_LOGNORMAL_KEYS[key]] = int(number) if key == "max" and number.is_integer() else number
    missing = [key for key, name in _LOGNORMAL_KEYS.items() if name not in fields]
    if missing:
        raise ConfigError(f"--response-len: lognormal needs mean, sigma and max; {', '.join(missing)} missing")
    return fields


def observed_lengths(path: Path) -> tuple[int, ...]:
    """Every sample's length in the JSONL file ``path`` (module docstring), in file order."""
    out: list[int] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; response lengths are a JSONL file") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not JSON ({e.msg})") from None
        except RecursionError:  # the decoder recurses once per level of nesting
            raise ConfigError(f"{path}:{number}: not JSON (nested too deeply)") from None
        if isinstance(record, dict) and "response/length" in record:
            if "response/length_p90" in record and "response/length_max" in record:
                out += lengths_from_summary(
                    record["response/length"], record["response/length_p90"], record["response/length_max"]
                )
            continue
        values = (
            record.get("lengths", record.get("length", record.get("response_length")))
            if isinstance(record, dict)
            else record
        )
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ConfigError(
                    f"{path}:{number}: {value!r} is not a response length (a number >= 1); a line "
                    "is an integer or an object with length, response_length or lengths"
                )
            out.append(round(value))
    if not out:
        raise ConfigError(
            f"{path}: no response lengths (lines of integers, objects with length or lengths, or a "
            "run's metrics with response/length, response/length_p90 and response/length_max)"
        )
    return tuple(out)
