"""The cost model: seconds and bytes per device of each MFC under an allocation, and of reallocations.

How a call is priced (``b`` bytes per weight, P parameters, one data-parallel replica's share of the batch;
every replica runs in parallel on equal shares, so a call takes as long as one replica):

- **A pipelined pass** (:meth:`CostModel._pass`): the share is cut into ``mb`` micro-batches flowing through
  ``pp`` stages of ``tp`` devices. A stage's slot for one micro-batch costs
  ``max(FLOPs/(tp·pp·mb·rate), weight bytes/(tp·pp)/mem_bw)`` plus its tensor-parallel all-reduces (two per
  layer of the micro-batch's activations forward, two more backward) plus one point-to-point hop of those
  activations to the next stage (two when training: forward and backward). A pass takes
  ``mb + pp − 1`` slots: ``mb`` of work, ``pp − 1`` of bubble.
- **Train** (forward + backward = 3× forward FLOPs, weights read twice and gradients written once per
  micro-batch; with activation recomputation one more forward: 4×, and its all-reduces) once per optimizer
  step, ``epochs × minibatches`` steps, each followed by the gradient all-reduce over dp (the runtime sums
  gradients after the backward, it does not overlap them) and the Adam step's memory traffic; under ZeRO-1
  (``zero``) the step covers 1/dp of the weights and an all-gather of the weights over dp follows. Under FSDP
  (``fsdp``) every micro-batch all-gathers the weights twice (forward, backward) and reduce-scatters fp32
  gradients instead, overlapped with the pass's work where the devices run communication beside compute
  (``async_launch``: GPU streams; FSDP prefetches the next layer) but for the first layer's gather, and
  dispatches a few operators per unit and collective (their own term group: FSDP's hooks run in Python);
  the Adam step covers 1/dp of the fp32 weights.
- **Inference**: one forward pass over every token of the share.
- **Generate**: a prefill pass over the prompts, then decode steps priced from the response-length
  *distribution*: at step t, the live samples (those with length > t, scaled to the share) each produce one
  token, and a step costs ``max(compute, weight + KV-cache reads)`` plus its all-reduces
  (:mod:`loomrl.planner.cost.decode`). The rollout engine decodes all live samples together, so generation
  ignores ``micro_batches`` unless ``pp > 1``. A multi-turn call (``multi_turn``, the workload's ``episodes``)
  decodes the sampled tokens, prefills each later turn's observation over the kept cache (``continue_*``) and
  waits on its environments after every turn (:meth:`CostModel.env_wait`, beside the corrected terms); the keys
  and values its episodes keep between turns add to its memory.
- **Compute** (advantages): a few float columns per token read and written on one device.
- **Operator launches** (every kind): each slot of a pass also dispatches its stage's operators
  (:func:`loomrl.planner.cost.terms.forward_ops`, 3× when training, plus the optimizer's per-tensor operators), and
  each decode step its forward's and the sampler's, at the profile's ``op_overhead`` each. This is what bounds
  small models and decode: a kernel launch on a GPU, an eager dispatch on a CPU. On a GPU launches are queued
  ahead of the device (``async_launch``), so only launch time beyond the work adds; on a CPU all of it does.
  Tensor-parallel launches are named ``*_tp`` so corrections fit them apart (DTensor dispatch costs more per
  operator).

Every term is uncorrected; :class:`~loomrl.planner.cost.corrections.Corrections` fitted from run traces scale
them per MFC kind and term group (roofline, launches, tensor-parallel launches). :meth:`CostModel.time_terms` returns
the named terms of a call, for reports.

Memory per device (resident state and each call's transient peak) is priced by the
:class:`~loomrl.planner.cost.memory.MemoryPricing` half of the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping

from loomrl.errors import ConfigError
from loomrl.plan import Allocation, ClusterSpec
from loomrl.plan.hardware import HardwareProfile
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.plan import AsyncTraining
from loomrl.plan.schedule import Step
from loomrl.planner.cost import decode as D
from loomrl.planner.cost import terms as T
from loomrl.planner.cost.cache import PricingCache, Rates
from loomrl.planner.cost.corrections import ITERATION, REALLOC, Corrections
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.memory import (
    COMPUTE_BYTES_PER_TOKEN,
    GRAD_REDUCE_BYTES,
    PREFILL_CHUNK_TOKENS,
    MemoryPricing,
)
from loomrl.planner.cost.pipeline_fusion import pipeline_fusion_floor, price_pipeline_fusion
from loomrl.planner.cost.rates import allocation_rates
from loomrl.planner.cost.realloc import realloc_seconds
from loomrl.planner.cost.stream_fusion import (
    GenerationFloor,
    Part,
    StreamFusionPrice,
    generation_floor,
    price_stream_fusion,
)
from loomrl.planner.cost.system import SystemSettings, default_max_seqs
from loomrl.planner.cost.workload import EpisodeShape, Workload
from loomrl.workflow import MFC, MFCKind

__all__ = ["CostModel"]

MOE_REFERENCE_EXPERT = 4096 * 1536
"""The expert size (hidden × width) the profiles' ``moe_efficiency`` is measured at (Qwen3-235B-A22B's)."""
PRECISION_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per weight of each explicit ``runtime.precision``; its ``auto`` (bf16 on accelerators, fp32 on CPU) is
the cost model's default (``bytes_per_param=None``)."""


class CostModel(MemoryPricing, CostEstimator):
    """Prices MFCs, reallocations and memory for one cluster, hardware profile, set of models and workload.

    ``shapes`` maps each role to its model, or to None for a role with no model (a rule reward: its calls
    score on the host, priced like a compute step); ``bytes_per_param`` is the weights' (and activations')
    element size, by default 2 (bf16) on accelerators and 4 (fp32) on ``local``, as the runtime's ``precision:
    auto``; ``settings`` say how the system runs the calls (:class:`~loomrl.planner.cost.system.SystemSettings`:
    by default loomrl's runtime). What it prices is kept in ``cache`` (:class:`PricingCache`); the model is
    immutable once built. ``realloc_cache`` shares priced reallocations between models of the same cluster,
    profile, shapes and ``bytes_per_param`` (they depend on nothing else: a run re-planned after each iteration
    builds one model per workload and corrections, and planning a transfer is what pricing a plan spends most on).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        profile: HardwareProfile,
        shapes: Mapping[str, ModelShape | None],
        workload: Workload,
        corrections: Corrections | None = None,
        *,
        bytes_per_param: int | None = None,
        settings: SystemSettings | None = None,
        realloc_cache: dict[tuple, float] | None = None,
    ):
        self.cluster, self.profile, self.workload = cluster, profile, workload
        self.shapes = dict(shapes)
        self.settings = settings or SystemSettings()
        self.corrections = corrections or Corrections()
        self.bytes_per_param = bytes_per_param or (4 if profile.name == "local" else 2)
        self.cache = PricingCache() if realloc_cache is None else PricingCache(reallocs=realloc_cache)

    # ------------------------------------------------------------------------------------------ public API

    @property
    def system_factor(self) -> float:
        """The profile's stated ``system_factor``, which scales every time the model gives."""
        return self.profile.system_factor

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        """Seconds of one call of ``mfc`` on ``alloc``, corrected (and scaled by the profile's stated
        ``system_factor``, like every time the model gives)."""
        hardware = self.corrections.apply_terms(mfc.kind, self.time_terms(mfc, alloc)) * self.system_factor
        return hardware + self.env_wait(mfc)

    def partial_rollout_time(self, mfc: MFC, alloc: Allocation, setting: AsyncTraining) -> float:
        """Seconds of a rollout generate call under loomrl's partial rollouts: the pieces of every sample one
        iteration decodes (:func:`~loomrl.planner.cost.decode.partial_pieces`) as one call, each continued
        piece prefilled over its prompt like a new one."""
        w = self.workload
        pieces = D.partial_pieces(w.response_lengths, setting.max_staleness, setting.segment_tokens)
        batch = max(1, round(w.batch * len(pieces) / max(1, len(w.response_lengths))))
        cut = dataclasses.replace(w, batch=batch, response_lengths=pieces)
        model = CostModel(
            self.cluster,
            self.profile,
            self.shapes,
            cut,
            self.corrections,
            bytes_per_param=self.bytes_per_param,
            settings=self.settings,
        )
        return model.mfc_time(mfc, alloc)

    def shared_cores(self) -> float | None:
        """Cores per node that its devices share (the simulator then slows calls running side by side), or
        None when every device has its own compute (accelerators, or CPU devices no more than cores)."""
        share = self.profile.devices_share_cores
        return self.cluster.devices_per_node / share if share > 1 else None

    def offloads(self) -> bool:
        """Whether the runtime offloads the plan's offloaded roles on these devices (accelerators: yes; CPU
        devices keep them resident, so the simulator does too)."""
        return self.profile.host_offload

    def reload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        """Seconds to bring an offloaded role back from pinned host memory before a call on ``alloc``: each
        device's shard over its host link (a trained role's whole training state when ``trainable``; 0 where
        the runtime does not offload)."""
        if not self.profile.host_offload:
            return 0.0
        seconds = self.static_memory(role, alloc, trainable) / self.profile.host_bw + self.profile.link_latency
        return seconds * self.system_factor

    def offload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        """Seconds to move an offloaded role to host memory: nothing for a frozen role (its host copy is kept and
        never changes), a trained role's training state copied out when ``trainable``."""
        return self.reload_time(role, alloc, True) if trainable else 0.0

    def prices_stream_fusion(self) -> bool:
        return True

    def stream_fusion_stage(self, step: Step) -> StreamFusionPrice:
        """A stream-fusion stage's predicted time and parts (:mod:`loomrl.planner.cost.stream_fusion`). Cached."""
        if step not in self.cache.stream_fusion:
            self.cache.stream_fusion[step] = price_stream_fusion(self, step, generations=self.cache.generations)
        return self.cache.stream_fusion[step]

    def stream_fusion_floor(self, role: str, alloc: Allocation) -> GenerationFloor:
        """What no stream-fusion stage's generation on ``alloc`` beats
        (:func:`loomrl.planner.cost.stream_fusion.generation_floor`)."""
        key = (role, alloc)
        if key not in self.cache.floors:
            self.cache.floors[key] = generation_floor(self, role, alloc)
        return self.cache.floors[key]

    def stream_fusion_time(self, step: Step) -> float:
        """Seconds of a stream-fusion stage (the simulator's price of its schedule step)."""
        return self.stream_fusion_stage(step).seconds

    def stream_fusion_parts(self, step: Step) -> tuple[Part, ...]:
        return self.stream_fusion_stage(step).parts

    def prices_pipeline_fusion(self) -> bool:
        return True

    def pipeline_fusion_time(self, step: Step) -> float:
        """Seconds of a pipeline-fusion stage: two train calls as one fused pipeline
        (:func:`loomrl.planner.cost.pipeline_fusion.price_pipeline_fusion`). Cached."""
        if step not in self.cache.pipeline_fusion:
            self.cache.pipeline_fusion[step] = price_pipeline_fusion(self, step)
        return self.cache.pipeline_fusion[step].seconds

    def pipeline_fusion_floor(self, mfc: MFC, alloc: Allocation) -> float:
        return pipeline_fusion_floor(self, mfc, alloc)

    def train_steps(self, mfc: MFC) -> int:
        """Optimizer steps of one call of train MFC ``mfc``: ``epochs × minibatches``."""
        epochs, minibatches = self._steps(mfc)
        return epochs * minibatches

    def iteration_time(self, simulated_s: float) -> float:
        """A simulated iteration's seconds with the fitted whole-iteration correction (the controller's serial
        work around the calls); unchanged without one."""
        return self.corrections.apply(ITERATION, simulated_s)

    def time_terms(self, mfc: MFC, alloc: Allocation) -> dict[str, float]:
        """The uncorrected terms of a call's time, by name (they sum to the analytic time); none for a role the
        model has no shape of (a rule-based reward: its calls cost their fitted per-call overhead alone)."""
        if mfc.role is not None and mfc.role not in self.shapes:
            return {}
        key = (mfc.name, mfc.kind, mfc.role, mfc.epochs, mfc.minibatches, mfc.multi_turn, _alloc_key(alloc))
        if key not in self.cache.terms:
            terms = self._compute_terms(mfc, alloc)
            if self.workload.rollout_scale != 1 and mfc.per_wave:
                terms = {name: seconds * self.workload.rollout_scale for name, seconds in terms.items()}
            self.cache.terms[key] = terms
        return dict(self.cache.terms[key])

    def copy_keeps_base(self, role: str) -> bool:
        """A LoRA role's copies keep the frozen base (placed once); only its adapters move and are freed."""
        shape = self.shapes.get(role)
        return shape is not None and shape.lora_rank > 0

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        """Seconds to move ``role``'s weights from ``src`` to ``dst``, priced from the real transfer plan of a
        reduced copy of the model (exact received bytes when tp divides the split dimensions; see
        :mod:`loomrl.planner.cost.realloc`). 0 for the same placement. Cached."""
        if self._is_rule(role):
            return 0.0
        key = (self._shape(role), *self._relative_placements(src, dst))  # roles of one shape share plans
        if key not in self.cache.reallocs:
            self.cache.reallocs[key] = realloc_seconds(
                self._shape(role), src, dst, self.cluster, self.profile, self.bytes_per_param
            )
        seconds = self.cache.reallocs[key]
        if seconds <= 0:
            return 0.0
        per_tensor = self.settings.sync_tensor_s * self._shape(role).tensor_count  # the framework's, per tensor
        return (self.corrections.apply(REALLOC, seconds) + per_tensor) * self.system_factor

    def _relative_placements(self, src: Allocation, dst: Allocation) -> tuple[tuple, ...]:
        """The two placements with their devices relabelled, keeping every relation the transfer planner and the
        pricing look at, so that such pairs share one priced plan: the nodes the pair uses are numbered 0, 1, ...
        in their order (each device keeping its place within its node), and a pair within one node is shifted
        to start on device 0. Both keep the order of devices (the planner breaks ties by it) and which devices
        share a node (which link a byte takes), so the plans are the same up to the labels."""
        devices = (*src.mesh.devices, *dst.mesh.devices)
        per_node = self.cluster.devices_per_node
        node_of = self.cluster.node_of
        nodes = sorted({node_of(d) for d in devices})
        if len(nodes) == 1:
            low = min(devices)
            return tuple((tuple(d - low for d in a.mesh.devices), _alloc_key(a)[1], a.fsdp) for a in (src, dst))
        number = {node: i for i, node in enumerate(nodes)}
        return tuple(
            (
                tuple(number[node_of(d)] * per_node + d - node_of(d) * per_node for d in a.mesh.devices),
                _alloc_key(a)[1],
                a.fsdp,
            )
            for a in (src, dst)
        )

    def decode_time(
        self, role: str, alloc: Allocation, response_lengths: tuple[int, ...] | None = None, *, padded: bool = False
    ) -> float:
        """Uncorrected seconds of the decode phase alone; ``padded=True`` prices static batching (every row
        decodes until the longest response ends) instead of continuous batching, for comparison."""
        lengths = tuple(response_lengths or self.workload.response_lengths)
        return sum(self._decode_terms(role, alloc, lengths, padded).values())

    # ------------------------------------------------------------------------------------- per-kind terms

    def _compute_terms(self, mfc: MFC, alloc: Allocation) -> dict[str, float]:
        if mfc.kind is MFCKind.COMPUTE or self._is_rule(mfc.role):
            nbytes = self.workload.batch * self.workload.mean_seq * COMPUTE_BYTES_PER_TOKEN
            return {"compute": nbytes / self._rates_of(alloc).mem}
        if mfc.kind is MFCKind.GENERATE:
            return self._generate_terms(mfc.model_role, alloc, mfc)
        if mfc.kind is MFCKind.INFERENCE:
            return self.inference_terms(mfc.model_role, alloc)
        return self._train_terms(mfc, alloc)

    def inference_terms(
        self, role: str, alloc: Allocation, samples: float | None = None, lengths: tuple[int, ...] | None = None
    ) -> dict[str, float]:
        """One forward pass over every token of a replica's share (or of ``samples`` samples, whose response
        lengths are ``lengths`` where known: a fused stage's chunk; else the workload's distribution)."""
        shape, w = self._shape(role), self.workload
        samples = D.share(w.batch, alloc.layout.dp) if samples is None else samples
        prompt = self._pass_prompt(alloc)
        seq, sq = self._pass_lengths(samples, alloc, lengths=lengths, prompt=prompt)
        flops = T.forward_flops(shape, samples * seq, samples * sq) - self._skipped_head(shape, samples * prompt)
        return self._pass(
            alloc,
            shape,
            flops,
            self._weight_bytes(role),
            samples * seq,
            allreduces_per_layer=2,
            hops=1,
            micro_batches=alloc.micro_batches,
            flops_scale=self._flops_scale(shape, MFCKind.INFERENCE),
        )

    def _train_terms(self, mfc: MFC, alloc: Allocation) -> dict[str, float]:
        """Per optimizer step: a forward+backward pass over the step's share, the dp gradient all-reduce and
        the Adam step; times ``epochs × minibatches`` steps."""
        shape, w, lay = self._shape(mfc.role), self.workload, alloc.layout
        epochs, minibatches = self._steps(mfc)
        samples = w.batch / minibatches / lay.dp
        prompt = self._pass_prompt(alloc, training=True)
        seq, sq = self._pass_lengths(samples, alloc, prompt=prompt)
        tokens = samples * seq
        # recomputation runs each forward once more in the backward; a frozen base (LoRA) computes its inputs'
        # gradients only, not its weights': a backward of one forward's FLOPs instead of two
        passes = (4.0 if alloc.recompute else 3.0) - (1.0 if shape.lora_rank else 0.0)
        forward = T.forward_flops(shape, tokens, samples * sq) - self._skipped_head(shape, samples * prompt)
        flops = forward * passes
        step = self._pass(
            alloc,
            shape,
            flops,
            passes * self._weight_bytes(mfc.model_role),
            tokens,
            allreduces_per_layer=2 * passes - 2,
            hops=2,
            micro_batches=alloc.micro_batches,
            op_passes=passes,
            flops_scale=self._flops_scale(shape, MFCKind.TRAIN),
        )
        rates = self._rates_of(alloc)
        shard_params = shape.trained_params / (lay.tp * lay.pp)  # what has gradients and optimizer state
        if alloc.fsdp:
            step.update(self._fsdp_terms(shape, alloc, sum(step.values())))
        else:
            grad_bytes = shard_params * max(self.bytes_per_param, GRAD_REDUCE_BYTES)  # summed in fp32
            step["dp_grad_allreduce"] = T.ring_allreduce_time(grad_bytes, lay.dp, rates.dp_bw, rates.latency)
            shards = alloc.optimizer_shards  # ZeRO-1: each dp rank updates 1/dp, then the weights are gathered
            step["optimizer"] = T.adam_step_bytes(shard_params / shards, self.bytes_per_param) / rates.mem
            step[_launch("optimizer_launch", lay.tp)] = self._launch_excess(
                T.optimizer_ops(shape, shape.layers / lay.pp) * rates.op, step["optimizer"]
            )
            if shards > 1:
                step["zero_allgather"] = T.ring_allgather_time(
                    shard_params * self.bytes_per_param, lay.dp, rates.dp_bw, rates.latency
                )
        if self.settings.optimizer_offload:
            step.update(self._host_optimizer_terms(shard_params / alloc.optimizer_shards, alloc))
        return {name: seconds * epochs * minibatches for name, seconds in step.items()}

    def _host_optimizer_terms(self, owned: float, alloc: Allocation) -> dict[str, float]:
        """An optimizer step whose state lives in host memory, for ``owned`` parameters per device: fp32
        gradients down and 16-bit weights back over the host link, and Adam on the node's CPUs, which every
        device of the allocation on that node shares."""
        p = self.profile
        per_node = max(Counter(self.cluster.node_of(d) for d in alloc.mesh).values())
        return {
            "optimizer": owned * per_node / p.host_adam_rate,
            "optimizer_host_link": owned * (GRAD_REDUCE_BYTES + self.bytes_per_param) / p.host_bw,
            "optimizer_launch": 0.0,
        }

    def _fsdp_terms(self, shape: ModelShape, alloc: Allocation, work: float) -> dict[str, float]:
        """An FSDP optimizer step's communication (per micro-batch: two all-gathers of the weights in the
        compute type, one reduce-scatter of fp32 gradients), exposed beyond ``work`` (the step's pass) where
        the devices overlap them, and its Adam step over the 1/dp of fp32 weights the rank keeps."""
        lay, rates, mb = alloc.layout, self._rates_of(alloc), alloc.micro_batches
        local = shape.params / lay.tp  # the tensor-parallel shard FSDP divides further
        trained = shape.trained_params / lay.tp  # a LoRA model reduces its adapters' gradients only
        gather = T.ring_allgather_time(local * self.bytes_per_param, lay.dp, rates.dp_bw, rates.latency)
        scatter = T.ring_allgather_time(trained * GRAD_REDUCE_BYTES, lay.dp, rates.dp_bw, rates.latency)
        comm = mb * (2 * gather + scatter)
        exposed = max(0.0, comm - work) + gather / shape.layers if self.profile.async_launch else comm
        owned = trained / lay.dp
        optimizer = T.adam_step_bytes(owned, T.FP32) / rates.mem
        return {
            "fsdp_comm": exposed,
            "optimizer": optimizer,
            "optimizer_launch": self._launch_excess(T.optimizer_ops(shape, shape.layers) * rates.op, optimizer),
            _launch("fsdp_launch_fsdp", lay.tp): self._launch_excess(mb * T.fsdp_round_ops(shape) * rates.op, work),
        }

    def _generate_terms(self, role: str, alloc: Allocation, mfc: MFC | None = None) -> dict[str, float]:
        """Prefill of the share's prompts, then decode over the response-length distribution; a call that reads
        the policy's responses (a judge) prefills them too, and a call with its own budget (a judge's verdict)
        decodes that many tokens per sample."""
        w = self.workload
        context = w.prompt_len + (w.mean_response if mfc is not None and mfc.reads_response else 0.0)
        lengths = (mfc.max_new_tokens,) if mfc is not None and mfc.max_new_tokens else w.response_lengths
        episodes = w.episodes if mfc is not None and mfc.multi_turn else None
        share = D.share(w.batch, alloc.layout.dp)
        out = self.prefill_terms(role, alloc, share, context)
        out.update(self._decode_terms(role, alloc, lengths, padded=False))
        if episodes is not None and episodes.turns > 1:
            out.update(self._continuation_terms(role, alloc, share, episodes))
        return out

    def _continuation_terms(self, role: str, alloc: Allocation, share: float, episodes: EpisodeShape) -> dict:
        """A multi-turn call's later turns: each prefills its observation and the turn's last sampled token over
        the kept cache (priced as a prefill of those tokens alone: their attention over the kept context is left
        out, small beside the weights' matmuls while observations are short)."""
        later = episodes.turns - 1
        cont = self.prefill_terms(role, alloc, share * later, episodes.observed_tokens / later + 1)
        return {f"continue_{name[len('prefill_') :]}": seconds for name, seconds in cont.items()}

    def env_wait(self, mfc: MFC) -> float:
        """Seconds a multi-turn call waits on its environments, beside its hardware terms (no correction scales
        it): a wait after every turn (the last one's step ends the episode), priced whole, as if every episode
        waited at once (episodes that start together and take turns of similar length do); continuous batching
        hides it only where episodes are out of step."""
        episodes = self.workload.episodes
        if not mfc.multi_turn or episodes is None:
            return 0.0
        return episodes.turns * episodes.env_step_s

    def prefill_terms(self, role: str, alloc: Allocation, samples: float, context: float) -> dict[str, float]:
        """Uncorrected terms of prefilling ``samples`` samples of ``context`` tokens each on one replica."""
        shape = self._shape(role)
        flops = T.forward_flops(shape, samples * context, samples * context**2)
        chunks = max(1, math.ceil(samples * context / PREFILL_CHUNK_TOKENS))
        prefill = self._pass(
            alloc,
            shape,
            flops,
            chunks * self._gen_weight_bytes(role),
            samples * context,
            allreduces_per_layer=2,
            hops=1,
            micro_batches=self._gen_micro_batches(alloc),
            flops_scale=self._flops_scale(shape, MFCKind.GENERATE),
        )
        return {f"prefill_{name}": seconds for name, seconds in prefill.items()}

    # ------------------------------------------------------------------------------------------- building blocks

    def _pass(
        self,
        alloc: Allocation,
        shape: ModelShape,
        flops: float,
        weight_traffic: float,
        tokens: float,
        allreduces_per_layer: float,
        hops: int,
        micro_batches: int,
        op_passes: float = 1.0,
        flops_scale: float = 1.0,
    ) -> dict[str, float]:
        """One pipelined pass of a replica's share (see the module docstring): work, bubble, tp all-reduces,
        pp hops and operator launches (``op_passes`` forward passes' worth of operators per slot: 3 when
        training). ``weight_traffic`` is the whole model's weight bytes moved per micro-batch; ``flops_scale``
        scales the matmul rate (:meth:`_flops_scale`)."""
        lay, rates = alloc.layout, self._rates_of(alloc)
        mb = micro_batches
        slot = T.roofline(
            flops / (lay.tp * lay.pp * mb), weight_traffic / (lay.tp * lay.pp), rates.flops * flops_scale, rates.mem
        )
        act = tokens / mb * shape.hidden * self.bytes_per_param  # one micro-batch's hidden states
        tp = (
            allreduces_per_layer
            * shape.layers
            / lay.pp
            * T.ring_allreduce_time(act, lay.tp, rates.tp_bw, rates.latency)
        )
        hop = hops * T.transfer_time(act, rates.pp_bw, rates.latency) if lay.pp > 1 else 0.0
        slots = T.pipeline_slots(lay.pp, mb)
        launch = self._launch_excess(
            slots * op_passes * T.forward_ops(shape, shape.layers / lay.pp) * rates.op, slots * slot
        )
        return {
            "work": mb * slot,
            "pp_bubble": (lay.pp - 1) * slot,
            "tp_comm": slots * tp,
            "pp_p2p": slots * hop,
            _launch("launch", lay.tp): launch,
        }

    def _launch_excess(self, launch: float, work: float) -> float:
        """Launch seconds a pass adds to ``work``: all of them when dispatch and work share one thread, only
        what exceeds the work when the host queues ahead of the device (``HardwareProfile.async_launch``)."""
        return max(0.0, launch - work) if self.profile.async_launch else launch

    def _flops_scale(self, shape: ModelShape, kind: MFCKind) -> float:
        """The matmul rate of ``kind``'s passes relative to the profile's bf16 one: FP8 where the settings ask
        for it (generation's or training's precision) and the device has it, and a mixture of experts'
        utilisation relative to a dense model's (the profile's ``moe_efficiency``, less for experts smaller
        than the one it was measured on: √ of their size ratio)."""
        p, settings = self.profile, self.settings
        scale = 1.0
        if shape.moe:
            size = shape.hidden * shape.expert_intermediate
            scale *= p.moe_efficiency * min(1.0, math.sqrt(size / MOE_REFERENCE_EXPERT))
        precision = settings.gen_precision if kind is MFCKind.GENERATE else settings.train_precision
        if precision == "fp8" and p.fp8_matmul_flops > 0:
            scale *= p.fp8_matmul_flops * p.fp8_efficiency / (p.matmul_flops * p.matmul_efficiency)
        return scale

    def _decode_terms(self, role: str, alloc: Allocation, lengths: tuple[int, ...], padded: bool) -> dict[str, float]:
        """Decode steps summed in closed form over occupancy segments (:mod:`loomrl.planner.cost.decode`)."""
        return self.decode_segment_terms(role, alloc, self._segments(role, alloc, lengths, padded))

    def decode_segment_terms(self, role: str, alloc: Allocation, segments: list[D.Segment]) -> dict[str, float]:
        """Uncorrected terms of the decode steps of ``segments`` on one replica of ``alloc``: a step reads the
        weights its tokens touch and every live sample's KV cache at the profile's decode bandwidth
        (``decode_bw_efficiency``), computes at the matmul rate, and adds the engine's fixed step time."""
        shape, lay, rates, p = self._shape(role), alloc.layout, self._rates_of(alloc), self.profile
        mb, b = self._gen_micro_batches(alloc), self.bytes_per_param
        split = lay.tp * lay.pp * mb  # the devices and micro-batches a step's live tokens are spread over
        kv_split = min(lay.tp, shape.kv_heads) * lay.pp * mb  # kv heads are replicated beyond kv_heads
        slots = T.decode_step_slots(lay.pp, mb)
        flops, mem = rates.flops * self._flops_scale(shape, MFCKind.GENERATE), rates.mem * p.decode_bw_efficiency
        launch_key = _launch("decode_launch", lay.tp)
        out = {"decode": 0.0, "decode_tp_comm": 0.0, "decode_pp_p2p": 0.0, "decode_step": 0.0, launch_key: 0.0}
        step_ops = T.forward_ops(shape, shape.layers / lay.pp) + T.SAMPLE_OPS
        for seg in segments:
            # per-slot compute and memory time, each linear in the step t: a + b·t
            attn = 4.0 * shape.layers * shape.q_dim / (split * flops)
            a = 2.0 * shape.matmul_params * seg.live / (split * flops) + attn * seg.ctx_base
            kv = T.kv_bytes_per_token(shape, b) / (kv_split * mem)
            weights = T.decode_weight_bytes(shape, seg.live / mb, self._gen_bytes())
            c = weights / (lay.tp * lay.pp * mem) + kv * seg.ctx_base
            work = slots * T.sum_max_linear(a, attn * seg.live, c, kv * seg.live, seg.start, seg.end)
            out["decode"] += work
            act = seg.live / mb * shape.hidden * b
            steps = seg.end - seg.start
            tp = 2 * shape.layers / lay.pp * T.ring_allreduce_time(act, lay.tp, rates.tp_bw, rates.latency)
            out["decode_tp_comm"] += slots * tp * steps
            out["decode_step"] += p.decode_step_s * steps
            out[launch_key] += self._launch_excess(slots * step_ops * rates.op * steps, work)
            if lay.pp > 1:
                out["decode_pp_p2p"] += slots * T.transfer_time(act, rates.pp_bw, rates.latency) * steps
        return out

    def _segments(self, role: str, alloc: Allocation, lengths: tuple[int, ...], padded: bool) -> list[D.Segment]:
        """Occupancy of one replica's decode: static batching (``padded``), synchronous request batches
        (``gen_request_batch``), a bounded number of slots (:meth:`decode_slots`), or every sample at once."""
        w, dp = self.workload, alloc.layout.dp
        if padded:
            return D.padded_segments(lengths, D.share(w.batch, dp), w.prompt_len)
        whole, slots = D.whole_share(w.batch, dp), self.decode_slots(role, alloc, lengths)
        if self.settings.partial_rollout:
            live = min(slots, whole) if slots is not None else whole
            return D.steady_segments(lengths, D.share(w.batch, dp), max(1, live), w.prompt_len)
        batch = self.settings.gen_request_batch
        if batch is not None and whole > batch:
            return D.round_segments(lengths, whole, batch, w.prompt_len, slots)
        if slots is not None and whole > slots:
            return D.slot_segments(lengths, whole, slots, w.prompt_len)
        return D.continuous_segments(lengths, D.share(w.batch, dp), w.prompt_len)

    def decode_slots(self, role: str, alloc: Allocation, lengths: tuple[int, ...] | None = None) -> int | None:
        """Samples one generation replica on ``alloc`` decodes at once at most, or None for all of its share:
        the workload's ``decode_slots``, the engine's ``max_num_seqs`` and, for a serving engine, what its KV
        cache holds at the mean context of a live sample (:func:`loomrl.planner.cost.decode.live_context`)."""
        w, settings = self.workload, self.settings
        limits = [n for n in (w.decode_slots, settings.gen_max_seqs) if n is not None]
        if settings.serving_engine:
            if settings.gen_max_seqs is None:
                limits.append(default_max_seqs(self.profile))
            shape, lay = self._shape(role), alloc.layout
            per_token = T.kv_bytes_per_token(shape, self.bytes_per_param) / (min(lay.tp, shape.kv_heads) * lay.pp)
            context = D.live_context(lengths or w.response_lengths, w.prompt_len)
            limits.append(max(1, int(self._engine_kv_bytes(role, alloc) / (per_token * context))))
        return min(limits) if limits else None

    def _pass_prompt(self, alloc: Allocation, training: bool = False) -> float:
        """Prompt tokens a pass computes per sample: its prompt's share among the samples sharing it where the
        settings compute a shared prompt once and the layout lets them (a whole model or replica: not pipeline
        stages, FSDP or a training pass recomputing its activations), else the whole prompt."""
        w = self.workload
        shared = (
            self.settings.shared_prompts
            and w.samples_per_prompt > 1
            and alloc.layout.pp == 1
            and not alloc.fsdp
            and not (training and alloc.recompute)
        )
        return w.prompt_len / w.samples_per_prompt if shared else w.prompt_len

    def _pass_lengths(
        self,
        samples: float,
        alloc: Allocation,
        lengths: tuple[int, ...] | None = None,
        prompt: float | None = None,
    ) -> tuple[float, float]:
        """(mean, mean square) length of a sample as a pass on ``alloc`` processes it: packed (the settings'
        default), its own length; padded, the longest of the ``samples / micro_batches`` samples it shares a
        micro-batch with (:func:`loomrl.planner.cost.decode.expected_longest`), or where the samples are sorted
        first (``sorted_passes``) the longest of its sorted micro-batch (:func:`loomrl.planner.cost.decode.
        sorted_longest`; cut where they pad least, but near-equal on pipeline stages, as the runtime cuts).
        ``lengths``: the responses of the pass's samples where known, else the workload's distribution;
        ``prompt``: the prompt tokens computed per sample (:meth:`_pass_prompt`), else the workload's."""
        w = self.workload if lengths is None else dataclasses.replace(self.workload, response_lengths=tuple(lengths))
        prompt = w.prompt_len if prompt is None else prompt
        micro_batches = alloc.micro_batches
        per_micro_batch = samples / micro_batches
        if (self.settings.packing or per_micro_batch <= 1) and prompt == w.prompt_len:
            return w.mean_seq, w.mean_sq_seq
        # a sample of length L = P + n costs L^2 = P^2 + 2Pn + n^2 in attention: the prompt's own share (P^2) is
        # computed once per group where the prompt is shared, the responses' attention to it (2Pn) per sample
        full = w.prompt_len
        if self.settings.packing or per_micro_batch <= 1:
            response_sq = w.mean_sq_seq - full * (full + 2 * w.mean_response)
            return prompt + w.mean_response, response_sq + 2 * full * w.mean_response + full * prompt
        if self.settings.sorted_passes:
            # the pass's own samples: their lengths where known, else the distribution's quantiles for as many
            share = lengths if lengths is not None else D.admission_order(w.response_lengths, max(1, round(samples)))
            mean, mean_sq = D.sorted_longest(share, micro_batches, least_padding=alloc.layout.pp == 1)
            return prompt + mean, mean_sq + 2 * full * mean + full * prompt
        longest = D.expected_longest(w.response_lengths, per_micro_batch)
        return prompt + longest, longest * longest + 2 * full * longest + full * prompt

    def _skipped_head(self, shape: ModelShape, prompt_tokens: float) -> float:
        """Forward FLOPs of the output head at ``prompt_tokens`` positions, which a runtime computing it at the
        response only skips (:attr:`SystemSettings.head_tokens`); 0 otherwise."""
        return 2.0 * shape.vocab * shape.hidden * prompt_tokens if self.settings.head_tokens == "response" else 0.0

    # ------------------------------------------------------------------------------------------------ helpers

    def _is_rule(self, role: str | None) -> bool:
        """Whether ``role`` has no model (a rule reward): its calls are priced as host work."""
        return role is not None and role in self.shapes and self.shapes[role] is None

    def _shape(self, role: str | None) -> ModelShape:
        shape = None if role is None else self.shapes.get(role)  # None too for a role with no model
        if shape is None:
            known = ", ".join(r for r, s in self.shapes.items() if s is not None) or "none"
            raise ConfigError(f"cost model: no model shape for role {role!r}; known: {known}")
        return shape

    def _weight_bytes(self, role: str) -> float:
        return self._shape(role).params * self.bytes_per_param

    def _gen_bytes(self) -> float:
        """Bytes per weight of the generation engine (FP8 where the settings ask for it)."""
        return 1 if self.settings.gen_precision == "fp8" else self.bytes_per_param

    def _gen_weight_bytes(self, role: str) -> float:
        return self._shape(role).params * self._gen_bytes()

    def _steps(self, mfc: MFC) -> tuple[int, int]:
        """(epochs, minibatches) of a train call: the MFC's own when set (not 1), else the workload's."""
        epochs = mfc.epochs if mfc.epochs != 1 else self.workload.ppo_epochs
        minibatches = mfc.minibatches if mfc.minibatches != 1 else self.workload.minibatches
        return epochs, minibatches

    @staticmethod
    def _gen_micro_batches(alloc: Allocation) -> int:
        return alloc.micro_batches if alloc.layout.pp > 1 else 1

    def _rates_of(self, alloc: Allocation) -> Rates:
        key = _alloc_key(alloc)[:2]
        if key not in self.cache.rates:
            self.cache.rates[key] = allocation_rates(self.profile, self.cluster, alloc)
        return self.cache.rates[key]


def _launch(name: str, tp: int) -> str:
    """Name of an operator-launch term; ``_tp`` marks tensor-parallel operators (DTensor dispatch costs more
    per operator, so corrections fit the two apart, see :func:`loomrl.planner.cost.corrections.term_group`)."""
    return f"{name}_tp" if tp > 1 else name


def _alloc_key(alloc: Allocation) -> tuple:
    lay = alloc.layout
    return (
        alloc.mesh.devices,
        (lay.dp, lay.tp, lay.pp, lay.reverse),
        alloc.micro_batches,
        alloc.recompute,
        alloc.zero,
        alloc.fsdp,
    )
