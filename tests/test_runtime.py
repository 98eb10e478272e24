"""The Ray runtime against the single-process reference executor, and its failure behaviour.

Equivalence (3 PPO iterations, tiny model, float32): the runtime on 1 device, on 2 devices with DP=2, on 2
devices with TP=2 for the actor, with PP=2 for actor and critic, and on 4 devices with PP=2 × TP=2 for both
(generation reallocated to DP=2 × TP=2), and plans with several micro-batches per call (pipelined or
accumulated), gives the same samples as the reference (so every sample-derived metric is identical) and the
same losses within 1e-4 relative; so do the placement plans below (ZeRO-1 and FSDP among them). Why 1e-4: the
only differences are the order of floating-point sums (gradients summed over DP ranks and micro-batches, by an
all-reduce or FSDP's reduce-scatter, TP row-parallel reductions), about 1e-7 relative per
operation, which three iterations of Adam amplify to well under 1e-5; 1e-4 leaves room without hiding a
real bug, which moves losses by orders of magnitude more.

bf16 mixed precision (``runtime.precision=bf16``: bf16 weights, activations and gradients, fp32 master weights
and Adam moments) is held to the bf16 reference run: the same samples, and losses within 5e-2 relative (5e-3
absolute). Why: bf16 keeps 8 significant bits, so every operation rounds by up to 2^-9 ≈ 2e-3 relative, and
summing in another order (DP, TP, micro-batches, pipeline stages) changes which way; over three iterations
(twelve Adam steps) the plans below differ from the reference by at most 2.5% (the KL of the last iteration,
a difference of two log-probabilities), most losses by under 0.5%. The clipped fraction is a count: a token
whose ratio sits at the clip range's edge may fall either side, moving it by one token's share (about 0.01
here), so it is held to 0.05 absolute (five tokens) instead. The first iteration's samples are drawn from the
same bf16 weights and must be identical. Later ones come from weights trained along different summation orders:
where two tokens' probabilities lie within bf16's rounding of each other, a sample may take the other one.
Whether that happens depends on the processor's bf16 kernels (AVX-512 and AVX2 round differently), so a
difference of one sample's share in the sample metrics is allowed, and from that iteration on the two runs train
on different data and are not compared further.
"""

import dataclasses
import json
import os
import signal
import threading
import time

import pytest
import ray

from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.plan.schedule import StepKind
from loomrl.train.rl import RLTrainer

SAMPLE_KEYS = ("reward/mean", "reward/exact_match", "response/length", "response/length_max")
LOSS_KEYS = (
    "kl/mean",
    "actor/pg_loss",
    "critic/value_loss",
    "actor/clipfrac",
    "actor/approx_kl",
    "actor/grad_norm",
    "critic/grad_norm",
    "actor/entropy",
    "mismatch/tokens",
    "mismatch/mean_abs_logp_diff",
    "mismatch/token_mult_prob_error",
    "mismatch/k3_kl",
    "mismatch/ess",
    "offpolicy/is_weight",
    "offpolicy/is_capped",
    "offpolicy/is_dropped",
    "offpolicy/responses_dropped",
)


pytestmark = pytest.mark.usefixtures("ray_session")


def _cfg(tmp_path, name, *extra):
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / name}",
            "seed=3",
            "rollout.prompts_per_iter=8",
            "rollout.max_new_tokens=6",
            "loop.iterations=3",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=8",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.timeout_s=120",
            "algo.minibatches=2",
            "algo.ppo_epochs=2",
            "actor.optim.lr=0.001",
            "runtime.executor=reference",
            *extra,
        ],
    )


def _metrics(tmp_path, name, *extra):
    RLTrainer(_cfg(tmp_path, name, *extra)).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _metrics(tmp_path_factory.mktemp("ref"), "ref")


@pytest.mark.parametrize(
    "layout",
    [
        ("runtime.devices=1",),
        ("runtime.devices=2",),
        ("runtime.devices=2", "runtime.layouts={actor: {sharding: fsdp}, critic: {sharding: zero}}"),
        ("runtime.devices=2", "runtime.layouts={actor: {tp: 2}}"),
        ("runtime.devices=2", "runtime.layouts={actor: {pp: 2}, critic: {pp: 2}}"),
        ("runtime.devices=4", "runtime.layouts={actor: {pp: 2, tp: 2}, critic: {pp: 2, tp: 2}}"),
    ],
    ids=["1dev", "dp2", "dp2_fsdp_zero", "actor_tp2", "actor_critic_pp2", "actor_critic_pp2tp2"],
)
def test_runtime_matches_the_reference(tmp_path, reference, layout):
    got = _metrics(tmp_path, "ray", "runtime.executor=ray", *layout)
    assert len(reference) == 3
    _assert_equivalent(got, reference)
    assert got[-1]["eval/exact_match"] == reference[-1]["eval/exact_match"]


def _assert_equivalent(got, reference, rel=1e-4, abs_=1e-6, clipfrac_abs=None, samples_abs=None):
    """Same samples and losses within ``rel``/``abs_``. ``samples_abs`` (bf16, module docstring): after the first
    iteration a sample may differ by a token, moving each sample metric by at most that sample's share; from the
    first iteration whose samples differ the two runs train on different data, so nothing after is compared."""
    assert len(got) == len(reference)
    for it, (a, b) in enumerate(zip(got, reference)):
        same = all(a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9) for key in SAMPLE_KEYS)
        if not same and it > 0 and samples_abs is not None:
            for key in SAMPLE_KEYS:
                assert abs(a[key] - b[key]) <= samples_abs[key] + 1e-9, (it, key, a[key], b[key])
            return
        for key in SAMPLE_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (it, key, a[key], b[key])
        for key in (k for k in LOSS_KEYS + ("actor/kl_loss",) if k in b):
            near = {"rel": rel, "abs": abs_}
            if key == "actor/clipfrac" and clipfrac_abs is not None:
                near = {"rel": 0, "abs": clipfrac_abs}
            assert a[key] == pytest.approx(b[key], **near), (it, key, a[key], b[key])
        # evaluation runs at a run's last iteration, wherever that is; fusion/ reports the plan, not the run
        ignored = ("time", "perf", "eval/", "fusion/")
        assert {k for k in a if not k.startswith(ignored)} == {k for k in b if not k.startswith(ignored)}


@pytest.mark.parametrize("layout", [(), ("runtime.layouts={actor: {tp: 2}}",)], ids=["dp2", "actor_tp2"])
def test_runtime_matches_the_reference_with_varied_lengths_from_sft(tmp_path, layout):
    """A warm-started policy emits eos, so shards have different widths and groups different lengths; a group's
    rows share their prompt, which training runs once (on data-parallel replicas and on tensor-parallel shards)."""
    from loomrl.config.schema import SFTConfig
    from loomrl.train.sft import run_sft

    sft = load_config(SFTConfig, None, [f"out_dir={tmp_path / 'sft'}", "steps=40", "eval_prompts=8"])
    run_sft(sft, progress=False)
    common = (
        f"actor.model={tmp_path / 'sft'}",
        "rollout.max_new_tokens=8",
        "algo.name=grpo",
        "algo.group_size=4",
        "rollout.prompts_per_iter=4",
    )
    reference = _metrics(tmp_path, "ref", *common)
    assert any(r["response/length"] < r["response/length_max"] for r in reference), "lengths should vary"
    _assert_equivalent(
        _metrics(tmp_path, "ray", *common, "runtime.executor=ray", "runtime.devices=2", *layout), reference
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def failing_reward(tmp_path) -> tuple[str, ...]:
    """Overrides for a prompt file of 8 rows and a reward function that raises 'reward service unavailable'."""
    (tmp_path / "prompts.jsonl").write_text(
        "".join(f'{{"prompt": "add {i}+1=", "answer": "{i + 1}"}}\n' for i in range(8))
    )
    (tmp_path / "bad_reward.py").write_text(
        "def score(prompt, response, answer):\n    raise ValueError('reward service unavailable')\n"
    )
    return (
        "task.name=file",
        f"task.prompt_file={tmp_path / 'prompts.jsonl'}",
        f"task.reward_fn={tmp_path / 'bad_reward.py'}:score",
    )


def test_a_killed_worker_is_a_clear_error_and_nothing_is_left(tmp_path):
    from loomrl.runtime.ray_executor import RuntimeFailure

    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "kill",
            "runtime.executor=ray",
            "runtime.devices=2",
            "loop.iterations=50",
            "rollout.max_new_tokens=24",
            "rollout.prompts_per_iter=32",
        )
    )
    pids = list(trainer.executor.pids)
    killer = threading.Timer(4.0, lambda: os.kill(pids[1], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeFailure) as err:
        trainer.run()
    killer.cancel()
    message = str(err.value)
    assert "\n" not in message and "worker 1" in message and "MFC '" in message and "role" in message, message
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "worker processes left behind"


def test_the_controller_receives_only_metadata(tmp_path):
    from loomrl.runtime.ray_executor import check_metadata

    trainer = RLTrainer(_cfg(tmp_path, "meta", "runtime.executor=ray", "runtime.devices=2", "loop.iterations=1"))
    trainer.run()
    assert trainer.executor.received > 10  # every worker reply went through the check
    import torch

    with pytest.raises(RuntimeError, match="received Tensor"):
        check_metadata({"stats": {"x": 1.0}, "oops": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="received list|received Tensor"):
        check_metadata([torch.zeros(1)])
    # A streamed item holds no object reference: Ray may free an object a worker put and yielded inside one before
    # the call it is passed on to reads it; the shard is the stream's next item instead.
    ref = ray.ObjectRef(b"\x01" * 28)
    check_metadata({"shard": (ref,)})
    with pytest.raises(RuntimeError, match=r"ObjectRef at result.shard\[0\] of a stream"):
        check_metadata({"shard": (ref,)}, references=False)


def test_an_exception_in_an_mfc_names_worker_role_and_mfc(tmp_path):
    from loomrl.runtime.ray_executor import RuntimeFailure

    cfg = _cfg(tmp_path, "boom", "runtime.executor=ray", "runtime.devices=2", *failing_reward(tmp_path))
    trainer = RLTrainer(cfg)
    pids = list(trainer.executor.pids)
    with pytest.raises(RuntimeFailure) as err:
        trainer.run()
    message = str(err.value)
    assert "\n" not in message, message
    assert "MFC 'reward_inf'" in message and "role reward" in message and "reward service unavailable" in message
    assert "worker 0" in message or "worker 1" in message
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


PIPELINE_MB = (
    "actor_gen=0-1:dp2; ref_inf=0-1:pp2mb2; reward_inf=0-1:dp2; critic_inf=0-1:pp2mb3; "
    "actor_train=0-1:pp2mb2; critic_train=0-1:pp2mb2; advantages=0:dp1"
)
"""Actor and critic pipelined with several micro-batches in training and inference: 8 rows of inference in 4 + 4
and 3 + 3 + 2, each 4-row minibatch in 2 + 2 (the first iteration's responses differ in length, so some
micro-batches weigh more than their share of rows)."""


ZERO_PLAN_2 = (
    "actor_gen=0-1:tp2; actor_train=0-1:dp2zero; ref_inf=0:dp1; reward_inf=1:dp1; critic_inf=0-1:dp2; "
    "critic_train=0-1:dp2mb2zero; advantages=0:dp1"
)
"""Actor and critic with their Adam state sharded over dp2 (ZeRO-1), the actor generating from a tp2 copy."""
ZERO_PLAN_4 = (
    "actor_gen=0-3:dp4; actor_train=0-3:dp2tp2zero; ref_inf=0-3:dp4; reward_inf=0-3:dp4; "
    "critic_inf=0-3:dp4; critic_train=0-3:pp2dp2zero; advantages=0:dp1"
)
"""ZeRO-1 with tensor parallelism (DTensor shards chunked over dp) and with pipeline stages."""
FSDP_PLAN_2 = (
    "actor_gen=0-1:dp2; actor_train=0-1:dp2mb3fsdp; ref_inf=0:dp1; reward_inf=1:dp1; critic_inf=0-1:dp2; "
    "critic_train=0-1:dp2mb2fsdp; advantages=0:dp1"
)
"""Actor and critic fully sharded over dp2 (FSDP2), their other calls on reallocated whole copies on the same
devices; the actor's 3 micro-batches exceed a rank's 2 rows per step, so ranks pad with idle passes."""
FSDP_TP_PLAN_4 = (
    "actor_gen=0-3:dp4; actor_train=0-3:dp2tp2fsdp; ref_inf=0-3:dp4; reward_inf=0-3:dp4; "
    "critic_inf=0-3:dp2tp2; critic_train=0-3:dp2tp2mb2fsdp; advantages=0:dp1"
)
"""FSDP over the dp dimension of a dp2 × tp2 mesh: each rank keeps a dim-0 block of its tensor-parallel shard;
the critic's inference runs on a whole tp2 copy reallocated from those blocks on the same devices."""


FUSED_TRAIN_2 = (
    "actor_gen=0-1:dp2; actor_train=0-1:pp2mb2; ref_inf=0-1:dp2; reward_inf=0-1:dp2; critic_inf=0-1:dp2; "
    "critic_train=0-1:pp2revmb2; advantages=0:dp1; pipeline_fusion=on"
)
"""Intra-stage fusion: the actor's and the critic's pipelines in opposite directions on two devices, trained as one
fused pipeline step per pair of optimizer steps."""
FUSED_TRAIN_4 = (
    "actor_gen=0-3:dp4; actor_train=0-3:pp4mb2; ref_inf=0-3:dp4; reward_inf=0-3:dp4; critic_inf=0-3:dp4; "
    "critic_train=0-3:dp2pp2revmb2; advantages=0:dp1; pipeline_fusion=on"
)
"""Fused pipelines of different depths: the actor in four stages, the critic in two replicas of two (each replica
on its own rows, their gradients summed), two micro-batches a step on rows some ranks have fewer of."""


@pytest.mark.parametrize(
    "plan,devices",
    [
        ("colocate", 2),
        ("interleave", 2),
        ("separate", 2),
        (
            "actor_gen=0-1:tp2; actor_train=0-1:dp2; ref_inf=0:dp1; reward_inf=1:dp1; critic_inf=0-1:dp2; "
            "critic_train=0-1:dp2; advantages=0:dp1",
            2,
        ),
        (
            "actor_gen=0-1:dp2; actor_train=0-1:pp2; ref_inf=0-1:pp2; reward_inf=0-1:dp2; critic_inf=0-1:pp2; "
            "critic_train=0-1:pp2; advantages=0:dp1",
            2,
        ),
        ("colocate", 4),
        ("interleave", 4),
        ("separate", 4),
        (
            "actor_gen=0-3:tp2; actor_train=0-3:pp2dp2; ref_inf=0-1:dp2; reward_inf=2-3:dp2; critic_inf=0-3:dp4; "
            "critic_train=0-3:pp2dp2; advantages=0:dp1",
            4,
        ),
        (
            "actor_gen=0-3:dp4; actor_train=0-3:pp2tp2; ref_inf=0-3:pp2tp2; reward_inf=0-3:dp4; critic_inf=0-3:dp2tp2; "
            "critic_train=0-3:pp2tp2; advantages=0:dp1",
            4,
        ),
        (PIPELINE_MB, 2),
        (
            "actor_gen=0-1:tp2; actor_train=0-1:dp2mb2; ref_inf=0-1:dp2mb3; reward_inf=0-1:dp2; critic_inf=0-1:dp2mb2; "
            "critic_train=0-1:dp2mb2; advantages=0:dp1",
            2,
        ),
        (
            "actor_gen=0-1:dp2; actor_train=0-1:tp2rc; ref_inf=0-1:dp2; reward_inf=0-1:dp2; critic_inf=0-1:pp2; "
            "critic_train=0-1:pp2mb2rc; advantages=0:dp1",
            2,
        ),
        (ZERO_PLAN_2, 2),
        (FSDP_PLAN_2, 2),
        (
            "actor_gen=0-1:dp2; actor_train=2-3:dp2fsdp; ref_inf=2-3:dp2; reward_inf=2-3:dp2; critic_inf=2-3:dp2; "
            "critic_train=2-3:dp2fsdp; advantages=2:dp1",
            4,
        ),
        (FSDP_TP_PLAN_4, 4),
        (FUSED_TRAIN_2, 2),
        (FUSED_TRAIN_4, 4),
    ],
    ids=[
        "colocate2",
        "interleave2",
        "separate2",
        "realloc_tp2",
        "pipeline2",
        "colocate4",
        "interleave4",
        "separate4",
        "pipeline_dp4",
        "pipeline_tp4",
        "pipeline2_micro_batches",
        "dp2_micro_batches",
        "recompute",
        "zero2",
        "fsdp2",
        "separate4_fsdp",
        "fsdp_tp4",
        "fused_train2",
        "fused_train4",
    ],
)
def test_plans_match_the_reference(tmp_path, reference, plan, devices):
    """Every placement strategy computes the reference run: per-call meshes and layouts, reallocation of the
    actor between its training and generation layouts, shadow sync, concurrent calls on disjoint devices."""
    cfg = _cfg(
        tmp_path, "plan", "runtime.executor=ray", f"runtime.devices={devices}", "runtime.verify_reallocation=true"
    )
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))
    trainer = RLTrainer(cfg)
    if plan == "separate":
        assert trainer.plan.shadow_roles(trainer.workflow) == ("actor",)
    assert trainer.executor.schedule.transfers() or plan == "colocate"
    if "pipeline_fusion=on" in plan:  # the two train calls run as one fused stage
        assert [s.id for s in trainer.executor.schedule if s.kind is StepKind.PIPELINE_FUSION] == [
            "pipeline_fusion_actor_train"
        ]
    trainer.run()
    got = [json.loads(line) for line in (tmp_path / "plan" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, reference)
    assert got[-1]["eval/exact_match"] == reference[-1]["eval/exact_match"]


def test_a_roles_sharding_applies_to_its_train_calls_in_the_default_plan(tmp_path):
    """``runtime.layouts.<role>.sharding`` (no plan string): the colocated default plan trains the actor under
    FSDP and the critic under ZeRO-1; every other call keeps its whole layout."""
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.plan import ClusterSpec
    from loomrl.plan.from_config import plan_from_config

    cfg = _cfg(
        tmp_path,
        "s",
        "runtime.executor=ray",
        "runtime.devices=2",
        "runtime.layouts={actor: {sharding: fsdp}, critic: {sharding: zero}}",
    )
    workflow = build_workflow(cfg.algo, cfg.rollout)
    plan = plan_from_config(cfg.runtime, workflow, ClusterSpec(nodes=1, devices_per_node=2))
    assert plan["actor_train"].text == "0-1:dp2fsdp" and plan["critic_train"].text == "0-1:dp2zero"
    assert {plan[m.name].text for m in workflow if m.kind.value != "train" and m.role} == {"0-1:dp2"}


def test_fsdp_with_tensor_parallelism_shards_each_tp_shard_over_dp(tmp_path):
    """``runtime.layouts.actor: {tp: 2, sharding: fsdp}`` on 4 devices trains the actor as dp2 × tp2 under FSDP:
    a device keeps half of its tensor-parallel shard, a quarter of the weights, beside the whole tp2 copy its
    other calls use (the run itself is checked against the reference with ``fsdp_tp4`` above)."""
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.plan import ClusterSpec
    from loomrl.plan.from_config import plan_from_config

    cfg = _cfg(
        tmp_path, "s", "runtime.executor=ray", "runtime.devices=4", "runtime.layouts={actor: {tp: 2, sharding: fsdp}}"
    )
    plan = plan_from_config(
        cfg.runtime, build_workflow(cfg.algo, cfg.rollout), ClusterSpec(nodes=1, devices_per_node=4)
    )
    assert plan["actor_train"].text == "0-3:dp2tp2fsdp" and plan["actor_gen"].text == "0-3:dp2tp2"
    trainer = RLTrainer(cfg)
    try:
        report = ray.get(trainer.executor.workers[0].memory_report.remote(), timeout=60)
    finally:
        trainer.close()
    # the reference policy is the actor's architecture, whole (dp4) on every device: a quarter of it is held here
    shards, whole = report["actor@0-3:dp2tp2fsdp"], report["ref@0-3:dp4"]
    assert 0.2 < shards / whole < 0.3, report  # dim-0 blocks may pad a little
    assert report["actor@0-3:dp2tp2"] == 0, report  # the actor's copy is filled only while a call uses it


def test_workers_run_each_call_with_the_plans_micro_batches(tmp_path):
    """The plan's micro-batches reach every MFC's OpContext on a worker (generation's too; its op ignores them)."""
    from loomrl.algorithms.context import Role
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.plan import ClusterSpec
    from loomrl.plan.from_config import plan_from_config
    from loomrl.plan.schedule import build_schedule
    from loomrl.runtime.spec import CallData
    from loomrl.runtime.worker import DeviceWorker
    from loomrl.train.rl import worker_spec

    cfg = _cfg(tmp_path, "mb", "runtime.executor=ray", "runtime.devices=2")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=PIPELINE_MB))
    workflow, cluster = build_workflow(cfg.algo, cfg.rollout), ClusterSpec(nodes=1, devices_per_node=2)
    plan = plan_from_config(cfg.runtime, workflow, cluster)
    schedule = build_schedule(workflow, plan)
    want = {
        "actor_gen": 1,
        "ref_inf": 2,
        "reward_inf": 1,
        "critic_inf": 3,
        "actor_train": 2,
        "critic_train": 2,
        "advantages": 1,
    }
    assert {s.id: s.alloc.micro_batches for s in schedule.calls()} == want
    # frozen roles sharing devices with others are the plan's offloaded roles; CPU devices keep them resident
    assert plan.offloaded_roles(workflow) == ("ref", "reward") and not [s for s in schedule if s.kind.value == "reload"]
    worker = DeviceWorker(0, 2, worker_spec(cfg, workflow))  # not set up: only what _context reads is filled in
    worker.holdings = {(s.role, s.alloc.shards): Role(s.role) for s in schedule.calls() if s.role is not None}
    got = {s.id: worker._context(s, CallData(0, (), ())).micro_batches for s in schedule.calls()}
    assert got == want


def test_the_reference_runs_each_call_with_the_plans_micro_batches_and_recomputation(tmp_path, reference):
    """A plan given to the reference executor bounds its memory as it would a worker's: each call's micro-batches
    and recomputation (on its whole batch, colocated), and the run is the same within the executors' tolerances."""
    cfg = _cfg(tmp_path, "mb", "runtime.devices=2")
    plan = (
        "actor_gen=0-1:dp2; ref_inf=0-1:mb2; reward_inf=0-1:dp2; critic_inf=0-1:mb3; actor_train=0-1:mb2rc; "
        "critic_train=0-1:dp2mb2rc; advantages=0:dp1"
    )
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))
    trainer = RLTrainer(cfg)
    allocations = trainer.plan.allocations
    assert {name: (a.micro_batches, a.recompute) for name, a in allocations.items()} == {
        "actor_gen": (1, False),
        "ref_inf": (2, False),
        "reward_inf": (1, False),
        "critic_inf": (3, False),
        "actor_train": (2, True),
        "critic_train": (2, True),
        "advantages": (1, False),
    }
    assert {a.mesh.devices for a in allocations.values()} == {(0,)}, "placed nowhere but here"
    trainer.run()
    got = [json.loads(line) for line in (tmp_path / "mb" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, reference)


def test_a_reference_checkpoint_resumes_on_a_pipeline_plan(tmp_path, reference):
    """Checkpoints are layout-independent: stop on the reference executor, continue on Ray with pp=2."""
    RLTrainer(_cfg(tmp_path, "b", "loop.iterations=2")).run()
    plan = (
        "actor_gen=0-1:dp2; actor_train=0-1:pp2; ref_inf=0-1:pp2; reward_inf=0-1:dp2; critic_inf=0-1:pp2; "
        "critic_train=0-1:pp2; advantages=0:dp1"
    )
    cfg = _cfg(tmp_path, "b", "runtime.executor=ray", "runtime.devices=2")
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run(resume=True)
    got = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in got] == [0, 1, 2]
    _assert_equivalent(got, reference)


def test_a_pp_tp_run_loads_and_saves_layout_independent_checkpoints(tmp_path, reference):
    """Reference → Ray with actor and critic on pp=2 × tp=2 → reference, one iteration each: the pp×tp workers
    load full weights and optimizer state into their stage shards and export them whole again."""
    pp_tp = (
        "runtime.executor=ray",
        "runtime.devices=4",
        "runtime.layouts={actor: {pp: 2, tp: 2}, critic: {pp: 2, tp: 2}}",
    )
    RLTrainer(_cfg(tmp_path, "c", "loop.iterations=1")).run()
    RLTrainer(_cfg(tmp_path, "c", "loop.iterations=2", *pp_tp)).run(resume=True)
    RLTrainer(_cfg(tmp_path, "c")).run(resume=True)
    got = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in got] == [0, 1, 2]
    _assert_equivalent(got, reference)


@pytest.mark.parametrize(
    "plan,devices", [(ZERO_PLAN_4, 4), (FSDP_PLAN_2, 2), (FSDP_TP_PLAN_4, 4)], ids=["zero4", "fsdp2", "fsdp_tp4"]
)
def test_sharded_runs_load_and_save_layout_independent_checkpoints(tmp_path, reference, plan, devices):
    """Reference → Ray with sharded training state → reference, one iteration each: ZeRO-1 over tp2 × dp2 and
    pp2 × dp2 (the optimizers load their chunks of the full state) and FSDP (dim-0 blocks of the weights and
    the optimizer state, of tp2 shards too); all gather the state whole again for the checkpoint."""
    RLTrainer(_cfg(tmp_path, "z", "loop.iterations=1")).run()
    cfg = _cfg(tmp_path, "z", "loop.iterations=2", "runtime.executor=ray", f"runtime.devices={devices}")
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run(resume=True)
    RLTrainer(_cfg(tmp_path, "z")).run(resume=True)
    got = [json.loads(line) for line in (tmp_path / "z" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in got] == [0, 1, 2]
    _assert_equivalent(got, reference)


def test_replicas_without_rows_compute_nothing(tmp_path):
    """2 prompts on 4 data-parallel replicas: two replicas get no rows for every call, generation and inference
    included, and the run is the reference run."""
    common = ("rollout.prompts_per_iter=2", "algo.minibatches=1")
    reference = _metrics(tmp_path, "ref", *common)
    got = _metrics(tmp_path, "dp4", *common, "runtime.executor=ray", "runtime.devices=4")
    _assert_equivalent(got, reference)


@pytest.mark.parametrize("sharding", ["", "fsdp"], ids=["dp4", "fsdp4"])
def test_ranks_without_rows_match_the_reference(tmp_path, sharding):
    """4 devices and 2 rows per optimizer step (4 minibatches of 8 samples): two data-parallel ranks get no rows
    in the whole train call and still join every step's gradient sum (plain dp) or run its collective passes
    (FSDP: idle ones, and the critic recomputes activations); the result is the reference run's."""
    common = ("algo.minibatches=4",)
    reference = _metrics(tmp_path, "ref", *common)
    plan = (
        f"actor_gen=0-3:dp4; actor_train=0-3:dp4{sharding}; ref_inf=0-3:dp4; reward_inf=0-3:dp4; "
        f"critic_inf=0-3:dp4; critic_train=0-3:dp4mb2rc{sharding}; advantages=0:dp1"
    )
    cfg = _cfg(tmp_path, "fsdp4", *common, "runtime.executor=ray", "runtime.devices=4")
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run()
    got = [json.loads(line) for line in (tmp_path / "fsdp4" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, reference)


BF16 = ("runtime.precision=bf16",)
SAMPLES, MAX_NEW_TOKENS = 8, 6
"""Samples per iteration and their token budget in :func:`_cfg` (one sample per prompt)."""
BF16_TOLERANCE = {
    "rel": 5e-2,
    "abs_": 5e-3,
    "clipfrac_abs": 0.05,
    # one sample's share: a reward in [0, 1], a length up to MAX_NEW_TOKENS (module docstring)
    "samples_abs": {
        "reward/mean": 1 / SAMPLES,
        "reward/exact_match": 1 / SAMPLES,
        "response/length": MAX_NEW_TOKENS / SAMPLES,
        "response/length_max": MAX_NEW_TOKENS,
    },
}
"""See the module docstring."""


@pytest.fixture(scope="module")
def reference_bf16(tmp_path_factory):
    return _metrics(tmp_path_factory.mktemp("ref_bf16"), "ref", *BF16)


@pytest.mark.parametrize(
    "plan,devices",
    [
        (ZERO_PLAN_2, 2),
        (
            "actor_gen=0-3:dp4; actor_train=0-3:pp2tp2; ref_inf=0-3:pp2tp2; reward_inf=0-3:dp4; critic_inf=0-3:dp2tp2; "
            "critic_train=0-3:pp2tp2; advantages=0:dp1",
            4,
        ),
        (FSDP_PLAN_2, 2),
        (FSDP_TP_PLAN_4, 4),
    ],
    ids=["zero2_tp2_copy", "pipeline_tp4", "fsdp2", "fsdp_tp4"],
)
def test_bf16_plans_match_the_bf16_reference(tmp_path, reference_bf16, plan, devices):
    """Mixed precision under ZeRO-1 with a reallocated tp2 generation copy, under pp × tp (bf16 DTensor
    shards, bf16 activations between stages) and under FSDP (fp32 shards gathered as bf16, gradients
    reduce-scattered in fp32, bf16 copies reallocated from the fp32 shards; also over tp2 shards): the bf16
    reference run within bf16's tolerance."""
    cfg = _cfg(
        tmp_path,
        "plan",
        *BF16,
        "runtime.executor=ray",
        f"runtime.devices={devices}",
        "runtime.verify_reallocation=true",
    )
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run()
    got = [json.loads(line) for line in (tmp_path / "plan" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, reference_bf16, **BF16_TOLERANCE)


@pytest.mark.parametrize(
    "plan,devices,role", [(ZERO_PLAN_4, 4, "actor"), (FSDP_PLAN_2, 2, "critic")], ids=["zero4", "fsdp2"]
)
def test_bf16_checkpoints_keep_the_master_weights_across_layouts(tmp_path, reference_bf16, plan, devices, role):
    """Reference → Ray → reference, one bf16 iteration each: the fp32 master weights travel in the optimizer
    state, so the resumed run follows the uninterrupted one. Under ZeRO-1 (tp2 × dp2, pp2 × dp2) they are
    sharded and gathered whole again; under FSDP the fp32 shards are the masters, saved as the ``master``
    state beside weights rounded to bf16."""
    import torch

    RLTrainer(_cfg(tmp_path, "z", *BF16, "loop.iterations=1")).run()
    cfg = _cfg(tmp_path, "z", *BF16, "loop.iterations=2", "runtime.executor=ray", f"runtime.devices={devices}")
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run(resume=True)
    from loomrl.checkpoint.shards import read_role

    _, optim = read_role(tmp_path / "z" / "checkpoints" / "iter_000001", role)
    state = optim["state"]
    assert state and all(st["master"].dtype == torch.float32 for st in state.values())
    RLTrainer(_cfg(tmp_path, "z", *BF16)).run(resume=True)
    got = [json.loads(line) for line in (tmp_path / "z" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in got] == [0, 1, 2]
    _assert_equivalent(got, reference_bf16, **BF16_TOLERANCE)


def test_a_bf16_fsdp_run_resumes_exactly(tmp_path):
    """Stopped after one iteration and resumed under the same FSDP plan, a bf16 run computes exactly what the
    uninterrupted run does: the checkpoint's bf16 weights alone would lose the fp32 shards' low bits."""

    def run(name, iterations, resume=False):
        cfg = _cfg(
            tmp_path,
            name,
            *BF16,
            f"loop.iterations={iterations}",
            "runtime.executor=ray",
            "runtime.devices=2",
            "loop.save_every=1",
        )
        RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=FSDP_PLAN_2))).run(resume)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    whole = run("whole", 2)
    run("parts", 1)
    parts = run("parts", 2, resume=True)
    assert [r["iteration"] for r in parts] == [0, 1]
    assert {k: parts[1][k] for k in LOSS_KEYS} == {k: whole[1][k] for k in LOSS_KEYS}


@pytest.mark.parametrize("gen", ["0-1:tp2", "0:dp1"], ids=["tp_copy", "plain_copy"])
def test_copies_in_other_layouts_are_freed_after_their_last_use(tmp_path, gen):
    """Also from a checkpoint, whose weights safetensors may memory-map (such storage cannot be released)."""
    from loomrl.config.schema import SFTConfig
    from loomrl.train.sft import run_sft

    run_sft(load_config(SFTConfig, None, [f"out_dir={tmp_path / 'sft'}", "steps=2", "eval_prompts=4"]), progress=False)
    plan = (
        f"actor_gen={gen}; actor_train=0-1:dp2; ref_inf=0-1:dp2; reward_inf=0-1:dp2; critic_inf=0-1:dp2; "
        "critic_train=0-1:dp2; advantages=0:dp1"
    )
    cfg = _cfg(
        tmp_path,
        "free",
        "runtime.executor=ray",
        "runtime.devices=2",
        "loop.iterations=1",
        f"actor.model={tmp_path / 'sft'}",
    )
    trainer = RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan)))
    try:
        trainer.executor.run_iteration(0, trainer.make_batch(0))
        trainer.executor.run_iteration(1, trainer.make_batch(1))  # refilled, used and freed again
        report = ray.get(trainer.executor.workers[0].memory_report.remote(), timeout=60)
    finally:
        trainer.close()
    gen_key = "actor@0-1:dp1tp2" if gen == "0-1:tp2" else "actor@0:dp1"
    assert report[gen_key] == 0, report  # the generation copy, freed after actor_gen
    assert report["actor@0-1:dp2"] > 0, report  # the training weights stay
    assert report["ref@0-1:dp2"] > 0, report  # frozen roles are not freed
