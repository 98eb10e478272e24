"""Hardware profiles: the rates and sizes the cost model prices a device with.

Every figure of an accelerator profile is the vendor's datasheet number for the SXM part, cited next to it.
Two conventions matter when reading them:

- ``matmul_flops`` is the *dense* bf16 tensor-core rate. Datasheets headline the 2:4-sparse rate, twice the
  dense one; the cost model never assumes sparsity.
- ``intra_node_bw`` is what one device can push in *one direction* over NVLink. Datasheets give the
  bidirectional total (e.g. "900 GB/s"), so the profile holds half. ``inter_node_bw`` is one NIC per device,
  again one direction (400 Gb/s NDR = 50 GB/s).

Memory sizes are in the 2^30-byte "GB" of :data:`loomrl.plan.GB`, as elsewhere in the plan code. Bandwidths
and rates are decimal (10^9, 10^12), as datasheets print them.

``link_latency`` is not a datasheet figure: it is the per-message start-up cost of a collective (NCCL over
NVLink is ~10 µs for small messages; the loopback TCP transport gloo uses on one machine is measured by
:func:`loomrl.planner.calibrate_local`). It matters for decode, where every step runs two all-reduces per
layer of a few kilobytes each. ``op_overhead`` (one operator's dispatch) is not a datasheet figure either: it
is the launch cost that bounds decode steps and small models.

The ``local`` entry is a *nominal* CPU slot (about one core of a recent x86 machine): deterministic, so a
seeded plan search on CPU is reproducible. Measure the current machine with
:func:`loomrl.planner.calibrate_local` and pass that profile instead when timings matter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from loomrl.errors import ConfigError, DataError
from loomrl.plan import GB, ClusterSpec

__all__ = ["PROFILES", "HardwareProfile", "load_profile", "profile_for"]

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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "async_launch", "host_offload") and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"profile {self.name}.{f.name}: {value!r} is not a positive finite number")
        if not isinstance(self.devices_share_cores, int):
            raise ConfigError(f"profile {self.name}.devices_share_cores: {self.devices_share_cores!r} is not an "
                              "integer")


PROFILES: dict[str, HardwareProfile] = {
    "a100-80g": HardwareProfile(
        "a100-80g",
        matmul_flops=312 * TFLOPS,  # A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)
        mem_bandwidth=2039 * GBPS,  # A100 80GB SXM datasheet: HBM2e 2,039 GB/s
        memory_bytes=80 * GB,  # A100 80GB
        intra_node_bw=300 * GBPS,  # NVLink 3: 600 GB/s bidirectional per GPU → 300 GB/s each way
        inter_node_bw=25 * GBPS,  # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU
        host_bw=32 * GBPS,  # A100 datasheet: PCIe Gen4 64 GB/s (both directions) → 32 GB/s host to device
    ),
    "h100-80g": HardwareProfile(
        "h100-80g",
        matmul_flops=989 * TFLOPS,  # H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity → 989 dense
        mem_bandwidth=3350 * GBPS,  # H100 SXM datasheet: HBM3 3.35 TB/s
        memory_bytes=80 * GB,  # H100 SXM 80GB
        intra_node_bw=450 * GBPS,  # NVLink 4: 900 GB/s bidirectional per GPU → 450 GB/s each way
        inter_node_bw=50 * GBPS,  # DGX H100: one 400 Gb/s NDR ConnectX-7 NIC per GPU
        host_bw=64 * GBPS,  # H100 SXM datasheet: PCIe Gen5 128 GB/s (both directions) → 64 GB/s each way
    ),
    "h200": HardwareProfile(
        "h200",
        matmul_flops=989 * TFLOPS,  # H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity → 989 dense
        mem_bandwidth=4800 * GBPS,  # H200 SXM datasheet: HBM3e 4.8 TB/s
        memory_bytes=141 * GB,  # H200 SXM: 141 GB
        intra_node_bw=450 * GBPS,  # NVLink 4: 900 GB/s bidirectional per GPU → 450 GB/s each way
        inter_node_bw=50 * GBPS,  # HGX H200: one 400 Gb/s NDR NIC per GPU
        host_bw=64 * GBPS,  # H200 SXM datasheet: PCIe Gen5 128 GB/s (both directions) → 64 GB/s each way
    ),
    "h20": HardwareProfile(
        "h20",
        matmul_flops=148 * TFLOPS,  # H20 datasheet: BF16/FP16 Tensor Core 148 TFLOPS (dense)
        mem_bandwidth=4000 * GBPS,  # H20 datasheet: HBM3 4.0 TB/s
        memory_bytes=96 * GB,  # H20: 96 GB HBM3
        intra_node_bw=450 * GBPS,  # H20 datasheet: NVLink 900 GB/s bidirectional → 450 GB/s each way
        inter_node_bw=50 * GBPS,  # HGX H20 deployments: one 400 Gb/s NIC per GPU
        host_bw=64 * GBPS,  # H20 datasheet: PCIe Gen5 x16 128 GB/s (both directions) → 64 GB/s each way
    ),
    "local": HardwareProfile(
        "local",
        matmul_flops=100e9,  # nominal: one core's fp32 matmul (AVX2/AVX-512 era); calibrate_local measures it
        mem_bandwidth=20 * GBPS,  # nominal DRAM share of one slot
        memory_bytes=24 * GB,  # same default as loomrl.plan.PROFILES["local"]
        intra_node_bw=2 * GBPS,  # nominal loopback TCP (gloo) between worker processes
        inter_node_bw=1.25 * GBPS,  # 10 GbE
        link_latency=50e-6,  # loopback TCP round trip / 2, order of magnitude
        op_overhead=10e-6,  # nominal eager operator call of PyTorch on CPU; calibrate_local measures it
        async_launch=False,
        host_offload=False,  # the worker keeps frozen roles resident on CPU devices (offload.py)
    ),
}
"""Profile name (as in :data:`loomrl.plan.PROFILES`) → hardware figures."""


def profile_for(cluster: ClusterSpec) -> HardwareProfile:
    """The profile a cluster names, with its memory set to the cluster's ``memory_gb`` (which may override
    the datasheet figure, e.g. to leave room for a framework's reserve)."""
    profile = PROFILES.get(cluster.profile)
    if profile is None:
        raise ConfigError(f"cluster.profile: unknown profile '{cluster.profile}'; valid: {', '.join(PROFILES)}")
    return replace(profile, memory_bytes=cluster.memory_gb * GB)


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile saved as JSON (``loomrl calibrate`` writes ``local_profile.json``); one-line errors name the
    file and the field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read a hardware profile ({err})") from None
    names = [f.name for f in fields(HardwareProfile)]
    if not isinstance(data, dict) or set(data) - set(names) or "name" not in data:
        raise DataError(f"{path}: a hardware profile is a JSON object with keys {', '.join(names)} "
                        "(as `loomrl calibrate` writes)")
    try:
        return HardwareProfile(**data)
    except (TypeError, ConfigError) as err:
        raise DataError(f"{path}: {err}") from None
