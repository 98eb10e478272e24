"""What the commands share: the split of a config file from its overrides, and a metrics summary line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["config_and_overrides", "summary_line"]


def config_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """An optional YAML file first, then overrides; a later word without '=' is reported as a bad override."""
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def summary_line(metrics: Mapping[str, float], keys: Sequence[str]) -> str:
    """``key=value`` of each of ``keys`` the metrics have, on one line."""
    return "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
