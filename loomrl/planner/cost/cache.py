"""What a cost model has priced: a device's rates under an allocation, and the cache that keeps every price."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from loomrl.plan.allocation import Allocation
from loomrl.plan.schedule import Step
from loomrl.planner.cost.pipeline_fusion import PipelineFusionPrice
from loomrl.planner.cost.stream_fusion import GenerationFloor, Generations, StreamFusionPrice

__all__ = ["PricingCache", "Rates"]


class Rates(NamedTuple):
    """What one device of an allocation gets: compute and memory rates, and the link of each parallel axis."""

    flops: float
    mem: float
    tp_bw: float
    dp_bw: float
    pp_bw: float
    latency: float
    op: float
    """Seconds to dispatch one operator (slowed like the rates when devices share cores)."""


@dataclass
class PricingCache:
    """What a cost model has priced, kept so that a plan search asks each question once. ``reallocs`` depends only
    on the cluster, profile, shapes and element size, so models that share those may share it (pass it to each);
    the rest belongs to one model's workload and corrections."""

    terms: dict[tuple, dict[str, float]] = field(default_factory=dict)
    """A call's uncorrected terms, by (call, allocation)."""
    reallocs: dict[tuple, float] = field(default_factory=dict)
    """A reallocation's seconds, by (shape, relative placements)."""
    rates: dict[tuple, Rates] = field(default_factory=dict)
    """An allocation's rates, by its devices and layout."""
    stream_fusion: dict[Step, StreamFusionPrice] = field(default_factory=dict)
    floors: dict[tuple[str, Allocation], GenerationFloor] = field(default_factory=dict)
    pipeline_fusion: dict[Step, PipelineFusionPrice] = field(default_factory=dict)
    generations: Generations = field(default_factory=dict)
    """A stream-fusion stage's generation, shared by the stages priced around the same one."""
