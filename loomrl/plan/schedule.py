"""The schedule: the steps an executor runs for one iteration of a workflow under a plan.

A plan says where each model function call (MFC) runs; the schedule says everything that happens around the
calls so that each finds its model where it needs it, derived once from (workflow, plan) by
:func:`build_schedule`. Both executors take it as it is: the simulator prices each step
(:mod:`loomrl.planner.simulation.simulator`), the Ray runtime runs each step on the devices it names
(:mod:`loomrl.runtime.ray_executor`), and the single-process reference executor runs the calls and skips the
rest. Their traces carry the step ids, so a predicted and a measured timeline line up step by step.

Steps (:class:`StepKind`), each with the devices it occupies and the steps of its iteration it waits for:

- ``call``: an MFC on its allocation.
- ``copy``: a trained role's weights resharded from its training allocation into the layout of a call that
  runs elsewhere or otherwise (a reallocation, ReaLHF's). Made before the first call that needs that layout
  in an iteration (once its data dependencies are done) and reused by the role's later calls in the same
  layout until the role trains again.
- ``free``: the copy dropped after the last call that used it: going back to the training layout moves
  nothing, the training shards never left.
- ``sync``: a shadow copy (a separated call's persistent copy, e.g. a generation engine on its own devices)
  refreshed right after the role's train call; the schedule's prologue fills every shadow before the first
  iteration and whenever the weights are replaced (a checkpoint loaded, a plan change).
- ``reload`` / ``offload``: a frozen role the plan keeps in host memory brought back before each of its calls
  and released after it, only where devices have memory of their own (not on CPU devices, whose host memory
  is the device's). A *trained* role the plan offloads moves its training state (weights, gradients,
  optimizer) the other way around each generate call that shares its training devices: out once that
  call's weights are in place (``offload <role> state for <call>``), back once it has ended (``reload <role>
  state after <call>``), as RL systems put their trainers to sleep while the serving engine generates; the
  role's later steps on its training shards wait for the reload.
- ``evaluate``: the between-iterations evaluation of the actor in its generation allocation (with the copy
  and free it needs), listed apart from the iteration's steps.
- ``fused``: with the plan's :class:`~loomrl.plan.plan.StreamFusion`, generation and the inference calls that read
  only its outputs (PPO's reference, reward and critic inference) as one stage, its member call steps inside:
  the inference calls run on finished samples, chunk by chunk, while the tail still generates, and once few
  samples are left the tail migrates onto a few generation replicas so the others can run inference. The
  steps that put the members' models in place run before the stage; those that release them, after it.
- ``fused_train``: with the plan's ``pipeline_fusion``, the two train calls (PPO's actor and critic) as one stage on
  their shared devices, its member call steps inside: each pair of their optimizer steps runs as one fused
  pipeline step (:mod:`loomrl.planner.pipeline_fusion`); what waits for either call waits for the stage.

With the plan's :class:`~loomrl.plan.plan.AsyncTraining` (asynchronous training) the rollout generate calls
(:meth:`~loomrl.workflow.graph.Workflow.rollout_generations`) run on a batch ``max_staleness`` iterations ahead,
so no step of the iteration waits for their data; only for their weights: the role's train call waits for a
generate call that reads its training shards (or for the copy it reads), and the sync that refreshes a shadow
waits for the generate call that reads the shadow. The schedule's ``ahead`` names those calls and its ``fill``
lists the steps that generate a batch ahead on its own (the first iteration's batches before ``max_staleness``).

Iterations run one after another: every step of iteration ``i + 1`` waits for all of iteration ``i``.
Within an iteration a step is sent once its dependencies are done, and every device runs the steps in the
order they were sent; :meth:`Step.sent_with` names the exception, which both executors apply: a call is sent
together with the copy, sync or reload that puts its model in place, and a free or offload together with the
call that last uses the model, each queued right behind it on devices the other already occupies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from loomrl.plan.allocation import Allocation
from loomrl.plan.plan import AsyncTraining, ExecutionPlan, StreamFusion
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = ["Schedule", "Step", "StepKind", "build_schedule"]


class StepKind(str, Enum):
    """What a schedule step does (see the module docstring)."""

    CALL = "call"
    COPY = "copy"
    FREE = "free"
    SYNC = "sync"
    RELOAD = "reload"
    OFFLOAD = "offload"
    EVALUATE = "evaluate"
    STREAM_FUSION = "stream_fusion"
    PIPELINE_FUSION = "pipeline_fusion"


STAGES = (StepKind.STREAM_FUSION, StepKind.PIPELINE_FUSION)
"""Steps that run member call steps as one stage."""


_PUT = (StepKind.COPY, StepKind.SYNC, StepKind.RELOAD)
"""Steps that put a model where a call needs it."""
_USE = (StepKind.CALL, StepKind.EVALUATE)
"""Steps that use a model."""
_DROP = (StepKind.FREE, StepKind.OFFLOAD)
"""Steps that release a model after the calls that used it."""


@dataclass(frozen=True)
class Step:
    """One step of a schedule."""

    id: str
    """Unique within its list: the MFC's name for a call, e.g. ``"copy actor→0-1:dp1tp2"`` otherwise."""
    kind: StepKind
    devices: tuple[int, ...]
    """Sorted global device indices the step occupies."""
    deps: tuple[str, ...] = ()
    """Ids of the steps of the same list (iteration) it waits for."""
    role: str | None = None
    """The model it concerns; None for a compute call."""
    alloc: Allocation | None = None
    """A call's allocation; for the other steps the allocation of the copy they make, use or drop."""
    src: Allocation | None = None
    """``copy`` and ``sync``: the training allocation the weights come from."""
    mfc: MFC | None = field(default=None, compare=False)
    """``call``: the MFC itself (with its function), so that an executor needs nothing but the schedule."""
    members: tuple[Step, ...] = ()
    """``fused``: its call steps, generation first; ``fused_train``: its two train calls, in workflow order."""
    fusion: StreamFusion | None = None
    """``fused``: the plan's fusion settings."""

    @property
    def moves_bytes(self) -> bool:
        """Whether parameters travel between devices or layouts (a copy or a sync)."""
        return self.kind in (StepKind.COPY, StepKind.SYNC)

    @property
    def transfer(self) -> tuple[str, Allocation, Allocation] | None:
        """``(role, source, destination)`` of a copy or sync, the destination reduced to its shards."""
        if not self.moves_bytes:
            return None
        assert self.role is not None and self.src is not None and self.alloc is not None  # a copy or sync has all three
        return self.role, self.src, self.alloc

    @property
    def call_mfc(self) -> MFC:
        """``mfc``, which a call step has (the other kinds have none)."""
        if self.mfc is None:
            raise ValueError(f"schedule step {self.id!r}: a {self.kind.value} step has no MFC")
        return self.mfc

    @property
    def allocation(self) -> Allocation:
        """``alloc``, which every step but a stage has."""
        if self.alloc is None:
            raise ValueError(f"schedule step {self.id!r}: a {self.kind.value} step has no allocation")
        return self.alloc

    @property
    def model_role(self) -> str:
        """``role``, which every step but a compute call and a stage has."""
        if self.role is None:
            raise ValueError(f"schedule step {self.id!r}: a {self.kind.value} step has no role")
        return self.role

    def sent_with(self, dep: Step) -> bool:
        """Whether this step is sent as soon as ``dep`` is (and queued behind it on every device) rather than
        once ``dep`` has ended: a call after the copy, sync or reload that puts its model in place, and a free
        or offload after a call that used the model, when every device of this step is one of ``dep``'s. Each
        device runs its steps in the order sent, so the order holds, and the model is released as soon as the
        call is done there, not after whatever else was sent meanwhile."""
        pair = (dep.kind in _PUT and self.kind in _USE) or (dep.kind in _USE and self.kind in _DROP)
        return pair and set(self.devices) <= set(dep.devices)


@dataclass(frozen=True)
class Schedule:
    """The steps of one iteration, of the prologue and of an evaluation (see the module docstring)."""

    steps: tuple[Step, ...]
    """One iteration, in the order of sending priority: each step after the steps it waits for."""
    prologue: tuple[Step, ...] = ()
    """Run before the first iteration, and again whenever the weights are replaced: shadow fills."""
    evaluation: tuple[Step, ...] = ()
    """A greedy evaluation of the actor between iterations, with the copy it needs."""
    ahead: tuple[str, ...] = ()
    """Asynchronous plans: the ids of the call steps that run on the batch ``max_staleness`` iterations ahead."""
    fill: tuple[Step, ...] = ()
    """Asynchronous plans: the steps that generate one batch ahead on their own (the ``ahead`` calls, the steps
    that put their models in place and those that release them), to fill the pipeline before it runs."""
    asynchronous: AsyncTraining | None = None
    """The plan's asynchronous training (staleness, partial rollouts); None for a synchronous plan."""

    def __post_init__(self) -> None:
        for name, steps in (("steps", self.steps), ("prologue", self.prologue), ("evaluation", self.evaluation)):
            seen: set[str] = set()
            for step in steps:
                missing = [d for d in step.deps if d not in seen]
                if step.id in seen or missing:
                    raise ValueError(
                        f"schedule.{name}: step {step.id!r} "
                        + ("is listed twice" if step.id in seen else f"comes before {missing[0]!r}")
                    )
                seen.add(step.id)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, step_id: str) -> Step:
        for step in self.steps:
            if step.id == step_id:
                return step
        raise KeyError(f"no step {step_id!r}; steps: {', '.join(s.id for s in self.steps)}")

    def ahead_keys(self) -> list[str]:
        """Asynchronous plans: the columns the ``ahead`` calls make (what a batch generated ahead holds)."""
        return list(dict.fromkeys(k for name in self.ahead for k in self[name].call_mfc.outputs))

    def calls(self) -> list[Step]:
        """The iteration's call steps, in order (a fused stage's members in its place)."""
        return [c for s in self.steps for c in (s.members if s.kind in STAGES else (s,)) if c.kind is StepKind.CALL]

    def transfers(self) -> list[tuple[str, Allocation, Allocation]]:
        """Every distinct ``(role, source, destination)`` the copies and syncs of all three lists move, in
        first-use order: what an executor plans transfers for."""
        found: dict[tuple, None] = {}
        for step in (*self.prologue, *self.steps, *self.evaluation):
            if step.transfer is not None:
                found.setdefault(step.transfer)
        return list(found)

    def holdings(self) -> list[tuple[str, Allocation]]:
        """Every distinct ``(role, shards)`` a device must be able to hold a model in: each call's, each copy's
        and each shadow's, in first-use order (training allocations reduced to their shards too)."""
        found: dict[tuple, None] = {}
        for step in (*self.prologue, *self.steps, *self.calls(), *self.evaluation):
            if step.role is not None and step.alloc is not None:
                found.setdefault((step.role, step.alloc.shards))
            if step.src is not None:
                found.setdefault((step.role, step.src.shards))
        return list(found)


def build_schedule(workflow: Workflow, plan: ExecutionPlan, evaluate_role: str | None = "actor") -> Schedule:
    """The schedule of ``plan`` for ``workflow`` (module docstring); the plan is assumed valid
    (:meth:`ExecutionPlan.validate`). ``evaluate_role`` (if it has a generate call) gets evaluation steps."""
    builder = _Builder(workflow, plan)
    for mfc in workflow.topological_order():
        builder.add_call(mfc)
    steps = builder.finish()
    ahead: tuple[str, ...] = ()
    fill: tuple[Step, ...] = ()
    if plan.asynchronous is not None:
        ahead = tuple(m.name for m in workflow.rollout_generations())
        steps = _run_ahead(steps, ahead, builder)
        fill = _fill(steps, ahead, builder)
    group = workflow.stream_fusable() if plan.stream_fusion is not None else None
    if group is not None:
        steps = _fuse(steps, (group[0], *group[1]), StepKind.STREAM_FUSION, plan.stream_fusion)
    pair = workflow.train_pair() if plan.pipeline_fusion else None
    if pair is not None:
        steps = _fuse(steps, pair, StepKind.PIPELINE_FUSION)
    prologue = tuple(Step(s.id, s.kind, s.devices, (), s.role, s.alloc, s.src) for s in builder.fills)
    return Schedule(steps, prologue, _evaluation(workflow, plan, evaluate_role), ahead, fill, plan.asynchronous)


def _run_ahead(steps: tuple[Step, ...], ahead: tuple[str, ...], builder: _Builder) -> tuple[Step, ...]:
    """The steps of an asynchronous iteration (module docstring): nothing waits for the data of the ``ahead``
    calls, which generate a later batch, but the steps releasing what they used still follow them; the updates
    of the weights they read wait for them."""
    gens = set(ahead)
    by_id = {s.id: s for s in steps}
    extra: dict[str, list[str]] = {}
    for name in ahead:
        gen = by_id[name]
        role = gen.model_role
        canon = builder.plan.canonical_layout(builder.workflow, role)
        assert canon is not None and gen.alloc is not None  # a rollout generation's role trains
        if name in builder.shadowed:  # the shadow's refresh after the update waits for the generation
            for step in steps:
                if step.kind is StepKind.SYNC and step.role == role and step.alloc == gen.alloc.shards:
                    extra.setdefault(step.id, []).append(name)
            continue
        # the training shards themselves, or the copy made of them before the update
        reads = name if gen.alloc.shards == canon.shards else builder.copy_of[(role, gen.alloc.shards, 0)]
        for step in steps:
            if step.kind is StepKind.CALL and step.role == role and step.call_mfc.kind is MFCKind.TRAIN:
                extra.setdefault(step.id, []).append(reads)
    out = []
    for step in steps:
        keep = step.kind in _DROP or step.id in builder.restores
        deps = tuple(d for d in step.deps if keep or d not in gens) + tuple(extra.get(step.id, ()))
        out.append(dataclasses.replace(step, deps=tuple(dict.fromkeys(deps))))
    return _stable_topological(out)


def _fill(steps: tuple[Step, ...], ahead: tuple[str, ...], builder: _Builder) -> tuple[Step, ...]:
    """The steps that generate one batch ahead on their own: the ``ahead`` calls, the steps they wait for, and
    the steps that release or restore what they used, each keeping only its dependencies among these."""
    needed = _closure(steps, ahead)
    for step in steps:
        if (step.kind in _DROP or step.id in builder.restores) and set(step.deps) <= needed:
            needed.add(step.id)
    return tuple(dataclasses.replace(s, deps=tuple(d for d in s.deps if d in needed)) for s in steps if s.id in needed)


def _closure(steps: Sequence[Step], ids: Sequence[str]) -> set[str]:
    """The ids of the steps ``ids`` and of every step of ``steps`` they wait for, directly or not."""
    by_id = {s.id: s for s in steps}
    needed: set[str] = set()
    todo = list(ids)
    while todo:
        step_id = todo.pop()
        if step_id not in needed:
            needed.add(step_id)
            todo.extend(d for d in by_id[step_id].deps if d in by_id)
    return needed


def _fuse(
    steps: tuple[Step, ...], group: tuple[MFC, ...], kind: StepKind, fusion: StreamFusion | None = None
) -> tuple[Step, ...]:
    """``steps`` with the group's call steps replaced by one stage of ``kind`` (module docstring), in the place
    of its first member, named after it: the steps that feed a member (copies, reloads) run before the stage;
    the steps that wait for a member wait for it."""
    names = {m.name for m in group}
    members = tuple(s for s in steps if s.id in names)
    first = group[0]
    fused_id = f"{kind.value}_{first.name}"
    feeding = {d for m in members for d in m.deps if d not in names}
    devices = tuple(sorted({d for m in members for d in m.devices}))
    out: list[Step] = []
    for step in steps:
        if step.id == first.name:
            out.append(
                Step(
                    fused_id,
                    kind,
                    devices,
                    tuple(sorted(feeding, key=_position(steps))),
                    members=members,
                    fusion=fusion,
                )
            )
        elif step.id not in names:
            deps = tuple(dict.fromkeys(fused_id if d in names else d for d in step.deps))
            out.append(
                dataclasses.replace(step, deps=tuple(d for d in deps if d != fused_id) if step.id in feeding else deps)
            )
    return _stable_topological(out)


def _position(steps: Sequence[Step]):
    index = {s.id: i for i, s in enumerate(steps)}
    return lambda step_id: index[step_id]


def _stable_topological(steps: list[Step]) -> tuple[Step, ...]:
    """``steps`` reordered so each follows the steps it waits for, otherwise keeping their order."""
    placed: set[str] = set()
    order: list[Step] = []
    pending = list(steps)
    while pending:
        step = next(s for s in pending if all(d in placed for d in s.deps))
        pending.remove(step)
        order.append(step)
        placed.add(step.id)
    return tuple(order)


class _Builder:
    """Walks the calls in topological order and emits each with the steps around it."""

    def __init__(self, workflow: Workflow, plan: ExecutionPlan) -> None:
        self.workflow, self.plan = workflow, plan
        self.trained = set(plan.trained_roles(workflow))
        offloaded = set(plan.offloaded_roles(workflow)) if plan.cluster.offloads else set()
        self.offloaded = offloaded - self.trained
        """Frozen roles reloaded before each of their calls and offloaded after."""
        self.sleeping = [r for r in plan.trained_roles(workflow) if r in offloaded]
        """Trained roles whose training state leaves the devices while a generate call runs there."""
        self.reloaded: dict[str, str] = {}
        """Trained role → the reload of its training state its next steps on those shards wait for."""
        self.shadow_calls = {role: plan.shadow_calls(workflow, role) for role in plan.shadow_roles(workflow)}
        self.shadowed = {n for calls in self.shadow_calls.values() for n in calls}
        self.steps: list[Step] = []
        self.copy_of: dict[tuple, str] = {}
        """(role, shards, version) → id of the copy step that made it."""
        self.users: dict[tuple, list[str]] = {}
        """(role, shards, version) → the calls using that copy, in order."""
        self.last_free: dict[tuple, str] = {}
        """(role, shards) → the free of its latest copy (the next copy into that buffer waits for it)."""
        self.syncs: dict[tuple, str] = {}
        """(role, shards, version) → the sync that filled the shadow for that version."""
        self.fills: list[Step] = []
        """The syncs after each role's first train call: the prologue fills the shadows the same way."""
        self.restores: set[str] = set()
        """The reloads of a trained role's state after the generate call it was offloaded for."""

    def version(self, mfc: MFC) -> int:
        """How many of its role's train calls precede ``mfc`` in the iteration (0 before any)."""
        ancestors = self.workflow.ancestors(mfc.name)
        return sum(
            1 for m in self.workflow.mfcs_of_role(mfc.model_role) if m.kind is MFCKind.TRAIN and m.name in ancestors
        )

    def add_call(self, mfc: MFC) -> None:
        alloc = self.plan[mfc.name]
        deps = list(self.workflow.deps(mfc.name))
        role = mfc.role
        if role in self.reloaded:
            deps.append(self.reloaded[role])
        if role in self.trained and mfc.kind is not MFCKind.TRAIN:
            deps += self._weights_for(mfc, alloc, deps)
        asleep = self._put_to_sleep(mfc, alloc, deps) if mfc.kind is MFCKind.GENERATE else []
        deps += [s.id for s in asleep]
        if role in self.offloaded:
            reload = self._add(
                Step(f"reload {role} for {mfc.name}", StepKind.RELOAD, _devices(alloc), tuple(deps), role, alloc.shards)
            )
            deps.append(reload.id)
        call = self._add(
            Step(mfc.name, StepKind.CALL, _devices(alloc), tuple(dict.fromkeys(deps)), role, alloc, mfc=mfc)
        )
        if role in self.offloaded:
            self._add(
                Step(
                    f"offload {role} after {mfc.name}",
                    StepKind.OFFLOAD,
                    _devices(alloc),
                    (call.id,),
                    role,
                    alloc.shards,
                )
            )
        for sleep in asleep:
            reload = self._add(
                Step(
                    f"reload {sleep.role} state after {mfc.name}",
                    StepKind.RELOAD,
                    sleep.devices,
                    (call.id,),
                    sleep.role,
                    sleep.alloc,
                )
            )
            self.reloaded[sleep.model_role] = reload.id
            self.restores.add(reload.id)
        if mfc.kind is MFCKind.TRAIN and role in self.trained:
            version = self.version(mfc) + 1
            for shadow in self._shadows(role):
                step = self._add(
                    Step(
                        _suffix(f"sync {role}→{shadow.text}", version - 1),
                        StepKind.SYNC,
                        _devices(alloc, shadow),
                        (call.id,),
                        role,
                        shadow,
                        alloc.shards,
                    )
                )
                self.syncs[(role, shadow, version)] = step.id
                if version == 1:
                    self.fills.append(step)

    def _put_to_sleep(self, mfc: MFC, alloc: Allocation, deps: list[str]) -> list[Step]:
        """The offloads of the trained roles whose training state shares devices with generate call ``mfc``
        (module docstring), each once the call's own dependencies (its weights' copy included) are done; not the
        generating role's when the call runs on its training shards (there is no copy to generate with)."""
        out = []
        for role in self.sleeping:
            canon = self.plan.canonical_layout(self.workflow, role)
            assert canon is not None  # a sleeping role is trained
            if canon.mesh.isdisjoint(alloc.mesh) or (role == mfc.role and alloc.shards == canon.shards):
                continue  # elsewhere, or generating on the training shards themselves: they must stay
            after = deps + ([self.reloaded[role]] if role in self.reloaded else [])
            out.append(
                self._add(
                    Step(
                        f"offload {role} state for {mfc.name}",
                        StepKind.OFFLOAD,
                        _devices(canon),
                        tuple(dict.fromkeys(after)),
                        role,
                        canon.shards,
                    )
                )
            )
        return out

    def _weights_for(self, mfc: MFC, alloc: Allocation, deps: list[str]) -> list[str]:
        """The steps a non-train call of a trained role waits for to find the weights in its layout."""
        role = mfc.model_role
        canon = self.plan.canonical_layout(self.workflow, role)
        assert canon is not None  # the role is trained
        shards, version = alloc.shards, self.version(mfc)
        if shards == canon.shards:
            return []
        if mfc.name in self.shadowed:
            sync = self.syncs.get((role, shards, version))
            return [sync] if sync is not None else []  # version 0: filled by the previous iteration's sync
        key = (role, shards, version)
        if key not in self.copy_of:
            after = [self.last_free[(role, shards)]] if (role, shards) in self.last_free else []
            after += [self.reloaded[role]] if role in self.reloaded else []  # the copy reads the training shards
            step = self._add(
                Step(
                    _suffix(f"copy {role}→{shards.text}", version),
                    StepKind.COPY,
                    _devices(canon, shards),
                    tuple(dict.fromkeys(deps + after)),
                    role,
                    shards,
                    canon.shards,
                )
            )
            self.copy_of[key] = step.id
            self.users[key] = []
            self.last_free[(role, shards)] = _suffix(f"free {role}@{shards.text}", version)
        self.users[key].append(mfc.name)
        return [self.copy_of[key]]

    def _shadows(self, role: str) -> list[Allocation]:
        return list(dict.fromkeys(self.plan[n].shards for n in self.shadow_calls.get(role, ())))

    def _add(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    def finish(self) -> tuple[Step, ...]:
        """The steps with each copy's free placed right after the last step it waits for."""
        steps = list(self.steps)
        for (role, shards, version), users in self.users.items():
            free = Step(
                _suffix(f"free {role}@{shards.text}", version),
                StepKind.FREE,
                _devices(shards),
                tuple(users),
                role,
                shards,
            )
            last = max(i for i, s in enumerate(steps) if s.id in users)
            steps.insert(last + 1, free)
        return tuple(steps)


def _evaluation(workflow: Workflow, plan: ExecutionPlan, role: str | None) -> tuple[Step, ...]:
    gens = (
        [m for m in workflow.topological_order() if m.role == role and m.kind is MFCKind.GENERATE]
        if role is not None and role in workflow.roles()
        else []
    )
    if not gens:
        return ()
    assert role is not None  # there are generate calls of it
    alloc = plan[gens[0].name]
    canon = plan.canonical_layout(workflow, role)
    shadowed = gens[0].name in plan.shadow_calls(workflow, role) if canon is not None else False
    if canon is None or alloc.shards == canon.shards or shadowed:
        return (Step("evaluate", StepKind.EVALUATE, _devices(alloc), (), role, alloc.shards),)
    copy = Step(
        f"copy {role}→{alloc.shards.text}", StepKind.COPY, _devices(canon, alloc), (), role, alloc.shards, canon.shards
    )
    evaluate = Step("evaluate", StepKind.EVALUATE, _devices(alloc), (copy.id,), role, alloc.shards)
    return (
        copy,
        evaluate,
        Step(f"free {role}@{alloc.shards.text}", StepKind.FREE, _devices(alloc), (evaluate.id,), role, alloc.shards),
    )


def _devices(*allocs: Allocation) -> tuple[int, ...]:
    return tuple(sorted({d for a in allocs for d in a.mesh.devices}))


def _suffix(text: str, version: int) -> str:
    """Ids of a role's copies after its first train call of an iteration carry the version: ``copy a→x#1``."""
    return text if version == 0 else f"{text}#{version}"


def split_for_sampling(
    steps: Sequence[Step], producer: str
) -> tuple[tuple[Step, ...], tuple[Step, ...], tuple[Step, ...]]:
    """An iteration's steps cut for dynamic sampling, where the calls that make the rewards run again on waves of
    extra prompts before the rest of the iteration runs on the samples kept.

    Returns ``(head, again, tail)``: ``head``, the steps the call ``producer`` needs (itself included, or the
    stage it is a member of), in order, run on the first wave; ``again``, its call and stage steps, run on each
    later wave with the models where the first wave's steps put them (no step of ``head`` releases one); and
    ``tail``, every other step. Steps of ``again`` and ``tail`` keep only their dependencies on the steps of their
    own list (the others are done by the time they run)."""
    by_id = {s.id: s for s in steps}
    owner = next((s.id for s in steps if s.id == producer or producer in {m.id for m in s.members}), None)
    if owner is None:
        raise ValueError(f"no step makes {producer!r}; steps: {', '.join(by_id)}")
    needed = _closure(steps, (owner,))
    head = tuple(s for s in steps if s.id in needed)
    released = [s.id for s in head if s.kind in _DROP]
    if released:
        raise ValueError(
            f"the rewards are made after {released[0]!r}, which releases a model they need again on the next wave"
        )

    def only(kept: Sequence[Step]) -> tuple[Step, ...]:
        ids = {s.id for s in kept}
        return tuple(dataclasses.replace(s, deps=tuple(d for d in s.deps if d in ids)) for s in kept)

    again = only([s for s in head if s.kind is StepKind.CALL or s.kind in STAGES])
    return head, again, only([s for s in steps if s.id not in needed])
