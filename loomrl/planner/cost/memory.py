"""The memory half of the cost model: bytes per device a call holds while it runs, and a role's resident state.

:class:`MemoryPricing` is a mixin of :class:`~loomrl.planner.cost.model.CostModel` (its own module to keep the
time and the memory formulas each readable in one file); it reads the model's workload, settings, shapes and
helpers, declared below for the type checker.

Memory per device follows :func:`loomrl.plan.shard_bytes` for the resident state (weights, plus gradients and
fp32 Adam moments when trained; data parallelism replicates, as the runtime does without FSDP), so plans the
cost model accepts are the plans :meth:`loomrl.plan.ExecutionPlan.validate` accepts
(:meth:`MemoryPricing.static_memory`). While it runs, a call adds transient bytes
(:meth:`MemoryPricing.mfc_memory`): activations (train: the tensors kept for backward, the 1F1B pipeline keeping
at most pp micro-batches on a stage), working buffers (inference) or the KV cache at its fullest (generate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomrl.plan import Allocation, shard_bytes
from loomrl.plan.hardware import HardwareProfile
from loomrl.plan.model_shape import ModelShape
from loomrl.planner.cost import decode as D
from loomrl.planner.cost import terms as T
from loomrl.planner.cost.system import SystemSettings
from loomrl.planner.cost.workload import Workload
from loomrl.workflow import MFC, MFCKind

PREFILL_CHUNK_TOKENS = 4096
"""Prompt tokens the rollout engine prefills at once (its ``prefill_tokens`` default): bounds prefill buffers."""
ENGINE_BATCHED_TOKENS = 8192
"""Tokens a serving engine's forward pass handles at most (vLLM's ``max_num_batched_tokens`` of 8192 to 16384):
the activation buffers it reserves beside its KV cache."""
LOGIT_CHUNK_TOKENS = 4096
"""Tokens whose logits a chunked (fused) cross-entropy holds at once (:attr:`SystemSettings.logits`)."""
GENERATING_ROLE = "actor"
"""The role every workflow generates with (:mod:`loomrl.algorithms.workflows`): its copies outside training are
the serving engine's."""
COMPUTE_BYTES_PER_TOKEN = 64
"""Bytes a compute step (advantages) reads and writes per token: a few fp32 columns, in and out."""
GRAD_REDUCE_BYTES = 4
"""Gradients are summed over data-parallel ranks in fp32 at least (:mod:`loomrl.parallel.data_parallel`)."""


class MemoryPricing:
    """Bytes per device: :meth:`static_memory` (resident state), :meth:`mfc_memory` (a call's transient peak) and
    :meth:`call_memory` (both)."""

    if TYPE_CHECKING:  # provided by CostModel
        workload: Workload
        settings: SystemSettings
        profile: HardwareProfile
        shapes: dict[str, ModelShape | None]
        bytes_per_param: int

        def _shape(self, role: str | None) -> ModelShape: ...
        def _is_rule(self, role: str | None) -> bool: ...
        def _gen_weight_bytes(self, role: str) -> float: ...
        def _steps(self, mfc: MFC) -> tuple[int, int]: ...
        def _pass_prompt(self, alloc: Allocation, training: bool = False) -> float: ...
        def _segments(
            self, role: str, alloc: Allocation, lengths: tuple[int, ...], padded: bool
        ) -> list[D.Segment]: ...
        def _pass_lengths(
            self, samples: float, alloc: Allocation, lengths: tuple[int, ...] | None = None, prompt: float | None = None
        ) -> tuple[float, float]: ...

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        """Transient peak bytes on each device of ``alloc`` while the call runs: activations kept for the
        backward (train), working buffers (inference), KV cache and buffers (generate). The role's weights
        (and optimizer state) are :meth:`static_memory`, which the simulator holds for as long as they are
        resident; :meth:`call_memory` is the sum of the two. ``trainable`` does not change the transient part."""
        if mfc.kind is MFCKind.COMPUTE or self._is_rule(mfc.role):
            return self.workload.batch * self.workload.mean_seq * COMPUTE_BYTES_PER_TOKEN
        if mfc.role not in self.shapes:
            return 0.0
        if mfc.kind is MFCKind.GENERATE:
            return self._generate_memory(mfc.role, alloc) + self._kept_memory(mfc, alloc)
        if mfc.kind is MFCKind.INFERENCE:
            return self._inference_memory(mfc.role, alloc)
        return self._train_memory(mfc, alloc)

    def call_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        """Peak bytes per device of a call with its role's weights (+ gradients and Adam if ``trainable``)."""
        static = 0.0 if mfc.role is None else self.static_memory(mfc.role, alloc, trainable)
        return static + self.mfc_memory(mfc, alloc, trainable)

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        """Resident bytes per device of ``role``'s weights on ``alloc`` (plus gradients and Adam moments if
        ``trainable``): :func:`loomrl.plan.shard_bytes`, the figure plan validation uses; a trained mixture of
        experts divides its experts over the settings' expert-parallel ranks rather than tp, and an offloaded
        optimizer keeps its state on the host. A rule (no model) holds nothing."""
        if self._is_rule(role) or role not in self.shapes:
            return 0.0
        shape, lay = self._shape(role), alloc.layout
        params = shape.pipeline_params(lay.pp)  # the busiest stage's share, times pp
        ep = min(self.settings.expert_parallel, lay.dp * lay.tp)
        if shape.moe and ep > 1 and (trainable or role != GENERATING_ROLE):
            # the training engine's layouts (every trained role's state, every frozen role's placements) hold the
            # experts over ep·pp ranks instead of tp·pp, scaled here into tp·pp terms; the generating role's
            # other copies are the serving engine's, which splits experts by tp like every other weight
            params += round(shape.expert_params * (lay.tp / ep - 1))
        return float(
            shard_bytes(
                params,
                lay.tp,
                lay.pp,
                self.bytes_per_param,
                trainable,
                optimizer_shards=alloc.optimizer_shards if trainable else 1,
                param_shards=alloc.param_shards if trainable else 1,
                optimizer_on_host=trainable and self.settings.optimizer_offload,
                trained_params=shape.trained_params,
            )
        )

    def _engine_kv_bytes(self, role: str, alloc: Allocation) -> float:
        """Bytes per device a serving engine's KV cache gets: its memory share less its weights and the
        activation buffers of one batched forward pass (:data:`ENGINE_BATCHED_TOKENS`); 0 when the weights
        alone do not fit in the share."""
        shape, lay = self._shape(role), alloc.layout
        fraction = self.settings.gen_memory_fraction
        assert fraction is not None  # asked for a serving engine only (decode_slots)
        pool = fraction * self.profile.memory_bytes
        weights = self._gen_weight_bytes(role) / (lay.tp * lay.pp)
        buffers = ENGINE_BATCHED_TOKENS * (4 * shape.hidden + 2 * T.mlp_width(shape) / lay.tp) * self.bytes_per_param
        return max(0.0, pool - weights - buffers)

    def _generate_memory(self, role: str, alloc: Allocation) -> float:
        """KV cache at its fullest, plus the larger of a prefill chunk's buffers and the decode logits; a serving
        engine holds its whole memory share (less the weights, which are the resident copy) instead, or more
        than the device has when its weights alone exceed the share (it would not start)."""
        shape, lay, w, b = self._shape(role), alloc.layout, self.workload, self.bytes_per_param
        if self.settings.serving_engine:
            fraction = self.settings.gen_memory_fraction
            assert fraction is not None  # what serving_engine checks
            pool = fraction * self.profile.memory_bytes
            weights = self._gen_weight_bytes(role) / (lay.tp * lay.pp)
            return pool - weights if pool > weights else self.profile.memory_bytes
        segments = self._segments(role, alloc, w.response_lengths, padded=False)
        kv = T.kv_bytes_per_token(shape, b) * D.peak_context(segments) / (min(lay.tp, shape.kv_heads) * lay.pp)
        prefill_tokens = min(D.share(w.batch, lay.dp) * w.prompt_len, PREFILL_CHUNK_TOKENS)
        prefill = T.inference_activation_bytes(shape, prefill_tokens, lay.tp, b)
        logits = D.peak_live(segments) * shape.vocab / lay.tp * T.FP32
        return kv + max(prefill, logits)

    def _kept_memory(self, mfc: MFC, alloc: Allocation) -> float:
        """The keys and values a multi-turn call's episodes keep while their environments answer: copies outside
        the engine's slots (:class:`~loomrl.rollout.engine.RolloutEngine`), at their fullest when every episode
        of the share waits before its last turn, holding its prompt and all but that turn of its response."""
        episodes, w = self.workload.episodes, self.workload
        if not mfc.multi_turn or episodes is None or episodes.turns <= 1 or mfc.role is None:
            return 0.0
        shape, lay = self._shape(mfc.role), alloc.layout
        response = w.mean_response + episodes.observed_tokens
        context = w.prompt_len + response * (episodes.turns - 1) / episodes.turns
        per_token = T.kv_bytes_per_token(shape, self.bytes_per_param) / (min(lay.tp, shape.kv_heads) * lay.pp)
        return D.share(w.batch, lay.dp) * context * per_token

    def _inference_memory(self, role: str, alloc: Allocation) -> float:
        """Working buffers of one micro-batch's forward pass (its logits a chunk at a time when the settings say
        so)."""
        shape, lay, w = self._shape(role), alloc.layout, self.workload
        samples = D.share(w.batch, lay.dp)
        seq = self._pass_lengths(samples, alloc, prompt=self._pass_prompt(alloc))[0]
        tokens = samples * seq / alloc.micro_batches
        return T.inference_activation_bytes(shape, tokens, lay.tp, self.bytes_per_param, self._logit_tokens(tokens))

    def _train_memory(self, mfc: MFC, alloc: Allocation) -> float:
        """Activations kept for the backward: one micro-batch at a time without pipelining; under the runtime's
        1F1B pipeline schedule, stage 0 (the most loaded) keeps ``min(pp, micro_batches)`` micro-batches."""
        shape, lay, w = self._shape(mfc.role), alloc.layout, self.workload
        _, minibatches = self._steps(mfc)
        samples = w.batch / minibatches / lay.dp
        tokens = samples * self._pass_lengths(samples, alloc, prompt=self._pass_prompt(alloc, training=True))[0]
        in_flight = tokens / alloc.micro_batches * min(lay.pp, alloc.micro_batches)
        # FSDP: the root unit (embedding, head) gathered throughout, two layers at a time (one prefetched) and
        # one layer's unsharded fp32 gradients before its reduce-scatter
        gathered = (
            0.0
            if not alloc.fsdp
            else (
                2 * shape.vocab * shape.hidden * self.bytes_per_param
                + (2 * self.bytes_per_param + GRAD_REDUCE_BYTES) * shape.params / shape.layers
            )
            / lay.tp
        )
        per_micro = tokens / alloc.micro_batches
        if alloc.recompute:
            return gathered + T.recompute_activation_bytes(
                shape,
                in_flight,
                per_micro,
                shape.layers / lay.pp,
                lay.tp,
                self.bytes_per_param,
                self._logit_tokens(per_micro),
            )
        return gathered + T.train_activation_bytes(
            shape, in_flight, shape.layers / lay.pp, lay.tp, self.bytes_per_param, self._logit_tokens(in_flight)
        )

    def _logit_tokens(self, tokens: float) -> float:
        """Tokens whose fp32 logits a pass over ``tokens`` holds at once (:attr:`SystemSettings.logits`)."""
        return min(tokens, LOGIT_CHUNK_TOKENS) if self.settings.logits == "chunked" else tokens
