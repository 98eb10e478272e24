"""The devices a plan is made for: nodes × devices per node, their kind and hardware profile.

A cluster is written ``KIND:DEVICES`` (one node) or ``KIND:NODESxDEVICES``::

    cpu:2        one node, two CPU device slots (the local profile)
    cpu:1x4      one node, four slots
    h100:8x8     eight nodes of eight H100s (profile h100-80g)
    gb200:1x72   one GB200 NVL72 rack: 72 GPUs in one NVLink domain, which is what a "node" means here

Devices are numbered globally, node-major: device ``d`` sits on node ``d // devices_per_node``. A profile
names the hardware (:data:`loomrl.plan.hardware.PROFILES`): its memory per device is the cluster's default
``memory_gb``, and its rates are what the cost model prices the devices with (:func:`profile_for`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from loomrl.config.tools import ValidatedConfig, fail, spec
from loomrl.errors import ConfigError
from loomrl.plan.hardware import GB, PROFILES, HardwareProfile

__all__ = ["DEVICE_KINDS", "ClusterSpec", "profile_for"]

DEVICE_KINDS: dict[str, str] = {
    "cpu": "local",
    "a100": "a100-80g",
    "a800": "a800",
    "h100": "h100-80g",
    "h800": "h800",
    "h200": "h200",
    "h20": "h20",
    "gb200": "gb200",
}
"""Device kind accepted by :meth:`ClusterSpec.parse` → its profile (profile names are accepted as kinds too)."""

_CLUSTER_RE = re.compile(r"(?P<kind>[A-Za-z][\w-]*):(?:(?P<nodes>\d+)x)?(?P<devices>\d+)")


@dataclass(frozen=True)
class ClusterSpec(ValidatedConfig):
    """``nodes`` × ``devices_per_node`` devices of one kind; devices are numbered node-major from 0."""

    nodes: int = spec(ge=1)
    """Machines in the cluster."""
    devices_per_node: int = spec(ge=1)
    """Accelerators (or CPU worker slots) per machine."""
    device_kind: str = "cpu"
    """What a device is: cpu, a100, a800, h100, h800, h200, h20, gb200."""
    profile: str = spec("local", choices=tuple(PROFILES))
    """Hardware profile (:data:`loomrl.plan.hardware.PROFILES`) the cost model prices the devices with."""
    memory_gb: float = spec(24.0, gt=0)
    """Memory per device in GB (2^30 bytes); plans that need more are rejected."""

    def validate(self) -> None:
        if not self.device_kind:
            fail("device_kind", f"'' is empty; e.g. {', '.join(DEVICE_KINDS)}")

    @property
    def n_devices(self) -> int:
        """Devices in the whole cluster."""
        return self.nodes * self.devices_per_node

    @property
    def offloads(self) -> bool:
        """Whether a device's memory is its own, so that moving a model to host memory frees some (not on CPU
        devices, whose memory is the host's: the plan's offloaded roles stay resident there)."""
        return self.device_kind != "cpu"

    def node_of(self, device: int) -> int:
        """The node holding global device index ``device``."""
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < self.n_devices:
            raise ConfigError(f"device {device!r} is outside the cluster {self} (devices 0-{self.n_devices - 1})")
        return device // self.devices_per_node

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """``"cpu:2"``, ``"cpu:1x4"``, ``"h100:8x8"`` → a cluster with the kind's profile and memory."""
        match = _CLUSTER_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(f"cluster {text!r}: expected KIND:DEVICES or KIND:NODESxDEVICES, e.g. cpu:2 or h100:8x8")
        kind = match["kind"].lower()
        profile = DEVICE_KINDS.get(kind, kind if kind in PROFILES else None)
        if profile is None:
            valid = ", ".join([*DEVICE_KINDS, *(p for p in PROFILES if p not in DEVICE_KINDS)])
            raise ConfigError(f"cluster {text!r}: unknown device kind '{kind}'; valid: {valid}")
        nodes, devices = int(match["nodes"] or 1), int(match["devices"])
        if nodes < 1 or devices < 1:
            raise ConfigError(f"cluster {text!r}: needs at least one node and one device per node")
        return cls(nodes, devices, kind, profile, PROFILES[profile].memory_bytes / GB)

    def __str__(self) -> str:
        return f"{self.device_kind}:{self.nodes}x{self.devices_per_node}"


def profile_for(cluster: ClusterSpec) -> HardwareProfile:
    """The profile a cluster names, with its memory set to the cluster's ``memory_gb`` (which may override
    the datasheet figure, e.g. to leave room for a framework's reserve)."""
    profile = PROFILES.get(cluster.profile)
    if profile is None:
        raise ConfigError(f"cluster.profile: unknown profile '{cluster.profile}'; valid: {', '.join(PROFILES)}")
    return replace(profile, memory_bytes=cluster.memory_gb * GB)
