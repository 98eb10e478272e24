"""The cost estimator: everything the simulator, the search, the bound and the re-planner ask of a cost model.

:class:`CostEstimator` is the one seam between pricing and the code that prices plans. Four methods are required
(a call's seconds and transient bytes, a role's resident bytes, a reallocation's seconds); the rest have
defaults that describe the plainest estimator: offloading costs nothing and is not weighed, devices do not
share cores, an iteration takes what its schedule takes, and a fused stage runs its member calls one after the
other (so an estimator that does not price fusion never makes the search prefer it). :class:`~loomrl.planner.
cost.model.CostModel` implements all of it; :class:`~loomrl.planner.search.evaluate.CachedCost` and
:class:`~loomrl.planner.replanning.replanning.TrustedCost` wrap one and say explicitly what they pass on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from loomrl.plan.allocation import Allocation
from loomrl.plan.plan import AsyncTraining
from loomrl.plan.schedule import Step
from loomrl.planner.cost.stream_fusion import GenerationFloor, Part
from loomrl.workflow import MFC

__all__ = ["CostEstimator"]


class CostEstimator(ABC):
    """Times in seconds, memory in bytes per device, of the steps of a plan's schedule (module docstring)."""

    @abstractmethod
    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        """Seconds one call of ``mfc`` takes on ``alloc``."""

    @abstractmethod
    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        """Transient bytes per device while the call runs (activations, KV cache, buffers)."""

    @abstractmethod
    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        """Resident bytes per device of ``role``'s shard on ``alloc`` (with gradients and optimizer if trainable)."""

    @abstractmethod
    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        """Seconds to move ``role``'s parameters from the layout ``src`` to ``dst``."""

    def partial_rollout_time(self, mfc: MFC, alloc: Allocation, setting: AsyncTraining) -> float:
        """Seconds of one rollout generate call under partial rollouts (``setting``), in the steady state; default:
        as a call that generates its batch whole."""
        return self.mfc_time(mfc, alloc)

    # ------------------------------------------------------------------ offloading, shared cores, the iteration

    def offloads(self) -> bool:
        """Whether moving an offloaded role to and from host memory costs time here, so that the search weighs
        offloading a role against keeping it resident (default: no)."""
        return False

    def reload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        """Seconds to bring ``role``'s shard on ``alloc`` back from host memory (its whole training state when
        ``trainable``); default: nothing."""
        return 0.0

    def offload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        """Seconds to move ``role``'s shard on ``alloc`` to host memory (its training state when ``trainable``; a
        frozen role keeps its host copy); default: nothing."""
        return 0.0

    def copy_keeps_base(self, role: str) -> bool:
        """Whether ``role``'s copies keep their weights between uses, only a small part moving and being freed (a
        LoRA role's base stays, its adapters move); default: no, a copy is freed whole after its last use."""
        return False

    def shared_cores(self) -> float | None:
        """Cores per node that its devices share, so that calls side by side slow each other down; None (the
        default) when every device has its own compute."""
        return None

    def iteration_time(self, simulated_s: float) -> float:
        """A simulated iteration's seconds with whatever whole-iteration correction the estimator fits; default:
        unchanged."""
        return simulated_s

    # ------------------------------------------------------------------------------------------ stream fusion

    def prices_stream_fusion(self) -> bool:
        """Whether :meth:`stream_fusion_time` prices a stream-fusion stage as the runtime runs it (default: no;
        the search then never fuses on this estimator)."""
        return False

    def stream_fusion_time(self, step: Step) -> float:
        """Seconds of a stream-fusion stage; default: its member calls one after the other."""
        return sum(self.mfc_time(member.call_mfc, member.allocation) for member in step.members)

    def stream_fusion_parts(self, step: Step) -> tuple[Part, ...]:
        """What each device runs in a stream-fusion stage, ``(label, device, start, end)`` from the stage's start,
        for the timeline; default: none (the stage is drawn whole)."""
        return ()

    def stream_fusion_floor(self, role: str, alloc: Allocation) -> GenerationFloor | None:
        """What no stream-fusion stage's generation on ``alloc`` beats, for the lower bound; None (the default)
        where the estimator does not price stream fusion."""
        return None

    # ---------------------------------------------------------------------------------------- pipeline fusion

    def prices_pipeline_fusion(self) -> bool:
        """Whether :meth:`pipeline_fusion_time` prices a pipeline-fusion stage as the runtime runs it (default:
        no)."""
        return False

    def pipeline_fusion_time(self, step: Step) -> float:
        """Seconds of a pipeline-fusion stage; default: its two train calls one after the other."""
        return sum(self.mfc_time(member.call_mfc, member.allocation) for member in step.members)

    def pipeline_fusion_floor(self, mfc: MFC, alloc: Allocation) -> float:
        """The least seconds train call ``mfc`` keeps each device of ``alloc`` busy in any pipeline-fusion stage;
        default: the whole call (nothing of it overlaps where fusion is not priced)."""
        return self.mfc_time(mfc, alloc)
