"""Process-wide settings applied once at every entry point (the CLI, each runtime worker), and Ray start-up.

This is where loomrl reads and sets environment variables: nothing may reach the network (models and
tokenizers are local), and transformers' per-load reports and progress bars stay out of our output.
"""

from __future__ import annotations

import netrc
import os
import socket
from urllib.parse import urlparse


def quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def ray_address(configured: str | None) -> str | None:
    """The Ray cluster to join: the config's address, else ``RAY_ADDRESS``, else None (start a local one)."""
    return configured or os.environ.get("RAY_ADDRESS") or None


def start_ray(address: str | None, num_cpus: int, dashboard: bool = False) -> bool:
    """Connect to Ray; returns whether this call started a local instance (and so must shut it down).

    The embedded default is a private local instance on 127.0.0.1 with the dashboard off unless asked; Ray's
    token authentication stays on (its default), so even a local instance accepts only this user's processes.
    (Ray 2.60 still binds some services to the machine's interface address; the runtime's own gloo store uses
    127.0.0.1.)
    """
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=True, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    return True


def stop_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()


def available_devices() -> int:
    """GPUs if there are any, else CPU cores: the device count of ``runtime.devices=0``."""
    import torch

    return torch.cuda.device_count() or os.cpu_count() or 1


def local_cluster(devices: int, device: str):
    """The cluster the runtime runs on here: ``devices`` workers (0: :func:`available_devices`) on one node,
    GPUs when there are any and ``device`` does not ask for the CPU."""
    import torch

    from loomrl.plan.cluster import ClusterSpec

    gpu = torch.cuda.is_available() and device != "cpu"
    return ClusterSpec(nodes=1, devices_per_node=devices or available_devices(), device_kind="cuda" if gpu else "cpu")


def wandb_mode(configured: str) -> str | None:
    """The mode wandb runs in for ``report.wandb_mode``: 'online' or 'offline' as configured; for 'auto',
    None when ``WANDB_MODE`` is set (wandb reads it itself), else online when wandb's server answers within
    three seconds and an API key is set (``WANDB_API_KEY`` or a netrc entry), offline otherwise."""
    if configured != "auto":
        return configured
    if os.environ.get("WANDB_MODE"):
        return None
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "api.wandb.ai", url.port or (443 if url.scheme == "https" else 80)
    return "online" if _has_wandb_key(host) and _reachable(host, port, 3.0) else "offline"


def _has_wandb_key(host: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
