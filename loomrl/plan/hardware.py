"""Hardware profiles: the rates and sizes the cost model prices a device with.

Every figure of an accelerator profile is the vendor's datasheet number for the SXM part, cited next to it.
Two conventions matter when reading them:

- ``matmul_flops`` is the *dense* bf16 tensor-core rate. Datasheets headline the 2:4-sparse rate, twice the
  dense one; the cost model never assumes sparsity.
- ``intra_node_bw`` is what one device can push in *one direction* over NVLink. Datasheets give the
  bidirectional total (e.g. "900 GB/s"), so the profile holds half. ``inter_node_bw`` is one NIC per device,
  again one direction (400 Gb/s NDR = 50 GB/s).

Memory sizes are in the 2^30-byte :data:`GB`, as everywhere in the plan code. Bandwidths
and rates are decimal (10^9, 10^12), as datasheets print them.

``link_latency`` is not a datasheet figure: it is the per-message start-up cost of a collective (NCCL over
NVLink is ~10 µs for small messages; the loopback TCP transport gloo uses on one machine is measured by
:func:`loomrl.planner.calibrate_local`). It matters for decode, where every step runs two all-reduces per
layer of a few kilobytes each. ``op_overhead`` (one operator's dispatch) is not a datasheet figure either: it
is the launch cost that bounds decode steps and small models.

**Efficiencies** (``matmul_efficiency``, ``fp8_efficiency``, ``moe_efficiency``, ``decode_bw_efficiency``,
``decode_step_s``, ``intra_bus_efficiency``) are what published measurements of the same GPU reach, each cited
beside its value; none is fitted to the runs ``benchmarks/published_runs.py`` predicts. The ``local`` profile
keeps them neutral (1, 0): on CPU the fitted corrections of :mod:`loomrl.planner.cost.corrections` play that part.

- ``matmul_efficiency``: the fraction of the dense bf16 rate that training and scoring passes reach (model FLOPs
  utilisation of well-tuned large-model training). Passes are priced at ``matmul_flops · matmul_efficiency``.
- ``fp8_matmul_flops`` / ``fp8_efficiency``: the same for FP8 passes (0 where the GPU has no FP8 tensor cores).
- ``moe_efficiency``: a mixture-of-experts model's utilisation relative to a dense one on the same GPU, for
  experts of 4096 × 1536 or larger (grouped GEMMs of smaller experts run less efficiently: ``√(size/that)``);
  token routing and all-to-all are inside the measured figure.
- ``decode_bw_efficiency`` and ``decode_step_s``: a serving engine's decode step reads weights and KV cache at
  ``mem_bandwidth · decode_bw_efficiency`` and adds ``decode_step_s`` (scheduling, sampling, launches that
  CUDA graphs do not hide) to every step; its tensor-parallel all-reduces are priced apart (``link_latency``).
- ``intra_bus_efficiency``: NCCL's bus bandwidth over NVLink (nccl-tests ``busbw``) as a fraction of the link's.

The ``local`` entry is a *nominal* CPU slot (about one core of a recent x86 machine): deterministic, so a
seeded plan search on CPU is reproducible. Measure the current machine with
:func:`loomrl.planner.calibrate_local` and pass that profile instead when timings matter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypedDict

from loomrl.errors import ConfigError, DataError

__all__ = ["GB", "PROFILES", "HardwareProfile", "load_profile"]

GB = 2**30
"""Bytes in the "GB" of every memory figure here (device datasheets' 80 GB are 80 × 2^30 bytes)."""

_MAY_BE_ZERO = ("fp8_matmul_flops", "decode_step_s")
"""Profile figures that may be 0 (a capability the device lacks, an overhead it does not have)."""

TFLOPS = 1e12
GBPS = 1e9  # decimal GB/s, as datasheets print bandwidth


@dataclass(frozen=True)
class HardwareProfile:
    """What one device of a cluster can do; every rate is per device."""

    name: str
    """Profile name, a key of :data:`PROFILES` (``local`` for a measured machine)."""
    matmul_flops: float
    """Dense matmul rate in FLOP/s at the training dtype (bf16 on GPUs, fp32 on CPU)."""
    mem_bandwidth: float
    """Device memory bandwidth in bytes/s (HBM on GPUs, DRAM share on CPU)."""
    memory_bytes: float
    """Device memory in bytes."""
    intra_node_bw: float
    """Bytes/s one device sends (or receives) to devices of its own node, one direction."""
    inter_node_bw: float
    """Bytes/s one device sends (or receives) to devices of other nodes, one direction."""
    devices_share_cores: int = 1
    """Devices that share one core (CPU worker slots outnumbering the cores); 1 when each device has its own
    compute, as accelerators do. Above 1, the cost model slows a call that keeps more devices of a node busy
    than the node has cores (see ``CostModel``)."""
    link_latency: float = 10e-6
    """Seconds of start-up per message of a collective or point-to-point transfer."""
    async_launch: bool = True
    """Whether the host queues operators ahead of the device (CUDA streams), so launches overlap the device's
    work and a pass takes the longer of the two; False where dispatch and work are one thread (eager CPU),
    so they add up."""
    op_overhead: float = 5e-6
    """Seconds to dispatch one operator, however small: a kernel launch on a GPU (~5 µs through the CUDA
    runtime and PyTorch's dispatcher), an eager operator call on a CPU (measured by ``calibrate_local``). It
    bounds small models and decode steps, where thousands of operators each do little work."""
    host_bw: float = 32 * GBPS
    """Bytes/s from pinned host memory to one device (one direction of its PCIe link): what reloading an
    offloaded frozen role costs before each of its calls."""
    host_offload: bool = True
    """Whether the runtime offloads frozen roles to host memory on these devices (between their calls, when
    the plan says so). False for CPU devices, which are their own host: offloading would free nothing."""
    matmul_efficiency: float = 1.0
    """Fraction of ``matmul_flops`` training and scoring passes reach (see the module docstring)."""
    fp8_matmul_flops: float = 0.0
    """Dense FP8 matmul rate in FLOP/s; 0 where the device has none (FP8 then runs at the bf16 rate)."""
    fp8_efficiency: float = 1.0
    """Fraction of ``fp8_matmul_flops`` FP8 passes reach."""
    moe_efficiency: float = 1.0
    """A mixture-of-experts model's utilisation relative to a dense one's, for large experts (module docstring)."""
    decode_bw_efficiency: float = 1.0
    """Fraction of ``mem_bandwidth`` a serving engine's decode steps reach reading weights and KV cache."""
    decode_step_s: float = 0.0
    """Seconds every decode step of a serving engine adds (scheduling, sampling, launches)."""
    intra_bus_efficiency: float = 1.0
    """NCCL bus bandwidth within a node as a fraction of ``intra_node_bw``."""
    host_adam_rate: float = 2e9
    """Parameters per second one node's CPUs update with Adam (optimizer state offloaded to host memory)."""
    system_factor: float = 1.0
    """The one stated global factor of this GPU kind: every time the cost model gives is multiplied by it. It is
    how much slower published RL systems on this GPU ran than the rest of the profile predicts, taken over all of
    :mod:`benchmarks.published_runs`' complete rows of the kind together (never per run); 1 where none is
    published, and on CPU, where fitted corrections play that part."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "async_launch", "host_offload"):
                continue
            low_ok = f.name in _MAY_BE_ZERO and value == 0
            if not (isinstance(value, (int, float)) and (value > 0 or low_ok) and math.isfinite(value)):
                what = "non-negative" if f.name in _MAY_BE_ZERO else "positive"
                raise ConfigError(f"profile {self.name}.{f.name}: {value!r} is not a {what} finite number")
        for name in (
            "matmul_efficiency",
            "fp8_efficiency",
            "moe_efficiency",
            "decode_bw_efficiency",
            "intra_bus_efficiency",
        ):
            if getattr(self, name) > 1.0:
                raise ConfigError(
                    f"profile {self.name}.{name}: {getattr(self, name)!r} is above 1 (a fraction of peak)"
                )
        if not isinstance(self.devices_share_cores, int):
            raise ConfigError(
                f"profile {self.name}.devices_share_cores: {self.devices_share_cores!r} is not an integer"
            )


class _Decode(TypedDict):
    """A GPU's serving-engine decode figures, as :class:`HardwareProfile` keywords."""

    decode_bw_efficiency: float
    decode_step_s: float


class _Architecture(TypedDict, total=False):
    """Efficiencies shared by the GPUs of one architecture, as :class:`HardwareProfile` keywords."""

    matmul_efficiency: float
    fp8_efficiency: float
    moe_efficiency: float
    intra_bus_efficiency: float
    host_adam_rate: float


class _Figures(_Architecture, _Decode):
    """An architecture's efficiencies with its decode figures."""


# A serving engine's decode on each GPU, from vLLM's CI latency tests (buildkite.com/vllm/performance-benchmark):
# batch 8, 32 prompt + 128 generated tokens, Llama-3.1-8B at tp1 and Llama-3-70B at tp4. A decode step reads the
# weights (16.1 GB; 35.3 GB per GPU at tp4) at mem_bandwidth · η and adds a fixed step time f, plus at tp4 its 160
# all-reduces at 2 · link_latency each: the two times give η and f (two equations, two unknowns).
_H200_DECODE: _Decode = dict(
    # builds 9513/9515, H200: 834 ms and 2075 ms → η = 0.615, f = 1.07 ms
    decode_bw_efficiency=0.615,
    decode_step_s=1.07e-3,
)
_H100_DECODE: _Decode = dict(
    # build 9555, 8×H100: 997.5 ms and 2444.5 ms → η = 0.707, f = 1.00 ms
    decode_bw_efficiency=0.707,
    decode_step_s=1.0e-3,
)
_A100_DECODE: _Decode = dict(
    # build 9523, A100-SXM4-80GB: 1579 ms and 3991 ms. The two give f < 0 (the tp4 step costs more than its
    # all-reduces' start-up explains), so f is the H100's 1.00 ms (host-side scheduling and sampling) and η comes
    # from the tp1 time: 0.696; the tp4 time is then predicted 7% short (3720 ms)
    decode_bw_efficiency=0.696,
    decode_step_s=1.0e-3,
)

# Efficiencies from public measurements, shared by the GPUs of one architecture (module docstring):
_HOPPER: _Architecture = dict(
    # Megatron-LM README (github.com/NVIDIA/Megatron-LM): "up to 47% Model FLOP Utilization (MFU) on H100 clusters"
    matmul_efficiency=0.47,
    # Megatron-Bridge docs/performance-summary.md, DGX-H100, FP8-CS: Llama3 8B 744 and 70B 719 model TFLOP/s/GPU
    # of the 1979 dense FP8 → 0.37
    fp8_efficiency=0.37,
    # the same table: Qwen3-235B-A22B 233 TFLOP/s/GPU against dense Llama3 70B's 719 (FP8-CS) → 0.32; Qwen3-30B-A3B
    # (experts 2048 × 768, a quarter of the size) 121 against Llama3 8B's 744 → 0.16 = 0.32 · √(1/4)
    moe_efficiency=0.32,
    # nccl-tests all_reduce busbw on 8×H100 SXM NVLink: 460–480 GB/s (docs.alayanew.com/en/docs/tech-blog/
    # 2026-05-06-nccl-tests), at or above the 450 GB/s link: the ring model at the link rate holds
    intra_bus_efficiency=1.0,
    # no published CPU-Adam rate was found: Adam is bound by host memory (about 28 bytes read and written per fp32
    # parameter with its moments and gradient); ~200 GB/s of a two-socket host's DRAM, half of it used → 4e9/s
    host_adam_rate=4e9,
)
_AMPERE: _Architecture = dict(
    # Narayanan et al., SC'21 (arXiv:2104.04473) Table 1, Megatron-LM on A100s, FLOPs counting the recomputed
    # forward: models of 1.7B-76B parameters reach 135-142 TFLOP/s per GPU (43-46% of the 312 peak; 7.5B: 142,
    # 76B: 140); only the 145B-1T models reach 47-52%. RL systems train 7B-70B models: 0.45
    matmul_efficiency=0.45,
    # no MoE figure of this architecture was found: Hopper's is taken, stated as such
    moe_efficiency=0.32,
    # nccl-tests all_reduce busbw on 8×A100 SXM4 NVLink: 230–250 GB/s of the 300 GB/s link (same source as Hopper)
    intra_bus_efficiency=0.8,
    host_adam_rate=4e9,
)
_BLACKWELL: _Figures = dict(
    # Megatron-Bridge docs/performance-summary.md, DGX-GB200: Llama3 70B FP8-CS 1937 model TFLOP/s/GPU of 5000 dense
    # FP8 → 0.39; no dense BF16 row is published, the same fraction is taken for BF16 (stated assumption)
    matmul_efficiency=0.39,
    fp8_efficiency=0.39,
    # the same table: Qwen3-235B-A22B BF16 728 TFLOP/s/GPU of 2500 → 0.29, relative to the dense 0.39 → 0.75
    moe_efficiency=0.75,
    # no Blackwell serving figure was found: the H200's decode efficiency and step time are taken (stated)
    **_H200_DECODE,
    intra_bus_efficiency=1.0,
    host_adam_rate=4e9,
)

# Where each figure that is not a datasheet number comes from, in a few words (the comments above cite them in
# full); `loomrl plan` prints them in its header, so a plan says what it applied.
_VLLM_CI = "vLLM CI latency tests, Llama-3.1-8B tp1 / Llama-3-70B tp4"
_HOPPER_SOURCES = {
    "matmul_efficiency": "Megatron-LM README: up to 47% MFU on H100 clusters",
    "fp8_efficiency": "Megatron-Bridge performance summary: DGX-H100 FP8 Llama3 8B/70B",
    "moe_efficiency": "Megatron-Bridge performance summary: Qwen3-235B-A22B against Llama3 70B",
    "intra_bus_efficiency": "nccl-tests all_reduce busbw, 8xH100 NVLink",
    "host_adam_rate": "assumed: host-DRAM bound Adam (no published rate)",
}
_AMPERE_SOURCES = {
    "matmul_efficiency": "Narayanan et al. SC'21 Table 1: Megatron-LM 1.7B-76B on A100",
    "moe_efficiency": "assumed: Hopper's (no Ampere MoE figure found)",
    "intra_bus_efficiency": "nccl-tests all_reduce busbw, 8xA100 NVLink",
    "host_adam_rate": "assumed: host-DRAM bound Adam (no published rate)",
}
_BLACKWELL_SOURCES = {
    "matmul_efficiency": "assumed: the FP8 fraction (no dense BF16 row published)",
    "fp8_efficiency": "Megatron-Bridge performance summary: DGX-GB200 FP8 Llama3 70B",
    "moe_efficiency": "Megatron-Bridge performance summary: GB200 Qwen3-235B-A22B BF16",
    "intra_bus_efficiency": "assumed: the NVLink 5 link rate",
    "host_adam_rate": "assumed: host-DRAM bound Adam (no published rate)",
}


def _decode_sources(source: str) -> dict[str, str]:
    return {"decode_bw_efficiency": source, "decode_step_s": source}


_FACTOR_SOURCE = "fitted: benchmarks/published_runs.py's complete {rows} rows together (geometric mean)"
FIGURE_SOURCES: dict[str, dict[str, str]] = {
    "a100-80g": {**_AMPERE_SOURCES, **_decode_sources(f"{_VLLM_CI}, A100 (step time: the H100's)")},
    "a800": {**_AMPERE_SOURCES, **_decode_sources("assumed: the A100's (same die and HBM2e)")},
    "h100-80g": {
        **_HOPPER_SOURCES,
        **_decode_sources(f"{_VLLM_CI}, H100"),
        "system_factor": _FACTOR_SOURCE.format(rows="H100 (NeMo RL GRPO)"),
    },
    "h800": {**_HOPPER_SOURCES, **_decode_sources("assumed: the H100's (same die and HBM3)")},
    "h200": {**_HOPPER_SOURCES, **_decode_sources(f"{_VLLM_CI}, H200")},
    "h20": {**_HOPPER_SOURCES, **_decode_sources("assumed: the H200's (no H20 serving figure found)")},
    "gb200": {
        **_BLACKWELL_SOURCES,
        **_decode_sources("assumed: the H200's (no Blackwell serving figure found)"),
        "system_factor": _FACTOR_SOURCE.format(rows="GB200 (NeMo RL GRPO)"),
    },
}
"""Profile name → figure → its source, for every figure of the profile that is not a datasheet number."""

STATED_FIGURES: tuple[str, ...] = (
    "matmul_efficiency",
    "fp8_efficiency",
    "moe_efficiency",
    "decode_bw_efficiency",
    "decode_step_s",
    "intra_bus_efficiency",
    "host_adam_rate",
    "system_factor",
)
"""The profile's figures that are not datasheet numbers (efficiencies, rates, the global factor)."""


def stated_figures(profile: HardwareProfile, origin: str | None = None) -> list[tuple[str, float, str]]:
    """``(figure, value, source)`` for each figure of ``profile`` that is not a datasheet number and is not its
    neutral default; ``origin`` (a file the profile was read from) is the source of all of them when given."""
    defaults = {f.name: f.default for f in fields(HardwareProfile)}
    sources = FIGURE_SOURCES.get(profile.name, {})
    out = []
    for name in STATED_FIGURES:
        value = getattr(profile, name)
        if value == defaults[name]:
            continue
        out.append((name, value, origin or sources.get(name, "profile default (no published source)")))
    return out


PROFILES: dict[str, HardwareProfile] = {
    "a100-80g": HardwareProfile(
        "a100-80g",
        matmul_flops=312 * TFLOPS,  # A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)
        mem_bandwidth=2039 * GBPS,  # A100 80GB SXM datasheet: HBM2e 2,039 GB/s
        memory_bytes=80 * GB,  # A100 80GB
        intra_node_bw=300 * GBPS,  # NVLink 3: 600 GB/s bidirectional per GPU → 300 GB/s each way
        inter_node_bw=25 * GBPS,  # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU
        host_bw=32 * GBPS,  # A100 datasheet: PCIe Gen4 64 GB/s (both directions) → 32 GB/s host to device
        **_A100_DECODE,
        **_AMPERE,
    ),
    "a800": HardwareProfile(
        "a800",
        matmul_flops=312 * TFLOPS,  # the A100's GA100: same compute (tweakers.net/nieuws/203182, after Reuters)
        mem_bandwidth=2039 * GBPS,  # the A100 80GB's HBM2e
        memory_bytes=80 * GB,
        intra_node_bw=200 * GBPS,  # NVLink cut to 400 GB/s bidirectional (same source) → 200 GB/s each way
        inter_node_bw=25 * GBPS,  # one 200 Gb/s HDR NIC per GPU, as DGX A100
        host_bw=32 * GBPS,  # PCIe Gen4, as A100
        # the A100's die and HBM2e: its decode figures
        **_A100_DECODE,
        **_AMPERE,
    ),
    "h100-80g": HardwareProfile(
        "h100-80g",
        matmul_flops=989 * TFLOPS,  # H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity → 989 dense
        mem_bandwidth=3350 * GBPS,  # H100 SXM datasheet: HBM3 3.35 TB/s
        memory_bytes=80 * GB,  # H100 SXM 80GB
        intra_node_bw=450 * GBPS,  # NVLink 4: 900 GB/s bidirectional per GPU → 450 GB/s each way
        inter_node_bw=50 * GBPS,  # DGX H100: one 400 Gb/s NDR ConnectX-7 NIC per GPU
        host_bw=64 * GBPS,  # H100 SXM datasheet: PCIe Gen5 128 GB/s (both directions) → 64 GB/s each way
        fp8_matmul_flops=1979 * TFLOPS,  # H100 SXM datasheet: FP8 3,958 TFLOPS with sparsity → 1,979 dense
        # the stated global factor: benchmarks/published_runs.py's six complete H100 rows (NeMo RL v0.4 and v0.5
        # GRPO) ran 1/0.753 of the times predicted with the efficiencies above (geometric mean, all six together)
        system_factor=1.33,
        **_H100_DECODE,
        **_HOPPER,
    ),
    "h800": HardwareProfile(
        "h800",
        matmul_flops=989 * TFLOPS,  # the H100's die (philisun.com, "NVIDIA H800 vs H100"): same BF16 rate
        mem_bandwidth=3350 * GBPS,  # H100 SXM's HBM3
        memory_bytes=80 * GB,
        intra_node_bw=200 * GBPS,  # NVLink cut to 400 GB/s bidirectional (same source) → 200 GB/s each way
        inter_node_bw=50 * GBPS,  # one 400 Gb/s NIC per GPU, as DGX H100
        host_bw=64 * GBPS,  # PCIe Gen5, as H100
        fp8_matmul_flops=1979 * TFLOPS,  # the H100's FP8 rate
        # the H100's die and HBM3: its decode figures
        **_H100_DECODE,
        **_HOPPER,
    ),
    "h200": HardwareProfile(
        "h200",
        matmul_flops=989 * TFLOPS,  # H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity → 989 dense
        mem_bandwidth=4800 * GBPS,  # H200 SXM datasheet: HBM3e 4.8 TB/s
        memory_bytes=141 * GB,  # H200 SXM: 141 GB
        intra_node_bw=450 * GBPS,  # NVLink 4: 900 GB/s bidirectional per GPU → 450 GB/s each way
        inter_node_bw=50 * GBPS,  # HGX H200: one 400 Gb/s NDR NIC per GPU
        host_bw=64 * GBPS,  # H200 SXM datasheet: PCIe Gen5 128 GB/s (both directions) → 64 GB/s each way
        fp8_matmul_flops=1979 * TFLOPS,  # H200 SXM datasheet: FP8 3,958 TFLOPS with sparsity → 1,979 dense
        **_H200_DECODE,
        **_HOPPER,
    ),
    "h20": HardwareProfile(
        "h20",
        matmul_flops=148 * TFLOPS,  # H20 datasheet: BF16/FP16 Tensor Core 148 TFLOPS (dense)
        mem_bandwidth=4000 * GBPS,  # H20 datasheet: HBM3 4.0 TB/s
        memory_bytes=96 * GB,  # H20: 96 GB HBM3
        intra_node_bw=450 * GBPS,  # H20 datasheet: NVLink 900 GB/s bidirectional → 450 GB/s each way
        inter_node_bw=50 * GBPS,  # HGX H20 deployments: one 400 Gb/s NIC per GPU
        host_bw=64 * GBPS,  # H20 datasheet: PCIe Gen5 x16 128 GB/s (both directions) → 64 GB/s each way
        fp8_matmul_flops=296 * TFLOPS,  # H20 datasheet: FP8 296 TFLOPS (dense)
        # no H20 serving figure was found: the H200's (HBM3, 4.0 TB/s is nearer its 4.8 than the H100's 3.35)
        **_H200_DECODE,
        **_HOPPER,
    ),
    "gb200": HardwareProfile(
        "gb200",
        # B200 in GB200, per GPU (glennklockwood.com/garden/processors/B200, from NVIDIA's Blackwell datasheet):
        matmul_flops=2500 * TFLOPS,  # BF16 2,500 TFLOPS dense (5,000 with sparsity)
        mem_bandwidth=8000 * GBPS,  # HBM3e 8 TB/s
        memory_bytes=186 * GB,  # GB200 NVL72: 13.4 TB HBM3e over 72 GPUs
        intra_node_bw=900 * GBPS,  # NVLink 5: 1.8 TB/s bidirectional per GPU, all 72 of a rack in one domain
        inter_node_bw=50 * GBPS,  # one 400 Gb/s NIC per GPU between racks
        host_bw=200 * GBPS,  # NVLink-C2C to the Grace CPU: 900 GB/s per superchip of two GPUs, both directions
        fp8_matmul_flops=5000 * TFLOPS,  # FP8 5,000 TFLOPS dense
        # the stated global factor: the three complete GB200 rows of benchmarks/published_runs.py (NeMo RL v0.5
        # GRPO) ran 1/0.578 of the predicted times (geometric mean, the three together)
        system_factor=1.73,
        **_BLACKWELL,
    ),
    "local": HardwareProfile(
        "local",
        matmul_flops=100e9,  # nominal: one core's fp32 matmul (AVX2/AVX-512 era); calibrate_local measures it
        mem_bandwidth=20 * GBPS,  # nominal DRAM share of one slot
        memory_bytes=24 * GB,  # a CPU slot's share of this machine's RAM
        intra_node_bw=2 * GBPS,  # nominal loopback TCP (gloo) between worker processes
        inter_node_bw=1.25 * GBPS,  # 10 GbE
        link_latency=50e-6,  # loopback TCP round trip / 2, order of magnitude
        op_overhead=10e-6,  # nominal eager operator call of PyTorch on CPU; calibrate_local measures it
        async_launch=False,
        host_offload=False,  # the worker keeps frozen roles resident on CPU devices (offload.py)
    ),
}
"""Profile name → hardware figures: the one table of devices (a cluster's ``profile`` names one)."""


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile saved as JSON (``loomrl calibrate`` writes ``local_profile.json``); one-line errors name the
    file and the field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read a hardware profile ({err})") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: cannot read a hardware profile (not UTF-8 text)") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise DataError(f"{path}: cannot read a hardware profile (JSON nested too deeply)") from None
    names = [f.name for f in fields(HardwareProfile)]
    if not isinstance(data, dict) or set(data) - set(names) or "name" not in data:
        raise DataError(
            f"{path}: a hardware profile is a JSON object with keys {', '.join(names)} (as `loomrl calibrate` writes)"
        )
    try:
        return HardwareProfile(**data)
    except (TypeError, ConfigError) as err:
        raise DataError(f"{path}: {err}") from None
