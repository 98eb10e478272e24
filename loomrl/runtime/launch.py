"""Process-wide settings applied once at every entry point (the CLI, each runtime worker), and Ray start-up.

This is where loomrl reads and sets environment variables: nothing may reach the network (models and
tokenizers are local), and transformers' per-load reports and progress bars stay out of our output.
"""

from __future__ import annotations

import netrc
import os
import socket
from urllib.parse import urlparse

from loomrl.errors import ConfigError


def quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


AUTH_MODE = "RAY_AUTH_MODE"
"""Ray's switch of token authentication (on by default for clusters started by Ray 2.60's ``ray start``)."""


def ray_address(configured: str | None) -> str | None:
    """The Ray cluster to join: the config's address, else ``RAY_ADDRESS`` (what ``ray job submit`` gives its
    driver), else None: a private local instance. Ray's own file of the last ``ray start`` cluster is never
    followed: a cluster is joined only when it is named."""
    return configured or os.environ.get("RAY_ADDRESS") or None


LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}
"""Ray settings of the private local instances loomrl starts. Ray starts its workers at niceness 15 so that its
own services stay responsive; loomrl's workers are the run's compute, and at 15 any ordinary process on the
machine (an editor, a build, another job) takes nearly all the CPU from them (a CFS weight of 36 against 1024):
beside one CPU-bound process a two-worker run slowed many times over. At 0 they share the machine fairly."""


def start_ray(address: str | None, num_cpus: int, dashboard: bool = False) -> bool:
    """Connect to Ray; returns whether this call connected (and so must disconnect: :func:`stop_ray` shuts down
    the local instance it started, or leaves the cluster it joined, which keeps running).

    Without an address this is always a new, private instance on 127.0.0.1 (``address="local"``): a bare
    ``ray.init()`` would follow Ray's file of the last ``ray start`` cluster to a cluster nobody named, or to a
    dead one, with workers at the driver's priority (:data:`LOCAL_SYSTEM_CONFIG`). Token authentication stays on
    (Ray's default). With an address, see :func:`join_cluster` (a cluster keeps its own settings). A driver
    killed before it shuts its instance down leaves nothing behind for long: :mod:`loomrl.runtime.reaper` removes what
    Ray's own processes would leave for a minute.
    """
    import ray

    from loomrl.runtime import reaper

    if ray.is_initialized():
        return False
    if address:
        join_cluster(address)
        return True
    reaper.watch()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        log_to_driver=True,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
        _system_config=LOCAL_SYSTEM_CONFIG,
    )
    return True


def join_cluster(address: str) -> None:
    """Join the Ray cluster at ``address`` as a driver, or fail with one line saying why and what to do.

    A cluster started by ``ray start --head`` (Ray 2.60) requires its token, which a driver presents only in
    token mode: ``RAY_AUTH_MODE=token`` is set here unless the user set the mode (a cluster without
    authentication accepts a token-mode driver too). The token is read from ``~/.ray/auth_token`` or
    ``RAY_AUTH_TOKEN``; a machine other than the head needs a copy. An address where nothing answers fails at
    once instead of after Ray's minutes of retries.
    """
    import ray

    if not os.environ.get(AUTH_MODE):
        os.environ[AUTH_MODE] = "token"
        # Ray reads its settings once, when imported; its own token set-up re-reads them with this (private) call,
        # and there is no public one. Rays older than token authentication have neither the call nor the need.
        try:
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):
            pass
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not address.startswith("ray://") and host and port.isdigit() and not _reachable(host, int(port), 5.0):
        raise ConfigError(
            f"runtime.ray_address: nothing answers at {address} (start the cluster with "
            "`ray start --head --port=PORT` and give its HOST:PORT)"
        )
    token_hint = (
        f"{AUTH_MODE}=token is set: the cluster's token must be in ~/.ray/auth_token or RAY_AUTH_TOKEN "
        "(copy it from the head node's ~/.ray/auth_token)"
    )
    if os.environ.get(AUTH_MODE) == "token" and not _has_ray_token():
        raise ConfigError(
            f"runtime.ray_address: cannot join the Ray cluster at {address} without its token; "
            f"{token_hint}, or set {AUTH_MODE}=disabled for a cluster started without authentication"
        )
    try:
        ray.init(address=address, log_to_driver=True)
    except Exception as err:  # noqa: BLE001 — Ray raises ConnectionError, AuthenticationError, RuntimeError...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        hint = "" if os.environ.get(AUTH_MODE) != "token" else f"; {token_hint}"
        raise ConfigError(f"runtime.ray_address: cannot join the Ray cluster at {address} ({first}){hint}") from None


def _has_ray_token() -> bool:
    """Whether a Ray auth token is where Ray looks: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or
    ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return os.path.isfile(path) and os.path.getsize(path) > 0


def stop_ray(connected: bool) -> None:
    """Undo :func:`start_ray`: shut down the instance it started, or leave the cluster it joined."""
    import ray

    if connected and ray.is_initialized():
        ray.shutdown()


def local_cluster(devices: int, device: str):
    """The cluster the runtime runs on here: ``devices`` workers (0: :func:`~loomrl.role.devices.available_devices`) on
    one node,
    GPUs when there are any and ``device`` does not ask for the CPU."""
    import torch

    from loomrl.plan.cluster import ClusterSpec
    from loomrl.role.devices import available_devices

    gpu = torch.cuda.is_available() and device != "cpu"
    return ClusterSpec(nodes=1, devices_per_node=devices or available_devices(), device_kind="cuda" if gpu else "cpu")


def runtime_cluster(devices: int, device: str, address: str | None):
    """The cluster a run's workers get: on this machine without an address; with one, counted from the joined
    cluster's resources (its alive nodes' GPUs, or CPUs where it has none), not from the driver's machine."""
    if address is None:
        return local_cluster(devices, device)
    import ray

    connected = start_ray(address, 0)
    try:
        nodes = [{"alive": n.get("Alive", False), "resources": n.get("Resources", {})} for n in ray.nodes()]
    finally:
        stop_ray(connected)  # the executor connects again: its connection is the one it closes
    return cluster_from_nodes(nodes, devices, device, address)


def cluster_from_nodes(nodes: list[dict], devices: int, device: str, where: str = "the Ray cluster"):
    """The devices of a Ray cluster's nodes (``{"alive": bool, "resources": {"CPU": n, "GPU": m}}``): GPUs when
    any node has one (unless ``device`` is cpu), else CPUs; ``devices`` of them (0: all), on as few nodes as
    they fill, ``devices_per_node`` being the smallest node's count (devices are numbered node-major)."""
    from loomrl.plan.cluster import ClusterSpec

    alive = [n["resources"] for n in nodes if n.get("alive", True)]
    gpu = device != "cpu" and any(r.get("GPU", 0) >= 1 for r in alive)
    if device == "cuda" and not gpu:
        raise ConfigError(f"runtime.device: 'cuda' requested but {where} has no GPUs (valid there: auto, cpu)")
    kind = "GPU" if gpu else "CPU"
    counts = [int(r.get(kind, 0)) for r in alive if int(r.get(kind, 0)) >= 1]
    if not counts:
        raise ConfigError(f"runtime.ray_address: {where} has no node with a {kind} to run workers on")
    per_node = min(counts)
    if devices == 0:
        return ClusterSpec(nodes=len(counts), devices_per_node=per_node, device_kind="cuda" if gpu else "cpu")
    if devices <= per_node:
        return ClusterSpec(nodes=1, devices_per_node=devices, device_kind="cuda" if gpu else "cpu")
    if devices % per_node or devices // per_node > len(counts):
        raise ConfigError(
            f"runtime.devices: {devices} does not fill whole nodes of {where} ({len(counts)} nodes "
            f"of {per_node} {kind}s; valid: up to {per_node}, or a multiple of it up to "
            f"{per_node * len(counts)}, or 0 for all)"
        )
    return ClusterSpec(nodes=devices // per_node, devices_per_node=per_node, device_kind="cuda" if gpu else "cpu")


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
