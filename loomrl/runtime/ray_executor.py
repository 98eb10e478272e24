"""The Ray executor: a controller that moves metadata, and one worker per device that moves bytes.

The controller walks the workflow in order. For each MFC it splits the batch's sample ids over the
data-parallel ranks of the role's layout (balanced by tokens; for train MFCs by the same per-step schedule as
the reference executor), tells every worker of the mesh which rows to process and where their inputs are
(Ray object references to other workers' output shards), and gets back only metadata: the references to the
new shards, per-sample token counts, scalar statistics and timings. Every value a worker returns is checked:
a tensor arriving at the controller is an error.

Failures surface within ``runtime.timeout_s`` as one line naming the worker, its role and the MFC; ``close``
kills every worker and the local Ray instance, also after a failure or an interrupt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from loomrl.config import TrainConfig
from loomrl.errors import LoomError
from loomrl.parallel.allocations import AllocKey
from loomrl.plan import ClusterSpec
from loomrl.launch import available_devices, ray_address, start_ray, stop_ray
from loomrl.runtime.reference import IterationResult, MFCTrace, merge_stats
from loomrl.runtime.placement import execution_plan, runtime_placement, trained_roles
from loomrl.runtime.worker import DeviceWorker, MFCCall
from loomrl.workflow import MFC, MFCKind, Workflow
from loomrl.workflow.batch import Batch
from loomrl.workflow.schedule import split_by_tokens, train_schedule


@dataclass
class _IterationState:
    iteration: int
    ids: list[int]
    where: dict[str, list[tuple[tuple[int, ...], Any]]]
    """Key → output shards holding it: (sample ids, object reference)."""
    tokens: dict[int, int]
    """Sample id → tokens that weight its work (prompt length, then response length once generated)."""


class RuntimeFailure(LoomError):
    """A worker failed, died or stalled; the message names the worker, role and MFC."""


def check_metadata(value: Any, path: str = "result") -> None:
    """The controller accepts scalars, strings, object references and containers of them: never tensors."""
    if isinstance(value, (int, float, str, bool, type(None), ray.ObjectRef)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_metadata(item, f"{path}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_metadata(item, f"{path}[{i}]")
        return
    raise RuntimeError(f"the controller received {type(value).__name__} at {path}; only metadata may reach it")


class RayExecutor:
    """Executes a workflow on ``runtime.devices`` Ray workers (same interface as the reference executor)."""

    def __init__(self, cfg: TrainConfig, workflow: Workflow, tokenizer):
        self.cfg, self.workflow = cfg, workflow
        self.order = workflow.topological_order()
        n = cfg.runtime.devices or available_devices()
        gpu = torch.cuda.is_available() and cfg.runtime.device != "cpu"
        self.cluster = ClusterSpec(nodes=1, devices_per_node=n, device_kind="cuda" if gpu else "cpu")
        self.plan = execution_plan(cfg, workflow, self.cluster)
        self.placement = runtime_placement(self.plan, workflow, self.cluster, cfg, tokenizer)
        self.shadow = set(self.plan.shadow_roles(workflow))
        self.trained = trained_roles(workflow)
        self.versions = {role: 0 for role in workflow.roles()}
        """Train steps each role has taken; a copy of its weights elsewhere is fresh at the same version."""
        self.view_versions: dict[tuple[str, AllocKey], int] = {}
        self.last_use = self._last_uses()
        """MFC after which each copy of a trained role in a non-training layout is freed."""
        self.workers: list[Any] = []
        self.pg = None
        self.received = 0
        self.waited_s = 0.0
        """Time spent waiting for workers; the rest of an iteration is the controller's own work."""
        self.address = ray_address(cfg.runtime.ray_address)
        self._started = start_ray(self.address, num_cpus=n + 1, dashboard=cfg.runtime.ray_dashboard)
        try:
            self._spawn(n, gpu)
        except BaseException:
            self.close()
            raise

    def _last_uses(self) -> dict[str, list[tuple[str, AllocKey]]]:
        last: dict[tuple[str, AllocKey], str] = {}
        for mfc in self.order:
            key = self.placement.mfc_keys[mfc.name]
            if mfc.role in self.trained and key != self.placement.canonical[mfc.role]:
                last[(mfc.role, key)] = mfc.name
        out: dict[str, list[tuple[str, AllocKey]]] = {}
        for view, name in last.items():
            out.setdefault(name, []).append(view)
        return out

    def _free_after(self, mfc: MFC, pending: dict) -> None:
        for role, key in self.last_use.get(mfc.name, ()):
            for device in key.devices:
                pending[self.workers[device].free_view.remote(role, key)] = (f"freeing {role}", role, device)
            self.view_versions[(role, key)] = -1  # stale: the next use reallocates

    def _spawn(self, n: int, gpu: bool) -> None:
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([bundle] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.cfg.runtime.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeFailure(f"runtime.devices: {n} devices could not be reserved within "
                                 f"{self.cfg.runtime.timeout_s:g} s; Ray has {ray.cluster_resources()}") from None
        remote = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0)(DeviceWorker)
        self.workers = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))
            .remote(i, n, self.cfg) for i in range(n)]
        addr = "127.0.0.1" if self.address is None else self._wait(
            [self.workers[0].node_ip.remote()], "setup", None)[0]
        port = self._wait([self.workers[0].free_port.remote()], "setup", None)[0]
        metas = self._wait([w.setup.remote(addr, port, self.placement) for w in self.workers], "setup", None)
        self.pids = [m["pid"] for m in metas]

    # ---------------------------------------------------------------------------------- waiting
    def _wait_one(self, pending: dict, deadline: float) -> tuple[Any, Any]:
        """The next finished call among ``pending`` (ref → (what, role, rank)) and its checked value; a failure,
        death or stall becomes a one-line RuntimeFailure naming the worker, role and call."""
        t0 = time.perf_counter()
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        self.waited_s += time.perf_counter() - t0
        if not ready:
            what, role, _ = next(iter(pending.values()))
            stuck = sorted({rank for _, _, rank in pending.values()})
            raise RuntimeFailure(f"worker(s) {stuck} did not finish {what} (role {role}) within "
                                 f"{self.cfg.runtime.timeout_s:g} s (runtime.timeout_s)")
        ref = ready[0]
        what, role, rank = pending.pop(ref)
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError:
            raise RuntimeFailure(f"worker {rank} died during {what} (role {role})") from None
        except ray.exceptions.RayTaskError as err:
            # A peer that died makes the survivors' collectives fail too: name the dead worker, the root cause.
            self._raise_if_a_peer_died(pending)
            cause = str(err.cause if getattr(err, "cause", None) else err).strip().splitlines()
            named = next((line for line in cause if "failed in MFC" in line), None)
            if named is not None:  # the worker's own one-line account
                raise RuntimeFailure(named) from None
            first = cause[-1] if cause else type(err).__name__
            raise RuntimeFailure(f"worker {rank} failed during {what} (role {role}): {first}") from None
        check_metadata(value)
        self.received += 1
        return ref, value

    def _raise_if_a_peer_died(self, pending: dict, grace_s: float = 5.0) -> None:
        """Give the other calls in flight a moment to report; raise for the first worker found dead."""
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                what, role, rank = pending[ref]
                raise RuntimeFailure(f"worker {rank} died during {what} (role {role})") from None
            except ray.exceptions.RayTaskError:
                continue

    def _wait(self, refs: list, what: str, role: str | None, ranks: Sequence[int] | None = None) -> list:
        """Results of ``refs`` (one per rank), in order."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = {ref: (what, role, rank) for ref, rank in zip(refs, ranks)}
        deadline = time.monotonic() + self.cfg.runtime.timeout_s
        results = {}
        while pending:
            ref, value = self._wait_one(pending, deadline)
            results[ref] = value
        return [results[r] for r in refs]

    # ------------------------------------------------------------------------------ iterations
    def run_iteration(self, iteration: int, batch: Batch) -> IterationResult:
        """Dataflow over the workflow: an MFC is sent the moment its inputs exist, so calls on disjoint
        devices run concurrently; each worker executes its calls in the order they were sent."""
        start, self.waited_s = time.perf_counter(), 0.0
        result = IterationResult()
        source = ray.put(batch)
        state = _IterationState(iteration, list(batch.ids), {k: [(tuple(batch.ids), source)] for k in batch.keys()},
                                {sid: len(p) for sid, p in zip(batch.ids, batch["prompt_ids"])})
        pending: dict = {}
        calls: dict[str, dict] = {}  # MFC → {ref: (rows, publish)} of its calls still running
        done: set[str] = set()
        deadline = time.monotonic() + self.cfg.runtime.timeout_s
        while len(done) < len(self.order):
            for mfc in self.order:
                if mfc.name not in calls and mfc.name not in done and all(d in done for d in self.workflow.deps(mfc.name)):
                    calls[mfc.name] = self._submit(mfc, state, pending)
            ref, meta = self._wait_one(pending, deadline)
            name = next((n for n, c in calls.items() if ref in c), None)
            if name is None:
                continue  # a reallocation finished; the calls after it are already queued behind it
            calls[name][ref] = (*calls[name][ref], meta)
            if all(len(v) == 3 for v in calls[name].values()):
                mfc = self.workflow[name]
                self._finish(mfc, calls.pop(name), state, result)
                done.add(name)
                self._free_after(mfc, pending)
                if mfc.kind == MFCKind.TRAIN and mfc.role in self.shadow:  # sync shadows right after training
                    for m in self.workflow.mfcs_of_role(mfc.role):
                        self._refresh(mfc.role, self.placement.mfc_keys[m.name], pending)
        while pending:  # shadow syncs still in flight
            self._wait_one(pending, deadline)
        keys = ("prompt_ids", "response_ids", "prompt_text", "answer", "score", "kl")
        metrics = self._wait([self.workers[0].metrics.remote(batch.ids, self._inputs(keys, batch.ids, state.where))],
                             "metrics", None)[0]
        merge_stats(result.stats, metrics, "metrics")
        result.stats["time/controller_s"] = time.perf_counter() - start - self.waited_s
        return result

    def _inputs(self, keys: Sequence[str], ids: Sequence[int], where) -> tuple:
        wanted = set(ids)
        refs: list = []
        for key in keys:
            for shard_ids, ref in where[key]:
                if ref not in refs and wanted.intersection(shard_ids):
                    refs.append(ref)
        return tuple(refs)

    def _assignments(self, mfc: MFC, state: "_IterationState") -> dict[int, tuple]:
        """Per device of the MFC's allocation: (sample ids, train steps, publish)."""
        key = self.placement.mfc_keys[mfc.name]
        ids = state.ids
        counts = [state.tokens[s] for s in ids]
        per_dp: list[tuple[tuple[int, ...], tuple]] = []
        if mfc.kind == MFCKind.TRAIN:
            schedule = train_schedule(counts, mfc.epochs, mfc.minibatches, self.cfg.seed, state.iteration, key.dp)
            for d in range(key.dp):
                rows = list(dict.fromkeys(r for step in schedule for r in step.rows_per_rank[d]))
                pos = {r: i for i, r in enumerate(rows)}
                steps = tuple((tuple(pos[r] for r in step.rows_per_rank[d]), step.local(d, counts)[1])
                              for step in schedule)
                per_dp.append((tuple(ids[r] for r in rows), steps))
        else:
            for part in split_by_tokens(range(len(ids)), counts, key.dp):
                per_dp.append((tuple(ids[r] for r in part), ()))
        return {device: (*per_dp[key.coords(device)[1]], key.publishes(device)) for device in key.devices}

    def _refresh(self, role: str | None, key: AllocKey, pending: dict) -> None:
        """Reallocate ``role``'s weights into allocation ``key`` if that copy is older than the weights."""
        if role is None or key == self.placement.canonical[role]:
            return
        if self.view_versions.get((role, key), 0) == self.versions[role]:
            return
        for index, (r, src, dst, _) in enumerate(self.placement.reallocs):
            if r == role and dst == key:
                for device in sorted(set(src.devices) | set(dst.devices)):
                    pending[self.workers[device].reallocate.remote(index)] = (f"reallocation of {role}", role, device)
        self.view_versions[(role, key)] = self.versions[role]

    def _submit(self, mfc: MFC, state: "_IterationState", pending: dict) -> dict:
        self._refresh(mfc.role, self.placement.mfc_keys[mfc.name], pending)
        calls = {}
        for device, (rows, steps, publish) in self._assignments(mfc, state).items():
            call = MFCCall(mfc.name, state.iteration, rows, self._inputs(mfc.inputs, rows, state.where), steps, publish)
            ref = self.workers[device].run_mfc.remote(call)
            pending[ref] = (f"MFC '{mfc.name}'", mfc.role, device)
            calls[ref] = (rows, publish)
        return calls

    def _finish(self, mfc: MFC, calls: dict, state: "_IterationState", result: IterationResult) -> None:
        stats: dict[str, float] = {}
        metas = [meta for _, _, meta in calls.values()]
        for rows, publish, meta in calls.values():
            if not publish:
                continue
            for key, value in meta.get("stats", {}).items():
                stats[key] = stats.get(key, 0.0) + value
            if "shard" in meta:
                for key in mfc.outputs:
                    state.where.setdefault(key, []).append((rows, meta["shard"][0]))
            state.tokens.update({int(k): v for k, v in meta.get("tokens", {}).items()})
        merge_stats(result.stats, stats, mfc.name)
        devices = tuple(sorted(m["rank"] for m in metas))
        result.traces.append(MFCTrace(state.iteration, mfc.name, mfc.role, min(m["start"] for m in metas),
                                      max(m["end"] for m in metas), devices))
        if mfc.kind == MFCKind.TRAIN:
            self.versions[mfc.role] += 1

    # ---------------------------------------------------------------- evaluation, checkpoints, shutdown
    def _eval_key(self) -> AllocKey:
        gen = next(m for m in self.order if m.role == "actor" and m.kind == MFCKind.GENERATE)
        return self.placement.mfc_keys[gen.name]

    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Greedy evaluation with the actor in its generation allocation (refreshed first)."""
        key = self._eval_key()
        pending: dict = {}
        self._refresh("actor", key, pending)
        deadline = time.monotonic() + self.cfg.runtime.timeout_s
        while pending:
            self._wait_one(pending, deadline)
        shares = [list(examples[d::key.dp]) for d in range(key.dp)]
        refs = [self.workers[dev].evaluate.remote(shares[key.coords(dev)[1]], key, key.publishes(dev))
                for dev in key.devices]
        sums: dict[str, float] = {}
        for out in self._wait(refs, "evaluation", "actor", key.devices):
            for name, value in (out or {}).items():
                sums[name] = sums.get(name, 0.0) + value
        return {name: value / len(examples) for name, value in sums.items()}

    def save(self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int) -> Path:
        exports = {}
        for role in sorted(self.trained):
            devices = self.placement.canonical[role].devices
            metas = self._wait([self.workers[d].export_role.remote(role) for d in devices], "checkpoint export",
                               role, devices)
            exports[role] = [m["state"] for m in metas if "state" in m]
        ref = self.workers[0].save.remote(str(run_dir), iteration, dict(state), keep_last, exports)
        return Path(self._wait([ref], "checkpoint save", None)[0])

    def load(self, path: Path) -> dict[str, Any]:
        states = self._wait([w.load.remote(str(path)) for w in self.workers], "checkpoint load", None)
        self.view_versions.clear()  # every other copy of the weights is now stale
        self.versions = {role: v + 1 for role, v in self.versions.items()}
        return states[0]

    def close(self) -> None:
        """Kill every worker and release the devices; stop Ray if this executor started it."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead: nothing left to kill
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        stop_ray(self._started)
        self._started = False
