"""Asynchronous training with bounded staleness (``async=N`` in a plan): generation runs N batches ahead.

The plan fixes the interleaving (iteration i generates the prompts of iteration i + N with the weights of version
i), so an asynchronous run is deterministic: the reference executor computes it in one process and the Ray
runtime must equal it exactly as it equals synchronous runs (the same samples, losses within 1e-4 relative: see
tests/test_runtime.py for why). The off-policy corrections (``algo.off_policy``: the decoupled objective,
truncated and masked importance sampling, geometric rejection) are checked as loss functions and through their
statistics in runs.
"""

import dataclasses
import functools
import json
import shutil
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loomrl.algorithms import losses as L
from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.plan import ClusterSpec
from loomrl.plan.plan import AsyncTraining, ExecutionPlan
from loomrl.plan.plan_string import format_plan_string, parse_plan_string
from loomrl.plan.schedule import StepKind, build_schedule
from loomrl.plan.strategies import make_plan
from loomrl.train.rl import RLTrainer
from test_runtime import _assert_equivalent, _cfg

pytestmark = pytest.mark.usefixtures("ray_session")


def _workflow(*extra):
    cfg = load_config(TrainConfig, None, list(extra))
    return build_workflow(cfg.algo, cfg.rollout, cfg.reward)


def _run(tmp_path, name, plan, *extra, resume=False):
    cfg = _cfg(tmp_path, name, *extra)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))
    RLTrainer(cfg).run(resume=resume)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- the plan
def test_async_round_trips_through_plan_strings_and_files(tmp_path):
    workflow, cluster = _workflow(), ClusterSpec(nodes=1, devices_per_node=2)
    plan = make_plan("separate; async=2", workflow, cluster)
    assert plan.staleness == 2 and "async=2" in format_plan_string(plan, workflow)
    assert parse_plan_string(format_plan_string(plan, workflow), workflow, cluster) == plan
    assert make_plan("separate; async=max_staleness:2", workflow, cluster) == plan
    plan.save(tmp_path / "p.yaml")
    assert "async:" in (tmp_path / "p.yaml").read_text()
    assert ExecutionPlan.load(tmp_path / "p.yaml") == plan
    assert make_plan("separate", workflow, cluster).staleness == 0
    partial = make_plan("separate; async=2,partial_rollout:on,segment_tokens:3", workflow, cluster)
    assert partial.asynchronous == AsyncTraining(2, partial_rollout=True, segment_tokens=3)
    assert "async=max_staleness:2,partial_rollout:on,segment_tokens:3" in format_plan_string(partial, workflow)
    assert parse_plan_string(format_plan_string(partial, workflow), workflow, cluster) == partial
    partial.save(tmp_path / "partial.yaml")
    assert ExecutionPlan.load(tmp_path / "partial.yaml") == partial


@pytest.mark.parametrize(
    "text, message",
    [
        ("separate; async=0", r"async.*>= 1"),
        ("separate; async=x", r"'x' is not N, max_staleness:N, partial_rollout:on\|off or segment_tokens:N"),
        ("separate; async=1,partial_rollout:on", r"partial_rollout: needs max_staleness >= 2 \(got 1\)"),
        ("separate; async=2,segment_tokens:4", r"segment_tokens: applies to partial rollouts only"),
        ("colocate; stream_fusion=on; async=1", r"plan.async: stream fusion .* choose one"),
    ],
)
def test_bad_async_settings_are_one_line_errors(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        make_plan(text, _workflow(), ClusterSpec(nodes=1, devices_per_node=2))
    assert "\n" not in str(err.value)


def test_a_plan_file_names_its_async_key(tmp_path):
    data = make_plan("separate", _workflow(), ClusterSpec(nodes=1, devices_per_node=2)).to_dict()
    with pytest.raises(ConfigError, match=r"plan.async.max_staleness"):
        ExecutionPlan.from_dict({**data, "async": {"max_staleness": -1}})


def test_a_run_keeps_one_staleness_and_refuses_what_async_cannot_do(tmp_path):
    base = ("runtime.executor=ray", "runtime.devices=2", "runtime.plan=separate; async=1")
    with pytest.raises(ConfigError, match=r"plan_changes.2: its staleness"):
        RLTrainer(_cfg(tmp_path, "a", *base, "runtime.plan_changes={2: separate}"))
    with pytest.raises(ConfigError, match=r"algo.dynamic_sampling.enabled: not available with an asynchronous"):
        RLTrainer(_cfg(tmp_path, "b", *base, "algo.name=grpo", "algo.dynamic_sampling.enabled=true"))


# ---------------------------------------------------------------------------------------------- the schedule
def _deps(schedule):
    return {s.id: set(s.deps) for s in schedule.steps}


def test_separated_generation_overlaps_training_and_its_shadow_waits_for_it():
    workflow, cluster = _workflow(), ClusterSpec(nodes=1, devices_per_node=2)
    deps = _deps(build_schedule(workflow, make_plan("separate; async=1", workflow, cluster)))
    assert not any("actor_gen" in d for step, d in deps.items() if not step.startswith("sync"))
    assert "actor_gen" in deps["sync actor→0:dp1"] and "actor_train" in deps["sync actor→0:dp1"]
    schedule = build_schedule(workflow, make_plan("separate; async=1", workflow, cluster))
    assert schedule.ahead == ("actor_gen",) and [s.id for s in schedule.fill] == ["actor_gen"]


def test_generation_on_the_training_weights_runs_before_their_update():
    workflow, cluster = _workflow(), ClusterSpec(nodes=1, devices_per_node=2)
    deps = _deps(build_schedule(workflow, make_plan("colocate; async=1", workflow, cluster)))
    assert "actor_gen" in deps["actor_train"] and "actor_gen" not in deps["ref_inf"]
    # generation in another layout reads a copy made before the update; the update waits for the copy only
    plan = make_plan(
        "actor_gen=0-1:tp2; ref_inf=0-1; reward_inf=0-1; critic_inf=0-1; actor_train=0-1; critic_train=0-1; async=2",
        workflow,
        cluster,
    )
    schedule = build_schedule(workflow, plan)
    copy = next(s.id for s in schedule.steps if s.kind is StepKind.COPY)
    assert copy in _deps(schedule)["actor_train"] and "actor_gen" not in _deps(schedule)["actor_train"]
    assert [s.kind for s in schedule.fill] == [StepKind.COPY, StepKind.CALL, StepKind.FREE]


# ------------------------------------------------------------------------------------------ off-policy losses
def test_behaviour_weights_decoupled_leaves_out_and_tis_truncates():
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    behav = torch.log(torch.tensor([[0.5, 0.3, 0.4]]))
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, stats = L.behaviour_weights(prox, behav, mask, "decoupled", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.5]]))
    assert stats["is_capped"] == pytest.approx(1 / 3) and stats["is_weight"] == pytest.approx((1 + 3 + 0.5) / 3)
    w, _ = L.behaviour_weights(prox, behav, mask, "tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.5]]))


def test_a_weighted_policy_loss_weights_each_tokens_gradient():
    torch.manual_seed(0)
    logp = torch.randn(2, 4, requires_grad=True)
    old, adv = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    ones, _ = L.policy_loss(logp, old, adv, mask, 0.2, weight_BT=torch.ones(2, 4))
    assert ones.item() == pytest.approx(L.policy_loss(logp, old, adv, mask, 0.2)[0].item())
    weight = torch.tensor([[2.0, 0.0, 1.0, 5.0], [0.5, 1.0, 3.0, 3.0]])
    loss, _ = L.policy_loss(logp, old, adv, mask, 0.2, weight_BT=weight)
    (grad,) = torch.autograd.grad(loss, logp)
    (plain,) = torch.autograd.grad(L.policy_loss(logp, old, adv, mask, 0.2)[0], logp)
    assert torch.allclose(grad, plain * weight * mask)


def test_an_off_policy_correction_recomputes_the_proximal_log_probs():
    workflow = _workflow("algo.name=grpo", "algo.off_policy=decoupled")
    assert "actor_inf" in workflow
    assert {"old_logp", "logp"} <= set(workflow["actor_train"].inputs)


# ------------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def reference_async(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref_async"), "ref", "separate; async=1", "runtime.devices=2")


def test_a_reference_async_run_trains_on_stale_batches(tmp_path, reference_async):
    """Staleness is what the plan says (the first batch was generated by the initial weights, as was the second),
    and an asynchronous run is not the synchronous one."""
    assert [m["async/staleness"] for m in reference_async] == [0.0, 1.0, 1.0]
    sync = _run(tmp_path, "sync", "separate", "runtime.devices=2")
    assert sync[0]["actor/pg_loss"] == reference_async[0]["actor/pg_loss"]  # the same first iteration
    assert sync[2]["actor/pg_loss"] != reference_async[2]["actor/pg_loss"]
    assert "async/staleness" not in sync[0]


SEPARATE_DP2 = (
    "actor_gen=0-1:dp2; ref_inf=2-3; reward_inf=2-3; critic_inf=2-3; actor_train=2-3; critic_train=2-3; "
    "advantages=2:dp1; async=1"
)


@pytest.mark.parametrize(
    "plan, devices, controllers",
    [("separate; async=1", 2, 1), ("colocate; async=1", 2, 1), (SEPARATE_DP2, 4, 2)],
    ids=["separate", "colocate", "separate_dp2_two_controllers"],
)
def test_ray_async_runs_match_the_reference(tmp_path, reference_async, plan, devices, controllers):
    """PPO at η = 1: separated generation (its shadow refreshed after it ends), generation on the training
    weights (before their update), and data-parallel generation driven by two parallel controllers, each keeping
    its shard of the batch generated ahead."""
    got = _run(
        tmp_path,
        "ray",
        plan,
        "runtime.executor=ray",
        f"runtime.devices={devices}",
        f"runtime.controllers={controllers}",
    )
    _assert_equivalent(got, reference_async)
    assert [m["async/staleness"] for m in got] == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "algo, off_policy, band",
    [
        ("grpo", "decoupled", ()),
        ("rloo", "tis", ()),
        ("grpo", "mis", ()),
        ("rloo", "geo_reject", ("algo.is_low=0.9", "algo.is_cap=1.1")),
    ],
)
def test_group_algorithms_with_staleness_two_and_a_correction_match_the_reference(tmp_path, algo, off_policy, band):
    """GRPO at η = 2 with the decoupled objective (RLOO with TIS; GRPO with masked importance sampling in its default
    band [0.5, 2], RLOO with geometric rejection in [0.9, 1.1]) on 4 devices, generation reallocated to TP=2
    beside data-parallel training: the Ray run equals the reference; the importance weights are 1 where the batch
    was generated by the policy it trains (the first, generated by the initial weights) and not after, and only
    then does a masking correction drop anything. The training-inference mismatch is float noise on the first batch
    and the policy's drift after."""
    extra = (
        f"algo.name={algo}",
        "algo.group_size=4",
        "rollout.prompts_per_iter=4",
        f"algo.off_policy={off_policy}",
        "loop.iterations=4",
        *band,
    )
    plan = "actor_gen=0-1:tp2; ref_inf=2-3; reward_inf=2-3; actor_inf=2-3; actor_train=2-3; advantages=2:dp1; async=2"
    ref = _run(tmp_path, "ref", plan, "runtime.devices=4", *extra)
    got = _run(tmp_path, "ray", plan, "runtime.executor=ray", "runtime.devices=4", *extra)
    _assert_equivalent(got, ref)
    assert [m["async/staleness"] for m in got] == [0.0, 1.0, 2.0, 2.0]
    assert got[0]["offpolicy/is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert abs(got[3]["offpolicy/is_weight"] - 1.0) > 1e-4
    assert got[0]["mismatch/mean_abs_logp_diff"] < 1e-4 < got[3]["mismatch/mean_abs_logp_diff"]
    if off_policy in ("mis", "geo_reject"):
        assert got[0]["offpolicy/is_dropped"] == 0 < got[3]["offpolicy/is_dropped"] < 1


def test_an_async_checkpoint_resumes_to_the_same_run(tmp_path, reference_async):
    """A checkpoint taken while a batch is generated ahead holds it (it was sampled by weights the run no longer
    has): a Ray run stopped after its second iteration and resumed continues as if it had not stopped."""
    ray_run = ("separate; async=1", "runtime.devices=2", "runtime.executor=ray")
    _run(tmp_path, "r", *ray_run, "loop.save_every=1")
    checkpoints = tmp_path / "r" / "checkpoints"
    assert (checkpoints / "iter_000001" / "pending.pt").exists()
    shutil.rmtree(checkpoints / "iter_000002")  # as if it had stopped before its last iteration
    (checkpoints / "latest").write_text("iter_000001\n")
    got = _run(tmp_path, "r", *ray_run, resume=True)
    assert [m["iteration"] for m in got] == [0, 1, 2]
    assert got[2]["async/staleness"] == 1.0  # the batch the checkpoint held, not one generated anew
    _assert_equivalent(got, reference_async)


def test_a_finished_async_run_extended_refills_its_pipeline(tmp_path, reference_async):
    """A run that ended generated nothing past its end: resumed with more iterations, it generates the batches
    its checkpoint does not hold with the weights it resumes with (staleness 0), as at a run's start, and goes on
    at its staleness."""
    run = ("separate; async=1", "runtime.devices=2")
    _run(tmp_path, "x", *run, "loop.save_every=1")
    got = _run(tmp_path, "x", *run, "loop.save_every=1", "loop.iterations=5", resume=True)
    assert [m["iteration"] for m in got] == [0, 1, 2, 3, 4]
    assert [m["async/staleness"] for m in got] == [0.0, 1.0, 1.0, 0.0, 1.0]
    _assert_equivalent(got[:3], reference_async)


def test_a_run_that_lost_devices_keeps_its_staleness(tmp_path, monkeypatch, reference_async):
    """A worker lost with its device (simulated: 2 of 4 devices counted after the failure) under an asynchronous
    plan that does not fit the devices left: the run falls back to colocating every call at the same staleness,
    resumes from the checkpoint with its batch generated ahead, and computes the same run."""
    from test_recovery import lose_devices

    cfg = _cfg(
        tmp_path,
        "lost",
        "runtime.executor=ray",
        "runtime.devices=4",
        "runtime.max_failures=1",
        "loop.save_every=1",
    )
    trainer = RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=SEPARATE_DP2)))
    lose_devices(trainer, monkeypatch)
    trainer.run()
    assert trainer.plan.cluster.n_devices == 2 and trainer.plan.staleness == 1
    got = [json.loads(line) for line in (tmp_path / "lost" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in got] == [0, 1, 2] and got[1]["recovery/devices"] == 2
    assert [m["async/staleness"] for m in got] == [0.0, 1.0, 1.0]
    _assert_equivalent([{k: v for k, v in m.items() if not k.startswith("recovery/")} for m in got], reference_async)


# --------------------------------------------------------------------------------------- pricing and search
def test_the_simulator_prices_an_async_iteration_as_the_longer_side_plus_the_sync():
    """gen (4 s) on device 0, ref inference (1 s) and training (3 s) on device 1, a shadow sync of 1 s: a
    synchronous iteration is their chain, 4 + 1 + 3 + 1 = 9 s; an asynchronous one overlaps generation with the
    rest, max(4, 1 + 3) + 1 = 5 s."""
    from loomrl.planner.simulation.simulator import simulate
    from test_simulator import CHAIN, FakeCost, plan_of

    placement = {"gen": "0", "inf": "1", "train": "1"}
    cost = FakeCost({"gen": 4.0, "inf": 1.0, "train": 3.0}, realloc=1.0)
    sync = simulate(plan_of(2, placement), CHAIN, cost, 1e12, iterations=4)
    stale = simulate(plan_of(2, placement, asynchronous=AsyncTraining(1)), CHAIN, cost, 1e12, iterations=4)
    assert sync.iteration_time == pytest.approx(9.0) and stale.iteration_time == pytest.approx(5.0)


def test_loomrl_plan_shows_synchronous_fused_and_async_side_by_side(tmp_path, capsys):
    from loomrl.cli import main

    argv = ["plan", "--cluster", "h100:1x8", "--model", "llama2-7b", "--search-steps", "5", "--out", str(tmp_path)]
    assert main([*argv, "--max-staleness", "2"]) == 0
    out = capsys.readouterr().out
    assert "synchronous, stream-fused and asynchronous (staleness <= 2)" in out
    assert "async=1" in out
    assert main([*argv, "--max-staleness", "-1"]) == 2
    assert "--max-staleness: -1 is not a number of policy versions >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ partial rollouts
PARTIAL = ("algo.name=grpo", "algo.group_size=4", "rollout.prompts_per_iter=4", "algo.off_policy=decoupled")


@pytest.fixture(scope="module")
def reference_partial(tmp_path_factory):
    """GRPO at η = 2 with partial rollouts: every sample pauses after 2 tokens in the iteration it starts in and
    ends in the next, under the weights of that one (responses of up to 6 tokens)."""
    plan = "separate; async=2,partial_rollout:on,segment_tokens:2"
    return _run(tmp_path_factory.mktemp("ref_partial"), "ref", plan, "runtime.devices=2", "loop.iterations=5", *PARTIAL)


def test_partial_rollouts_spread_a_batch_over_two_policy_versions(tmp_path, reference_partial):
    """The batches generated ahead from the first iteration's weights were generated whole (staleness 0 and 1);
    from the third iteration on every batch's first two tokens of each sample are two versions old and the rest
    one: the largest gap is the bound, the mean over tokens between 1 and 2 (exactly 1 + 2 / mean length). With
    segments at least as long as the responses nothing pauses and the run is the plain asynchronous one."""
    stale = [m["async/staleness"] for m in reference_partial]
    assert stale == [0.0, 1.0, 2.0, 2.0, 2.0]
    for m in reference_partial[2:]:
        assert m["async/staleness_mean"] == pytest.approx(1 + 2 / m["response/length"], rel=1e-6)
    plain = _run(tmp_path, "plain", "separate; async=2", "runtime.devices=2", "loop.iterations=5", *PARTIAL)
    whole = "separate; async=2,partial_rollout:on,segment_tokens:6"
    unpaused = _run(tmp_path, "whole", whole, "runtime.devices=2", "loop.iterations=5", *PARTIAL)
    assert [m["actor/pg_loss"] for m in unpaused] == [m["actor/pg_loss"] for m in plain]
    assert [m["actor/pg_loss"] for m in reference_partial[3:]] != [m["actor/pg_loss"] for m in plain[3:]]


PARTIAL_DP2 = (
    "actor_gen=0-1:dp2; ref_inf=2-3; reward_inf=2-3; actor_inf=2-3; actor_train=2-3; advantages=2:dp1; "
    "async=2,partial_rollout:on,segment_tokens:2"
)


@pytest.mark.parametrize(
    "plan, devices, controllers",
    [
        ("separate; async=2,partial_rollout:on,segment_tokens:2", 2, 1),
        (PARTIAL_DP2, 4, 1),
        (PARTIAL_DP2, 4, 2),
    ],
    ids=["separate", "dp2_generation", "two_controllers"],
)
def test_ray_partial_rollouts_match_the_reference(tmp_path, reference_partial, plan, devices, controllers):
    """The paused samples held by the controller of their shard and continued by whichever of its generation
    replicas gets them: the samples, their token versions and the losses are the reference's (with two parallel
    controllers the staleness mean is counted over both shards' tokens)."""
    got = _run(
        tmp_path,
        "ray",
        plan,
        "runtime.executor=ray",
        f"runtime.devices={devices}",
        f"runtime.controllers={controllers}",
        "loop.iterations=5",
        *PARTIAL,
    )
    _assert_equivalent(got, reference_partial)
    for key in ("async/staleness", "async/staleness_mean"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in reference_partial], rel=1e-9)


@pytest.mark.parametrize(
    "executor, plan, devices, controllers",
    [
        ("reference", "separate; async=2,partial_rollout:on,segment_tokens:2", 2, 1),
        ("ray", "separate; async=2,partial_rollout:on,segment_tokens:2", 2, 1),
        ("ray", PARTIAL_DP2, 4, 2),
    ],
    ids=["reference", "ray", "ray_two_controllers"],
)
def test_a_checkpoint_with_paused_samples_resumes_to_the_same_run(
    tmp_path, reference_partial, executor, plan, devices, controllers
):
    """A checkpoint taken while samples are paused holds their tokens, behaviour log-probs and versions (on Ray,
    with the controller that held each): a run stopped after its third iteration and resumed continues them as if
    it had not stopped."""
    run = (plan, f"runtime.devices={devices}", f"runtime.executor={executor}", f"runtime.controllers={controllers}")
    _run(tmp_path, "r", *run, "loop.iterations=5", "loop.save_every=1", "checkpoint.keep_last=5", *PARTIAL)
    checkpoints = tmp_path / "r" / "checkpoints"
    pending = torch.load(checkpoints / "iter_000002" / "pending.pt", weights_only=True)
    assert "in_flight" in pending and pending["in_flight"][2]
    for name in ("iter_000003", "iter_000004"):
        shutil.rmtree(checkpoints / name)
    (checkpoints / "latest").write_text("iter_000002\n")
    got = _run(tmp_path, "r", *run, "loop.iterations=5", *PARTIAL, resume=True)
    assert [m["iteration"] for m in got] == [0, 1, 2, 3, 4]
    _assert_equivalent(got, reference_partial)
    assert [m["async/staleness_mean"] for m in got] == pytest.approx(
        [m["async/staleness_mean"] for m in reference_partial], rel=1e-9
    )


def test_partial_rollouts_refuse_what_cannot_pause(tmp_path):
    plan = "runtime.plan=separate; async=2,partial_rollout:on"
    with pytest.raises(ConfigError, match=r"algo: not available with partial rollouts"):
        RLTrainer(_cfg(tmp_path, "b", plan, "algo.name=remax", "runtime.devices=2"))


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=16),
    staleness=st.integers(2, 5),
    segment=st.one_of(st.none(), st.integers(1, 64)),
)
def test_partial_rollouts_never_train_a_token_older_than_the_bound(lengths, staleness, segment):
    """Over random response lengths: a batch trained in iteration t starts generating in iteration t - η; in each
    later call its samples pause where :meth:`PartialRollout.pause_at` says, and in the call of iteration t - 1
    they run to their end. So every sample is complete before its iteration, every token was sampled by a policy
    between t - η and t - 1 versions (never older than the bound), and each call's share of a sample is the piece
    the simulator prices (:func:`~loomrl.planner.cost.decode.partial_pieces`, the runtime's default segment taken
    from the longest budget)."""
    from loomrl.algorithms.context import PartialRollout
    from loomrl.planner.cost.decode import partial_pieces

    t, budget = 10, max(lengths)
    pieces = []
    for n in lengths:
        versions: list[int] = []
        for version in range(t - staleness, t):
            if len(versions) == n:
                break
            stop = PartialRollout(version, staleness, segment, {}).pause_at(t, len(versions), budget)
            made = n - len(versions) if stop is None else min(n, stop) - len(versions)
            versions += [version] * made
            pieces.append(made)
        assert len(versions) == n
        assert t - staleness <= min(versions) and max(versions) <= t - 1
    assert tuple(p for p in pieces if p) == partial_pieces(lengths, staleness, segment)


def test_a_partial_rollout_call_interrupts_every_sample_at_the_same_step():
    """Rows with budgets of 4 and 12 tokens at staleness 2 (eos ignored): the weight update falls at the same
    decode step for both, half the call's largest budget (6), so the short one ends and the long one pauses there
    with its tokens' versions; continued by the next version's call it ends as the whole sample would."""
    from loomrl.algorithms.context import OpContext, PartialRollout, Role
    from loomrl.algorithms.ops import generate_op
    from loomrl.models.tokenizer import build_char_tokenizer
    from loomrl.models.zoo import build_causal_lm
    from loomrl.rollout import SamplingParams
    from loomrl.workflow.batch import Batch

    tok = build_char_tokenizer()
    model = build_causal_lm("llama-1m", tok, seed=0)
    prompt = [tok.bos_token_id] + tok.encode("sort 31=", add_special_tokens=False)
    batch = Batch([1, 2], {"prompt_ids": [prompt, prompt], "max_new_tokens": [4, 12]})
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    ctx = OpContext(Role("actor", model), 5, 7, tok.pad_token_id, tok.eos_token_id, str)
    whole = generate_op(ctx, batch, params)
    first = PartialRollout(version=5, max_staleness=2, segment_tokens=None, resumed={})
    out = generate_op(dataclasses.replace(ctx, partial=first), batch, params)
    assert set(first.paused) == {2} and first.paused[2].tokens == tuple(whole["response_ids"][1][:6])
    assert out["response_ids"][0] == whole["response_ids"][0] and first.versions[1] == (5,) * 4
    second = PartialRollout(version=6, max_staleness=2, segment_tokens=None, resumed=dict(first.paused))
    rest = generate_op(dataclasses.replace(ctx, partial=second), batch.select([1]), params)
    assert rest["response_ids"][0] == whole["response_ids"][1] and not second.paused
    assert second.versions[2] == (5,) * 6 + (6,) * 6


def test_the_search_tries_partial_rollouts_from_a_bound_of_two():
    """Under a staleness bound of 2 the search tries a plan synchronous, at staleness 1 and with partial rollouts
    at 2; under 1 not the last; a workflow with two rollouts (ReMax) cannot pause them and is not offered it."""
    from loomrl.planner.search.search import async_choices

    cluster = ClusterSpec(nodes=1, devices_per_node=2)

    class _Evaluate:
        def __init__(self, workflow):
            self.workflow = workflow

    grpo = _Evaluate(_workflow("algo.name=grpo"))
    plan = make_plan("separate", grpo.workflow, cluster)
    assert async_choices(plan, grpo, 2) == [AsyncTraining(1), AsyncTraining(2, partial_rollout=True)]
    assert async_choices(plan, grpo, 1) == [AsyncTraining(1)]
    remax = _Evaluate(_workflow("algo.name=remax"))
    assert async_choices(make_plan("separate", remax.workflow, cluster), remax, 4) == [AsyncTraining(1)]


@functools.cache
def _tiny_policy():
    from loomrl.models.tokenizer import build_char_tokenizer
    from loomrl.models.zoo import build_causal_lm

    tok = build_char_tokenizer()
    return tok, build_causal_lm("llama-1m", tok, seed=0)


@pytest.mark.parametrize(
    "setting", ["async=1", "async=3", "async=2,partial_rollout:on", "async=3,partial_rollout:on,segment_tokens:3"]
)
@settings(max_examples=6, deadline=None)
@given(budgets=st.lists(st.lists(st.integers(1, 16), min_size=4, max_size=4), min_size=5, max_size=6))
def test_the_pipeline_admits_at_most_its_bound_and_trains_only_whole_fresh_enough_batches(setting, budgets):
    """The reference executor's pipeline with the real generate op over random response lengths (each sample's
    budget, eos ignored), at staleness η with and without partial rollouts: before each iteration t its batch is
    whole (every sample at its full length), every token was sampled by a policy of a version in [t - η, t - 1]
    (the pipeline's fill: the initial weights), and the samples accepted and not yet trained, with the prompts the
    iteration admits, never exceed AReaL's bound of (η + 1) batches ((η + t + 1) batches accepted in all)."""
    from loomrl.algorithms.context import Role
    from loomrl.algorithms.ops import generate_op
    from loomrl.rollout import SamplingParams
    from loomrl.runtime.ahead import VERSIONS
    from loomrl.runtime.reference import ReferenceExecutor
    from loomrl.workflow import MFC, MFCKind, Workflow
    from loomrl.workflow.batch import Batch, response_tokens

    staleness = int(setting.partition(",")[0].removeprefix("async="))
    tok, model = _tiny_policy()
    params = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    gen_inputs = ("prompt_ids", "max_new_tokens")
    workflow = Workflow(
        [
            MFC(
                "actor_gen",
                "actor",
                MFCKind.GENERATE,
                gen_inputs,
                ("response_ids", "logp", "mask"),
                op=partial(generate_op, params=params),
            ),
            MFC("actor_train", "actor", MFCKind.TRAIN, ("response_ids",), (), op=lambda ctx, batch: {"stats": {}}),
        ],
        gen_inputs,
    )
    plan = make_plan(f"separate; {setting}", workflow, ClusterSpec(nodes=1, devices_per_node=2, device_kind="cpu"))
    executor = ReferenceExecutor(
        build_schedule(workflow, plan), {"actor": Role("actor", model)}, 0, tok.pad_token_id, tok.eos_token_id, str
    )
    size, iterations = len(budgets[0]), len(budgets)
    prompt = [tok.bos_token_id, *tok.encode("sort 31=", add_special_tokens=False)]

    def prompts(i: int) -> Batch:
        return Batch([i * size + k for k in range(size)], {"prompt_ids": [prompt] * size, "max_new_tokens": budgets[i]})

    for i in range(min(staleness, iterations)):
        executor.generate_ahead(i, prompts(i), 0)
    for t in range(iterations):
        held = executor.pending
        batch = held.batches[t]
        assert sorted(batch.ids) == prompts(t).ids
        length = dict(zip(batch.ids, response_tokens(batch)))
        assert [length[s] for s in prompts(t).ids] == budgets[t]
        versions = [v for row in batch[VERSIONS] for v in row]
        assert max(0, t - staleness) <= min(versions) and max(versions) <= max(0, t - 1)
        admitted = size if t + staleness < iterations else 0
        accepted = sum(map(len, held.batches.values())) + len(held.in_flight or ()) + admitted
        assert accepted <= (staleness + 1) * size
        ahead = (t + staleness, prompts(t + staleness)) if admitted else None
        result = executor.run_iteration(t, prompts(t), ahead=ahead)
        assert result.stats["async/staleness"] <= staleness
    assert not executor.pending.batches and executor.pending.in_flight is None
