"""Starting and stopping Ray: the one place the runtime reads environment variables.

The embedded default starts a private local Ray instance (dashboard off, nothing to join); ``ray_address``
(or ``RAY_ADDRESS``) joins an existing cluster instead. Whoever starts Ray stops it.
"""

from __future__ import annotations

import os

import ray


def start_ray(address: str | None, num_cpus: int) -> bool:
    """Connect to Ray; returns whether this call started a local instance (and so must shut it down)."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    return True


def is_local(address: str | None) -> bool:
    return not (address or os.environ.get("RAY_ADDRESS"))


def stop_ray(started: bool) -> None:
    if started and ray.is_initialized():
        ray.shutdown()
