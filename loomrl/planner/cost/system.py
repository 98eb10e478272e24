"""How a system runs its calls beyond the plan's placement: the serving engine, precisions, offloading.

A plan says where each call runs and how its model is sharded; the same plan runs differently on loomrl's own
runtime and on, say, vLLM + Megatron: the generation engine preallocates a share of device memory and decodes
at most so many sequences at once, a framework may send its prompts to the engine in synchronous batches, train
in FP8, keep Adam's state in host memory, or pay a per-tensor cost to move weights into the engine.
:class:`SystemSettings` describes those choices for the cost model (:class:`~loomrl.planner.cost.model.CostModel`);
its defaults are loomrl's runtime, so the CPU estimator and every plan search without settings price as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomrl.config.tools import ValidatedConfig, spec
from loomrl.plan.hardware import HardwareProfile

__all__ = ["RUNTIME", "SystemSettings", "default_max_seqs"]

PRECISIONS = ("auto", "bf16", "fp8")
"""Precisions of generation and of training/scoring passes: ``auto`` is bf16 on accelerators (fp32 on CPU)."""


@dataclass(frozen=True)
class SystemSettings(ValidatedConfig):
    """How the calls of a plan run, beyond where (see the module docstring); the defaults are loomrl's runtime."""

    gen_memory_fraction: float | None = spec(None, gt=0, le=1)
    """Share of each generation device's memory the serving engine reserves for its weights and KV cache (vLLM's
    ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``): the KV cache it leaves bounds the sequences
    decoding at once. None: loomrl's rollout engine, whose KV cache grows as needed."""
    gen_max_seqs: int | None = spec(None, ge=1)
    """Sequences one generation replica decodes at once at most (vLLM's ``max_num_seqs``). None: the engine's
    default where ``gen_memory_fraction`` names an engine (:func:`default_max_seqs`), else the workload's
    ``decode_slots``."""
    gen_request_batch: int | None = spec(None, ge=1)
    """Samples a generation replica receives per synchronous request: each batch decodes until its longest
    sample ends before the next is sent (as OpenRLHF did with ``micro_rollout_batch_size`` before it sent every
    prompt at once). None: all of a replica's samples at once."""
    partial_rollout: bool = False
    """Under an asynchronous plan, generation never waits for a batch's tail: a weight update interrupts the
    samples in flight, which continue under the new weights (verl's ``partial_rollout``, AReaL's interruptible
    generation), so a replica keeps its slots full and an iteration's generation costs its samples' tokens at
    full occupancy rather than the decode of its longest sample
    (:func:`~loomrl.planner.cost.decode.steady_segments`). A setting of the system simulated: loomrl's runtime
    generates each batch whole."""
    gen_precision: str = spec("auto", choices=PRECISIONS)
    """Weights of the generation engine: bf16, or fp8 (half the bytes a decode step reads, FP8 matmuls)."""
    train_precision: str = spec("auto", choices=PRECISIONS)
    """Matmuls of training and scoring passes: bf16, or fp8 (the GPU's FP8 rate; weights and optimizer state
    stay as they are)."""
    optimizer_offload: bool = False
    """Adam's state and the fp32 master weights live in host memory and the optimizer step runs on the CPUs
    (DeepSpeed's ``offload_optimizer``, Megatron's ``optimizer_cpu_offload``): gradients go down and weights come
    back over the host link every step."""
    packing: bool = True
    """Training and scoring passes pack samples without padding (sequence packing, or padding removed); False
    pads each micro-batch to its longest sample."""
    sorted_passes: bool = False
    """Unpacked scoring and training passes sort their samples by length before cutting micro-batches, so a
    micro-batch is as long as its own longest and long samples share one, and cut them where they pad least
    (loomrl's runtime; near-equal on pipeline stages); False: micro-batches of samples in arrival order."""
    shared_prompts: bool = False
    """Training and scoring passes compute a prompt its group's samples share once (loomrl's runtime, outside
    pipeline stages, FSDP and recomputed passes: :mod:`loomrl.role.shared_prefix`); False: once per sample."""
    logits: str = spec("fp32", choices=("fp32", "chunked"))
    """How passes hold their logits: ``fp32`` for every token of a micro-batch (loomrl's runtime), ``chunked``
    a few thousand tokens at a time (fused or chunked cross-entropy, Megatron's and NeMo RL's)."""
    head_tokens: str = spec("all", choices=("all", "response"))
    """Positions a scoring or training pass computes the output head at: every token (``all``: most RL systems
    compute the prompt's logits too, then drop them) or the response tokens only (``response``: loomrl's runtime,
    where only they carry a log-prob or a loss; the vocabulary head is most of a small model's arithmetic)."""
    sync_tensor_s: float = spec(0.0, ge=0)
    """Seconds each parameter tensor of a weight sync into the generation engine costs beyond its bytes (a
    framework's per-tensor call, format conversion and engine loader)."""
    expert_parallel: int = spec(1, ge=1)
    """Ranks a mixture-of-experts model's experts are divided over in training (Megatron's EP, taken from the
    data-parallel ranks; experts are not tensor-parallel then)."""

    @property
    def serving_engine(self) -> bool:
        """Whether generation runs on a serving engine that preallocates memory (vLLM, SGLang)."""
        return self.gen_memory_fraction is not None


def default_max_seqs(profile: HardwareProfile) -> int:
    """vLLM's default ``max_num_seqs`` for offline generation on ``profile``'s GPU: 1024 on GPUs of 70 GiB or more
    other than the A100, 256 elsewhere (vllm/engine/arg_utils.py, ``get_batch_defaults``; the A100 branch names
    the A100 by name, so the A800, its variant, falls in the same branch here)."""
    large = profile.memory_bytes >= 70 * 2**30 and not profile.name.startswith(("a100", "a800"))
    return 1024 if large else 256


RUNTIME = SystemSettings(packing=False, sorted_passes=True, shared_prompts=True, head_tokens="response")
"""loomrl's own runtime: each training and scoring micro-batch is computed to its own longest sample (no
packing), passes sort their samples by length first and cut micro-batches where they pad least
(:func:`loomrl.algorithms.ops.micro_batch_rows`), a group's shared prompt is computed once, and the output head
runs at the response tokens only."""
